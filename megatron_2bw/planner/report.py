"""What the planner prints: the ranked table, JSON, the trainer's command, and the paper's comparisons.

Everything here formats results or re-runs the search; the costs and bytes come from
``search``/``memory_model``. ``max_model_size`` is the one search of its own: a doubling then
bisection over the number of layers, each probe evaluated by ``search.evaluate``. The trainer's
command is rendered by ``argv.pretrain_argv`` from the same flag table the trainer parses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from ..argv import pretrain_argv, render
from ..config import Layout, ModelConfig
from ..config.arith import flops_per_step
from ..config.context import ALL_GATHER, P2P
from ..config.moe_presets import parameter_counts
from ..config.presets import get_preset
from ..errors import ConfigError
from ..schedule.schedules import SCHEDULE_NAMES
from ..schedule.stages import format_split
from . import moe_report
from .hardware import Cluster, GiB, load_cluster
from .layer_costs import LayerCosts, analytic_microbatch_costs
from .memory_model import SEQUENTIAL, Candidate, fp32_grads_for
from .search import Evaluated, PlanRequest, SearchResult, default_costs, evaluate, search
from .staleness import STALENESS_NOTE, staleness

PAPER_CLUSTER = "aws-p3.16xlarge"
PAPER_SEQ_LENGTH = 512
# Megatron's default dropout, which the paper's runs used (our presets default to 0 for tests).
PAPER_DROPOUT = 0.1


def paper_model(name: str) -> ModelConfig:
    """One of the paper's models as it was trained: sequence 512, Megatron's dropout 0.1."""
    return get_preset(name, seq_length=PAPER_SEQ_LENGTH, max_position_embeddings=PAPER_SEQ_LENGTH,
                      hidden_dropout=PAPER_DROPOUT, attention_dropout=PAPER_DROPOUT)


# ---- one configuration --------------------------------------------------------------------------

def candidate_layout(c: Candidate) -> Layout:
    """A search candidate as the trainer's layout (t, d, microbatch, recompute, schedule, stage split,
    distributed optimizer, context parallelism)."""
    return Layout.of(c.axes, c.micro_batch_size, c.recompute, c.schedule, layer_split=c.layer_split,
                     distributed_optimizer=c.distributed_optimizer, cp_comm_type=c.cp_comm_type)


def context_argv(layout: Layout, kind: str) -> list[str]:
    """``--context-parallel-size`` and ``--cp-comm-type`` of a layout with context parallelism (none without)."""
    if layout.context == 1:
        return []
    return render({"parallel.context": layout.context, "parallel.cp_comm_type": layout.cp_comm_type}, kind)


def fp32_grads_flag(request: PlanRequest) -> bool | None:
    """The gradient-accumulation switch the command must state: None when it is the precision's default."""
    asked = request.accumulates_in_fp32
    return None if request.precision == "fp32" or asked == fp32_grads_for(request.precision) else asked


def pretrain_command(ev: Evaluated, request: PlanRequest) -> list[str]:
    """The ``pretrain_gpt.py`` (or ``pretrain_bert.py``) command line that runs ``ev``."""
    c = ev.candidate
    model = request.model
    if model.family.gpt_options and model.sequence_parallel != c.sequence_parallel:  # the search's choice
        model = replace(model, sequence_parallel=c.sequence_parallel)
    layout = candidate_layout(c)
    argv = pretrain_argv(model, layout, c.global_batch_size, request.precision, fp32_grads_flag(request))
    backend = request.cluster.attention_backend  # the kernel the memory was counted for
    return argv + context_argv(layout, model.kind) + recompute_policy_argv(c, request.model.kind) + (
        ["--attention-backend", backend] if backend != "auto" else []) + moe_report.moe_argv(model, c)


def recompute_policy_argv(c: Candidate, kind: str) -> list[str]:
    """Megatron's ``--recompute-granularity/-method/-num-layers`` of a candidate's policy inside stages."""
    p = c.recompute_policy
    if p is None:
        return []
    return render({"pipeline.recompute_granularity": p.granularity, "pipeline.recompute_method": p.method,
                   "pipeline.recompute_num_layers": p.num_layers}, kind)


def tokens_per_sec(ev: Evaluated, req: PlanRequest) -> float:
    """Predicted tokens per second of the whole job."""
    return ev.samples_per_sec * req.model.seq_length


def mfu(ev: Evaluated, req: PlanRequest) -> float:
    """Predicted model FLOPs utilization: model FLOPs per second per GPU (Megatron's formula, no recomputation
    counted: config/arith.py) over the device's dense peak in the plan's precision."""
    per_sample = flops_per_step(req.model, 1)
    return ev.samples_per_sec * per_sample / (req.num_gpus * req.cluster.peak(req.precision))


def describe(ev: Evaluated, req: PlanRequest | None = None) -> dict[str, Any]:
    """The JSON fields of one configuration (with ``req``: tokens/s and MFU too)."""
    c, p = ev.candidate, ev.prediction
    rates = {"tokens_per_sec": round(tokens_per_sec(ev, req), 1), "mfu": round(mfu(ev, req), 4)} if req else {}
    return {
        "tensor_parallel": c.tensor_parallel, "pipeline_parallel": c.pipeline_parallel,
        "data_parallel": c.data_parallel, "micro_batch_size": c.micro_batch_size,
        "num_micro_batches": c.num_micro_batches, "global_batch_size": c.global_batch_size,
        "recompute": c.recompute, "schedule": c.schedule, "distributed_optimizer": c.distributed_optimizer,
        "sequence_parallel": c.sequence_parallel,
        "context_parallel": c.context_parallel, "cp_comm_type": c.cp_comm_type if c.context_parallel > 1 else None,
        "layer_split": list(c.layer_split) if c.layer_split else None,  # layers per stage; None: even
        "samples_per_sec": round(ev.samples_per_sec, 3),
        "memory_bytes_per_gpu": ev.memory_bytes_per_gpu,
        "memory_bytes_by_stage": {str(s.stage): s.total for s in ev.memory},  # the stages that can peak
        # --async-save's host copy of what a rank writes (host memory, not in memory_bytes_per_gpu; 0 without it)
        "async_save_host_bytes_per_gpu": ev.host_save_bytes_per_gpu,
        "batch_seconds": round(p.batch_s, 6) if p else None,
        "bubble_seconds": round(p.bubble_s, 6) if p else None,
        "exposed_allreduce_seconds": round(p.exposed_allreduce_s, 6) if p else None,
        "recompute_policy": c.recompute_policy.label if c.recompute_policy else None,  # inside stages
        "staleness": (staleness(c, req.compensation, req.optimizer, req.precision) if req else staleness(c)).to_json(),
        **rates, **(moe_report.plan_fields(ev, req.model) if req else {}),
    }


def _plan_margin(req: PlanRequest) -> str:
    """The margin a plan keeps (``--memory-margin``), as the header says it."""
    m = req.memory_margin
    return f", plans keep {m:.0%} free (--memory-margin): at most {req.memory_limit_bytes / GiB:.1f} GiB" if m else ""


def _stage_memory_text(ev: Evaluated) -> str:
    """Stage 0 / the fullest middle stage / the last stage (the stages ``plan_memory`` returns)."""
    mem = ev.memory
    if len(mem) > 3:
        mem = (mem[0], max(mem[1:-1], key=lambda s: s.total), mem[-1])
    return "/".join(f"{s.total / GiB:.1f}" for s in mem)


def recompute_text(c: Candidate) -> str:
    """``yes`` (whole stages), a policy inside stages (``selective``, ``uniform1``), or ``no``."""
    return "yes" if c.recompute else c.recompute_policy.label if c.recompute_policy else "no"


def context_text(c: Candidate) -> str:
    """The context-parallel size and its communication (``4 ag``: all_gather, ``2 p2p``), or ``1``."""
    return "1" if c.context_parallel == 1 else f"{c.context_parallel} {'ag' if c.cp_comm_type == ALL_GATHER else P2P}"


def split_text(c: Candidate) -> str:
    """The stage split as ``--pipeline-layer-split`` writes it, ``even``, or ``-`` without a pipeline."""
    return "-" if c.pipeline_parallel == 1 else format_split(c.layer_split) if c.layer_split else "even"


ASYNC_SAVE_NOTE = ("save-host: GiB of host (CPU) memory per GPU that --async-save's copy of what the rank writes "
                   "holds while the write runs (the largest stage; pinned on CUDA); not device memory, not in GiB/GPU")


def format_table(result: SearchResult, top: int = 10) -> str:
    """The ranked table, with where the costs came from and the best configuration's flags."""
    req = result.request
    cl, m = req.cluster, req.model
    lines = [
        f"model: {m.kind}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"seq {m.seq_length}, vocab {m.vocab_size} ({parameter_counts(m)[0] / 1e9:.2f}B parameters), {req.precision}, "
        f"gradients accumulated in {'fp32' if req.accumulates_in_fp32 else req.precision}",
        f"cluster: {cl.name}: {req.num_gpus} x {cl.device}, {cl.devices_per_server} per server, "
        f"{cl.usable_memory_bytes / GiB:.1f} GiB usable per GPU{_plan_margin(req)}; "
        f"global batch {req.global_batch_size}",
        *moe_report.header_lines(req),
        f"costs: {result.costs_source}",
        f"searched {result.considered} configurations in {result.seconds * 1e3:.0f} ms: priced {result.priced} "
        f"({result.num_fit} fit, {result.too_big} do not fit in memory), {result.pruned} pruned",
        "",
        f"{'rank':>4} {'t':>3} {'c':>7} {'d':>3} {'w':>4} {'b':>3} {'m':>4} {'recomp':>8} {'schedule':>8} "
        f"{'dist-opt':>8} {'seq-par':>7}{moe_report.HEADER if m.moe else ''} "
        f"{'samples/s':>10} {'tokens/s':>10} {'MFU':>6} {'GiB/GPU':>7}  {'layers/stage':<14} GiB: stage 0/1/last",
    ]
    host, base = req.async_save, len(lines[-1])  # --async-save: a column of its host copy, after the device memory
    if host:
        lines[-1] += f"  {'save-host':>9}"
    width = len(lines[-1])  # rows are padded to the header, then the staleness column follows
    lines[-1] += "  staleness"
    for i, ev in enumerate(result.ranked[:top], 1):
        c = ev.candidate
        sched = c.schedule if c.pipeline_parallel > 1 else "none"
        lines.append(
            f"{i:>4} {c.tensor_parallel:>3} {context_text(c):>7} {c.pipeline_parallel:>3} {c.data_parallel:>4} "
            f"{c.micro_batch_size:>3} "
            f"{c.num_micro_batches:>4} {recompute_text(c):>8} {sched:>8} "
            f"{'yes' if c.distributed_optimizer else 'no':>8} {'yes' if c.sequence_parallel else 'no':>7}"
            f"{moe_report.cells(ev, m)} {ev.samples_per_sec:>10.1f} "
            f"{tokens_per_sec(ev, req):>10.0f} {100 * mfu(ev, req):>5.1f}% "
            f"{ev.memory_bytes_per_gpu / GiB:>7.2f}  {split_text(c):<14} {_stage_memory_text(ev)}"
        )
        if host:
            lines[-1] = f"{lines[-1]:<{base}}  {ev.host_save_bytes_per_gpu / GiB:>9.2f}"
        lines[-1] = f"{lines[-1]:<{width}}  {staleness(c, req.compensation, req.optimizer, req.precision).text}"
    if host:
        lines.append(ASYNC_SAVE_NOTE)
    if any(staleness(ev.candidate).stale_steps for ev in result.ranked[:top]):
        lines.append(STALENESS_NOTE)
    if result.pruned:
        lines.append(f"pruned: {result.pruned} of the {result.considered} configurations, each provably slower than "
                     "a plan shown (by a lower bound on its batch time) or than a cheaper recomputation of its layout")
    lines += ["", "best configuration:", "  " + " ".join(pretrain_command(result.best, req))]
    return "\n".join(lines)


def plan_json(result: SearchResult, top: int | None = None) -> dict[str, Any]:
    """The same as ``format_table`` as JSON: ``best`` and every feasible configuration in ``ranked``."""
    req = result.request
    ranked = result.ranked if top is None else result.ranked[:top]
    return {
        "model": {"kind": req.model.kind, "num_layers": req.model.num_layers, "hidden_size": req.model.hidden_size,
                  "num_attention_heads": req.model.num_attention_heads, "seq_length": req.model.seq_length,
                  "vocab_size": req.model.vocab_size, "num_parameters": req.model.num_parameters(),
                  **moe_report.model_fields(req.model)},
        "cluster": req.cluster.name, "num_gpus": req.num_gpus, "global_batch_size": req.global_batch_size,
        "precision": req.precision, "fp32_grads": req.accumulates_in_fp32, "costs_source": result.costs_source,
        "considered": result.considered, "feasible": result.num_fit, "search_seconds": round(result.seconds, 4),
        # considered, not priced: provably slower than a plan of the answer or a cheaper recomputation of the layout
        "pruned": result.pruned, "priced": result.priced,
        "memory_margin": req.memory_margin, "memory_limit_bytes": req.memory_limit_bytes,
        "best": {**describe(result.best, req), "command": pretrain_command(result.best, req)},
        "ranked": [describe(ev, req) for ev in ranked],
    }


# ---- the paper's comparisons --------------------------------------------------------------------

@dataclass(frozen=True)
class PaperSpeedup:
    """A speed-up of 2BW over a baseline that the PipeDream-2BW paper reports, and where it holds."""

    ratio: float
    condition: str = ""
    upper_bound: bool = False  # "up to"

    def __str__(self) -> str:
        text = f"{'up to ' if self.upper_bound else ''}{self.ratio:g}x"
        return f"{text} {self.condition}" if self.condition else text


# The PipeDream-2BW paper's (Narayanan et al., ICML 2021) speed-ups and largest model.
PAPER_SPEEDUPS: dict[str, tuple[PaperSpeedup, ...]] = {
    "PipeDream-Flush": (PaperSpeedup(1.6, "small B"), PaperSpeedup(1.15, "B=2048")),
    "GPipe": (PaperSpeedup(3.2, upper_bound=True),),
    "tensor MP": (PaperSpeedup(1.3, "1 server"), PaperSpeedup(20, "64 GPUs")),
    "no pipelining": (),
}
PAPER_MAX_MODEL_DEPTH, PAPER_MAX_MODEL_PARAMETERS = 64, 30e9  # about 30B parameters fit at d = 64 with 2BW


def paper_speedups_text(system: str) -> str:
    return ", ".join(map(str, PAPER_SPEEDUPS[system])) or "not stated"

Selector = Callable[[Candidate], bool]
BASELINES: dict[str, Selector] = {
    "PipeDream-Flush": lambda c: c.schedule == "flush" and c.pipeline_parallel > 1,
    "GPipe": lambda c: c.schedule == "gpipe",
    "tensor MP": lambda c: c.pipeline_parallel == 1 and c.tensor_parallel > 1,
    "no pipelining": lambda c: c.schedule == SEQUENTIAL and c.tensor_parallel == 1,
}


@dataclass(frozen=True)
class ComparisonRow:
    """One scenario of the paper: the best configuration each system gets from the same model."""

    model_name: str
    num_gpus: int
    global_batch_size: int
    best: dict[str, Evaluated | None]

    def ratio(self, system: str) -> float | None:
        """2BW's samples/s over ``system``'s (None when either does not fit)."""
        ours, theirs = self.best.get("2BW"), self.best.get(system)
        if ours is None or theirs is None or theirs.samples_per_sec <= 0:
            return None
        return ours.samples_per_sec / theirs.samples_per_sec


PAPER_SCENARIOS = (("gpt-2.2b", 8, 512), ("gpt-2.2b", 64, 512), ("gpt-2.2b", 64, 2048),
                   ("gpt-3.8b", 64, 512), ("gpt-3.8b", 64, 2048))


def compare_systems(model: ModelConfig, cluster: Cluster, num_gpus: int, global_batch_size: int,
                    name: str = "", costs: LayerCosts | None = None, balance_stages: bool = True,
                    fp32_grads: bool | None = None, distributed_optimizer_options: tuple[bool, ...] = (False,),
                    ) -> ComparisonRow:
    """Best 2BW, Flush, GPipe, tensor-parallel-only and non-pipelined configurations for one scenario
    (``balance_stages=False``: equal stages, as the paper's planner; the defaults of the gradient
    precision and the replicated optimizer are the paper's too)."""
    # the paper's systems only: the registry's later schedules would only slow the search down here
    paper = tuple(n for n in SCHEDULE_NAMES if n in ("2bw", "flush", "gpipe"))
    req = PlanRequest(model, cluster, num_gpus, global_batch_size,
                      schedules=(*paper, SEQUENTIAL), balance_stages=balance_stages, fp32_grads=fp32_grads,
                      distributed_optimizer_options=distributed_optimizer_options)
    costs = costs or default_costs(req)
    systems: dict[str, Selector] = {"2BW": lambda c: c.schedule == "2bw", **BASELINES}  # read the layout only
    best = dict(search(req, costs, require_fit=False, top=0, keep=systems).best_of)  # each system's best, pruned
    return ComparisonRow(name or f"{model.kind}-{model.num_parameters() / 1e9:.1f}b", num_gpus, global_batch_size, best)


def paper_comparison(cluster: Cluster | None = None,
                     scenarios: Iterable[tuple[str, int, int]] = PAPER_SCENARIOS) -> list[ComparisonRow]:
    """The paper's comparisons (its models, cluster, batch sizes), predicted by this planner."""
    cluster = cluster or load_cluster(PAPER_CLUSTER)
    return [compare_systems(paper_model(name), cluster, n, b, name) for name, n, b in scenarios]


def _short(ev: Evaluated | None) -> str:
    if ev is None:
        return "does not fit"
    c = ev.candidate
    rc = "rc" if c.recompute else ""
    zero = "+do" if c.distributed_optimizer else ""
    return (f"{ev.samples_per_sec:.1f} t{c.tensor_parallel}d{c.pipeline_parallel}w{c.data_parallel}"
            f"b{c.micro_batch_size}{rc}{zero}")


def _scenario(r: ComparisonRow) -> str:
    return f"{r.model_name} N={r.num_gpus} B={r.global_batch_size}"


def format_paper_comparison(rows: list[ComparisonRow]) -> str:
    """Predicted samples/s of each system's best configuration, 2BW's speed-ups, and the paper's."""
    systems = ["2BW", *BASELINES]
    lines = ["Predicted samples/s, best configuration of each system (t d w b, rc = recomputation):", ""]
    head = f"{'scenario':<22}" + "".join(f"{s:>22}" for s in systems)
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{_scenario(r):<22}" + "".join(f"{_short(r.best[s]):>22}" for s in systems))
    splits = [(r, ev.candidate) for r in rows if (ev := r.best["2BW"]) is not None and ev.candidate.layer_split]
    if splits:
        lines += ["", "2BW's stage splits (layers per stage; the planner moves layers off the head's stage):"]
        lines += [f"  {_scenario(r)}: {format_split(c.layer_split)}" for r, c in splits]
    lines += ["", "2BW speed-up over each baseline, predicted, and as the paper reports it:", ""]
    head = f"{'scenario':<22}" + "".join(f"{'vs ' + s:>28}" for s in BASELINES)
    lines += [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{(f'{x:.2f}x' if (x := r.ratio(s)) is not None else 'n/a'):>28}" for s in BASELINES)
        lines.append(f"{_scenario(r):<22}" + cells)
    lines.append(f"{'paper':<22}" + "".join(f"{paper_speedups_text(s):>28}" for s in BASELINES))
    return "\n".join(lines)


# ---- the largest model that fits ----------------------------------------------------------------

@dataclass(frozen=True)
class MaxModelRow:
    """The most layers (a multiple of d) of a given shape that fit with d stages, and its size."""

    pipeline_parallel: int
    schedule: str
    num_layers: int
    num_parameters: int
    memory_bytes_per_gpu: int
    distributed_optimizer: bool = False


def _fits(template: ModelConfig, layers: int, cluster: Cluster, d: int, w: int, schedule: str,
          precision: str, zero: bool = False, fp32_grads: bool | None = None, margin: float = 0.0) -> Evaluated | None:
    """``template`` with ``layers`` layers on ``d`` stages at its most frugal setting, if it fits."""
    model = replace(template, num_layers=layers)
    req = PlanRequest(model, cluster, d * w, d * w, precision, max_micro_batch_size=1, fp32_grads=fp32_grads,
                      memory_margin=margin)
    costs = LayerCosts("max-model", {(1, 1): analytic_microbatch_costs(model, cluster, precision, 1, 1)})
    ev = evaluate(Candidate(1, d, w, 1, d, True, schedule, distributed_optimizer=zero), costs, req)
    return ev if ev.prediction is not None else None


def max_model_size(template: ModelConfig, cluster: Cluster, num_gpus: int, depths: Iterable[int],
                   schedule: str = "2bw", precision: str = "fp16", max_layers_per_stage: int = 4096,
                   distributed_optimizer: bool = False, fp32_grads: bool | None = None,
                   memory_margin: float = 0.0) -> list[MaxModelRow]:
    """For each depth ``d``: the largest ``template``-shaped model (more layers) that fits.

    The most memory-frugal setting is used: microbatch 1, recomputation, ``t = 1``, ``w = N/d``,
    and ``m = d`` microbatches per batch (the fewest 2BW allows; Flush then keeps up to ``d`` in flight);
    ``distributed_optimizer`` shards the master and optimizer state over the ``w`` replicas.
    """
    rows = []

    def fits(layers: int) -> Evaluated | None:
        return _fits(template, layers, cluster, d, w, schedule, precision, distributed_optimizer, fp32_grads,
                     memory_margin)

    for d in depths:
        if num_gpus % d:
            raise ConfigError(f"pipeline depth {d} does not divide --num-gpus {num_gpus}")
        w = num_gpus // d
        lo, hi = 0, 1
        while hi <= max_layers_per_stage and fits(hi * d):
            lo, hi = hi, hi * 2
        hi = min(hi, max_layers_per_stage + 1)
        while hi - lo > 1:  # largest k in [lo, hi) that fits
            mid = (lo + hi) // 2
            if fits(mid * d):
                lo = mid
            else:
                hi = mid
        if lo == 0:
            rows.append(MaxModelRow(d, schedule, 0, 0, 0, distributed_optimizer))
            continue
        model = replace(template, num_layers=lo * d)
        ev = fits(lo * d)
        rows.append(MaxModelRow(d, schedule, lo * d, model.num_parameters(), ev.memory_bytes_per_gpu,
                                distributed_optimizer))
    return rows


def format_max_model(rows: list[MaxModelRow], template: ModelConfig, cluster: Cluster, num_gpus: int) -> str:
    """One line per depth, one column per schedule (and optimizer): the largest model's layers and parameters."""
    schedules = list(dict.fromkeys((r.schedule, r.distributed_optimizer) for r in rows))
    by = {(r.pipeline_parallel, (r.schedule, r.distributed_optimizer)): r for r in rows}
    lines = [f"Largest GPT of hidden {template.hidden_size}, {template.num_attention_heads} heads, seq "
             f"{template.seq_length} (more layers) on {num_gpus} x {cluster.device} "
             f"({cluster.usable_memory_bytes / GiB:.1f} GiB usable): t = 1, w = N/d, microbatch 1, "
             "recomputation, m = d; layers, parameters per schedule (+do: distributed optimizer)", "",
             f"{'d':>4}" + "".join(f"{s + ('+do' if z else ''):>14}" for s, z in schedules)]
    for d in dict.fromkeys(r.pipeline_parallel for r in rows):
        cells = []
        for sched in schedules:
            r = by.get((d, sched))
            cells.append(f"{(f'{r.num_layers}, {r.num_parameters / 1e9:.1f}B' if r and r.num_layers else 'none'):>14}")
        lines.append(f"{d:>4}" + "".join(cells))
    lines += ["", f"paper: about {PAPER_MAX_MODEL_PARAMETERS / 1e9:.0f}B parameters fit at d = "
                  f"{PAPER_MAX_MODEL_DEPTH} with 2BW"]
    return "\n".join(lines)
