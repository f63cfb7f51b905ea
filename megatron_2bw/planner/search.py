"""The planner's search (the paper's Algorithm 1, widened): every layout, ranked by throughput.

Enumerated: every ``(t, d, w)`` with ``t*d*w = N``, where ``t`` divides the server size, the
attention heads and the FFN size (tensor groups never leave a server), and ``d`` is at most the
number of layers (``balance_stages``, the default: each candidate gets the split of
``planner/split.py``, fastest under the memory limit) or divides it (equal stages, as the paper's
planner); ``d = 1`` is data/tensor parallelism without pipelining. For each: every
power-of-two microbatch ``b`` up to a limit, recomputation on and off (plus, when asked,
``recompute_policies`` inside stages: ``FINER_RECOMPUTE``), each schedule of the registry
(``schedule/schedules.py``, priced through its ``ScheduleSpec``: ``bubble_time``, ``chunks``,
``inflight``, ``deferred_weight_grads``, never by name; see ``cost_model``), and with ``w > 1`` the
optimizer replicated or distributed (ZeRO-1: less memory, a shorter optimizer step). Gradients
accumulate in the precision's default (``memory_model.fp32_grads_for``: fp32 for bf16, fp16 for
fp16) unless ``fp32_grads`` says otherwise. The number of microbatches per batch is fixed by the
global batch, ``m = B / (b*w)``: a ``b`` that does not divide it is skipped, and so is a schedule that
needs more microbatches (``ScheduleSpec.min_microbatches``). Where ``t > 1``,
``sequence_parallel_options`` may add sequence parallelism on and off
(``Candidate.sequence_parallel``; the analytic costs then hold both settings,
``LayerCosts.sp_table``). A model with experts adds the expert-parallel size ``e`` (every one dividing the
experts and the layout's ``w * c`` replicas; ``moe_costs.py``). A layout whose fullest GPU exceeds the device's
usable memory is discarded;
the rest are ranked by predicted samples per second. The whole search is closed-form arithmetic over a
few thousand candidates.

Recomputation is tried cheapest first within each layout: none, the ``recompute_policies`` by the
forward they re-run, whole stages. Two kinds of candidate are not evaluated: selective
recomputation where it frees under ``SELECTIVE_MIN_SAVING`` of a layer's stash (a fused attention
kernel keeps no ``s^2`` tensors; not generated), and a candidate that cannot be faster than a
cheaper recomputation of the same layout that fits (counted in ``SearchResult.pruned``): without a
pipeline every costlier one (the same layers and communication with more compute), with one those
whose ``batch_time_lower_bound`` exceeds the layout's fastest batch time so far. Asked for its ``top`` plans
(``tools/plan.py``), the search also skips what provably cannot enter them (``pruning.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping

from ..config import ModelConfig
from ..errors import ConfigError
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.schedules import PLANNED_SCHEDULES, SCHEDULES, ScheduleSpec, parse_schedule_id, spec_of
from ..schedule.stages import StageSlice
from .candidates import (  # noqa: F401 - re-exported
    SELECTIVE_MIN_SAVING,
    candidates,
    context_choices,
    distributed_optimizer_choices,
    micro_batch_sizes,
    pipeline_depths,
    runs,
    sequence_parallel_choices,
    tensor_sizes,
)
from .context_costs import PLANNED_CP_COMM_TYPES, anchored_table, context_sizes, context_table
from .cost_model import Prediction, predict
from .hardware import Cluster, GiB
from .layer_costs import ACTIVATION_BYTES, LayerCosts, MicrobatchCosts, analytic_layer_costs
from .memory_model import (
    SEQUENTIAL,
    Candidate,
    ParamBytes,
    StageMemory,
    fp32_grads_for,
    plan_memory,
    representative_stages,
    slice_memory,
)
from .moe_costs import expert_load, for_experts
from .pruning import Selector, StageLines, Thresholds, above
from .split import balanced_split, stage_lines

# The memory margin tools/plan.py and --auto-plan keep by default: a plan at 99% of the memory runs out of it.
DEFAULT_MEMORY_MARGIN = 0.10


def _margin_text(request: "PlanRequest") -> str:
    m = request.memory_margin
    return f" less a {m:.0%} margin ({request.memory_limit_bytes / GiB:.1f} GiB)" if m else ""


# Megatron's finer recomputation as the search tries it: the attention core, or every layer's input.
FINER_RECOMPUTE = (RecomputePolicy("selective"), RecomputePolicy("full", "uniform", 1))


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for; validated here so the CLI can print one line and exit."""

    model: ModelConfig
    cluster: Cluster
    num_gpus: int
    global_batch_size: int
    precision: str = "fp16"
    max_micro_batch_size: int = 64
    # schedule ids (``zb-h2+pv``: with post-validation); SEQUENTIAL may be added: the paper's no-pipelining baseline
    schedules: tuple[str, ...] = PLANNED_SCHEDULES
    recompute_options: tuple[bool, ...] = (False, True)
    # policies inside stages searched besides ``recompute_options`` (FINER_RECOMPUTE: the usual ones)
    recompute_policies: tuple[RecomputePolicy, ...] = ()
    no_pipelining: bool = True
    balance_stages: bool = True  # choose each candidate's stage split (planner/split.py); False: even stages
    # gradients accumulated in fp32 (--accumulate-allreduce-grads-in-fp32); None: the precision's default
    fp32_grads: bool | None = None
    # the distributed optimizer off/on, tried where w > 1; (False,): the paper's replicated optimizer
    distributed_optimizer_options: tuple[bool, ...] = (False, True)
    # --2bw-compensation (auto: the trainer's default, config.resolve_compensation): its state is counted
    # for 2BW candidates, its measured loss ratio shown in the staleness column
    compensation: str = "auto"
    optimizer: str = "adam"  # --optimizer: muon keeps 4 bytes less state per matrix element
    # share of the usable memory a plan leaves free (tools/plan.py --memory-margin, DEFAULT_MEMORY_MARGIN):
    # the allocator's fragmentation and what the model leaves out; 0 reproduces the paper's planner
    memory_margin: float = 0.0
    # --sequence-parallel off/on, tried where t > 1 (GPT only); None: the model's own setting
    sequence_parallel_options: tuple[bool, ...] | None = None
    # --async-save (torch_dist): every candidate counts the host copy of what a rank writes
    # (StageMemory.host_save: host memory, not the device's; tools/plan.py's save-host column)
    async_save: bool = False
    # --context-parallel-size values searched; None: 1 and every power of two whose 2c chunks divide the
    # sequence (context_costs.context_sizes); (1,): none. The --cp-comm-type values tried at c > 1.
    context_parallel_options: tuple[int, ...] | None = None
    cp_comm_types: tuple[str, ...] = PLANNED_CP_COMM_TYPES
    # a model with experts: the --expert-model-parallel-size values searched (None: every one dividing the experts
    # and a layout's replicas), --moe-router-force-load-balancing (tokens spread evenly, as published MoE
    # throughputs are taken), else the busiest expert's tokens over the mean (None: moe_costs.DEFAULT_EXPERT_LOAD)
    expert_parallel_options: tuple[int, ...] | None = None
    moe_force_balanced: bool = False
    moe_expert_load: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.memory_margin < 1.0:
            raise ConfigError(f"--memory-margin must be in [0, 1) (a fraction, or a percentage like 10%), "
                              f"got {self.memory_margin}")
        if self.num_gpus < 1:
            raise ConfigError(f"--num-gpus must be positive, got {self.num_gpus}")
        if self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be positive, got {self.global_batch_size}")
        if self.max_micro_batch_size < 1:
            raise ConfigError(f"--max-micro-batch-size must be positive, got {self.max_micro_batch_size}")
        if self.precision not in ACTIVATION_BYTES:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of {', '.join(ACTIVATION_BYTES)}")
        self.cluster.peak(self.precision)
        self._check_experts()
        allowed = (*SCHEDULES, SEQUENTIAL)  # the registry as it is now (tests register schedules)
        bad = [s for s in self.schedules if parse_schedule_id(s)[0] not in allowed]
        if bad or not self.schedules:
            raise ConfigError(f"schedules must be among {', '.join(allowed)}, "
                              f"got {', '.join(self.schedules) or 'none'}")

    def _check_experts(self) -> None:
        moe, load = self.model.moe, self.moe_expert_load
        if load is not None and not load >= 1.0:
            raise ConfigError(f"--moe-expert-load is the busiest expert's tokens over the mean: >= 1, got {load}")
        for e in self.expert_parallel_options or ():
            if e < 1 or (moe is None and e != 1) or (moe is not None and moe.num_experts % e):
                raise ConfigError(f"--expert-model-parallel-size {e} does not divide --num-experts "
                                  f"{moe.num_experts if moe else 'absent (a dense model)'}")
            if self.num_gpus % e:
                raise ConfigError(f"--expert-model-parallel-size {e} does not divide --num-gpus {self.num_gpus} "
                                  "(the experts are spread inside the data x context ranks)")

    @property
    def expert_load(self) -> float:
        """The busiest expert's tokens over the mean the plan assumes (``moe_costs.expert_load``)."""
        return expert_load(self.moe_force_balanced, self.moe_expert_load)

    @property
    def context_choices(self) -> tuple[int, ...]:
        """The context-parallel sizes searched (see ``context_parallel_options``)."""
        opts = self.context_parallel_options
        return (1, *context_sizes(self.model, self.num_gpus)) if opts is None else tuple(dict.fromkeys(opts)) or (1,)

    @property
    def sequence_parallel_choices(self) -> tuple[bool, ...]:
        """The sequence-parallel settings searched (where t > 1)."""
        opts = self.sequence_parallel_options
        return (self.model.sequence_parallel,) if opts is None else tuple(dict.fromkeys(opts)) or (False,)

    @property
    def searches_sequence_parallel(self) -> bool:
        """Whether both settings are tried: the analytic costs then hold both (``LayerCosts.sp_table``)."""
        return (len(self.sequence_parallel_choices) > 1
                or self.sequence_parallel_choices != (self.model.sequence_parallel,))

    @property
    def param_bytes(self) -> ParamBytes:
        return ParamBytes.for_precision(self.precision, self.fp32_grads, self.compensation, self.optimizer)

    @property
    def accumulates_in_fp32(self) -> bool:
        return fp32_grads_for(self.precision, self.fp32_grads)

    @property
    def memory_limit_bytes(self) -> int:
        """What a plan may fill per GPU: the usable memory less the margin."""
        return int(self.cluster.usable_memory_bytes * (1.0 - self.memory_margin))


@dataclass(frozen=True)
class Evaluated:
    """A candidate with its memory (the stages that can peak) and, if it fits, its prediction."""

    candidate: Candidate
    memory: tuple[StageMemory, ...]
    prediction: Prediction | None
    over_limit: bool = False  # fits, but priced only far enough to show it is slower than a threshold

    @property
    def memory_bytes_per_gpu(self) -> int:
        return max(s.total for s in self.memory)

    @property
    def samples_per_sec(self) -> float:
        return self.prediction.samples_per_sec if self.prediction else 0.0

    @property
    def host_save_bytes_per_gpu(self) -> int:
        """Host bytes of ``--async-save``'s copy for the GPU that writes the most (0 without the flag)."""
        return max(s.host_save for s in self.memory)


@dataclass(frozen=True)
class SearchResult:
    """Feasible candidates, best first, and how many were looked at.

    ``ranked``: every candidate that fits (the exhaustive search) or, when the search was asked for its
    ``top`` plans, exactly the first ``top`` of that ranking. ``best_of``: the best plan of each ``keep``
    selector (None: none fits). ``considered`` = priced (``fit`` + ``too_big``) + ``pruned``."""

    request: PlanRequest
    costs_source: str
    ranked: tuple[Evaluated, ...]
    considered: int
    too_big: int
    smallest_infeasible: Evaluated | None = field(default=None, compare=False)
    seconds: float = 0.0
    pruned: int = 0  # considered but not priced: provably slower than a plan the answer already holds
    fit: int = -1  # priced candidates that fit (-1: len(ranked))
    best_of: Mapping[str, Evaluated | None] = field(default_factory=dict, compare=False)

    @property
    def best(self) -> Evaluated:
        return self.ranked[0]

    @property
    def priced(self) -> int:
        """Candidates whose memory (and, where they fit, time) was computed."""
        return self.considered - self.pruned

    @property
    def num_fit(self) -> int:
        return len(self.ranked) if self.fit < 0 else self.fit


def default_costs(request: PlanRequest) -> LayerCosts:
    """The analytic estimate on the grid the search needs, with a context-parallel rank's costs
    (``LayerCosts.cp_table``) where the request searches ``c > 1``."""
    costs = analytic_layer_costs(request.model, request.cluster, request.precision,
                                 tensor_sizes(request.model, request.cluster, request.num_gpus),
                                 micro_batch_sizes(request.max_micro_batch_size),
                                 search_sequence_parallel=request.searches_sequence_parallel)
    keys = context_keys(request, costs)
    return replace(costs, cp_table=context_table(request.model, request.cluster, request.precision, keys,
                                                 request.cp_comm_types)) if keys else costs


def context_keys(request: PlanRequest, costs: LayerCosts) -> list[tuple[int, int, bool, int]]:
    """The ``(t, b, sequence_parallel, c)`` at ``c > 1`` the search can try on ``costs``' grid."""
    sizes = [c for c in request.context_choices if c > 1]
    return [(t, b, sp, c) for (t, b) in costs.table for sp in sequence_parallel_choices(request, costs, t, b)
            for c in sizes if request.num_gpus % (t * c) == 0]


def with_context_costs(request: PlanRequest, costs: LayerCosts) -> LayerCosts:
    """Measured ``costs`` (a profile: c = 1 only) with a context rank's costs where the request searches c > 1:
    each measured entry scaled by the analytic estimate's context-over-plain ratio (``anchored_table``)."""
    keys = context_keys(request, costs)
    if costs.cp_table or not keys:
        return costs
    table = anchored_table(costs, request.model, request.cluster, request.precision, keys, request.cp_comm_types)
    return replace(costs, cp_table=table, source=f"{costs.source}; context-parallel ranks: scaled by the analytic "
                   "estimate's ratio")


def batch_time_lower_bound(cand: Candidate, costs: LayerCosts, request: PlanRequest,
                           lines: StageLines | None = None) -> float:
    """Seconds per batch ``cand`` needs under any stage split (0 where no bound is known).

    A stage's time per microbatch is ``base_r + n_r * slope_r`` (``split.stage_lines``; ``lines``: a
    search's cache of them), so the stages add up to the same total under every split, and the slowest
    is at least the mean. The pipeline runs ``m`` microbatch slots at the slowest stage's pace (2BW), plus
    the fill and drain (``bubble_slots``) for the flushing schedules whose ``bubble_time`` is the default
    ``bubble_slots * (f + b + w)``; a schedule with its own ``bubble_time`` (zero-bubble, interleaved) gets
    no bubble in the bound, as its formula need not grow with the slowest stage's time. Reductions and
    the optimizer only add to that.
    Recomputation whose cost is not linear in a stage's layers (``block``, ``uniform`` chunks of
    several layers) and the sequential baseline get no bound.
    """
    p = cand.recompute_policy
    if cand.schedule == SEQUENTIAL or (p is not None and p.granularity == "full"
                                       and (p.method != "uniform" or p.num_layers != 1)):
        return 0.0
    d, m = cand.pipeline_parallel, cand.num_micro_batches
    base, slope = lines(cand) if lines else stage_lines(candidate_costs(costs, cand, request), cand, request.cluster,
                                                        request.param_bytes)
    mean = (sum(base) + request.model.num_layers * min(slope)) / d
    spec = spec_of(cand.schedule)
    default_bubble = type(spec).bubble_time is ScheduleSpec.bubble_time
    return (m if spec.grad_buffers > 1 or not default_bubble else m + spec.bubble_slots(d)) * mean


def _group(c: Candidate) -> tuple:
    """Candidates that differ only in their recomputation."""
    return (c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.micro_batch_size, c.schedule,
            c.distributed_optimizer, c.sequence_parallel, c.context, c.expert_parallel)


def candidate_costs(costs: LayerCosts, cand: Candidate, request: PlanRequest | None = None) -> MicrobatchCosts | None:
    """The costs of ``cand``'s (t, b) with its sequence-parallel setting and context parallelism, at its
    expert-parallel size (``moe_costs.for_experts``; ``request``: the expert load it assumes)."""
    c = costs.at(cand.tensor_parallel, cand.micro_batch_size, cand.sequence_parallel, cand.context)
    if c is None or c.moe is None:
        return c
    load = request.expert_load if request is not None else expert_load(False)
    cluster = request.cluster if request is not None else None
    return for_experts(c, cand.tensor_parallel, cand.expert_parallel, cluster, load) if cluster else c


def evaluate(cand: Candidate, costs: LayerCosts, request: PlanRequest, max_batch_s: float = math.inf,
             lines: StageLines | None = None, probe: bool = False) -> Evaluated:
    """Memory first; the time only for what fits (``prediction`` None), and, below ``max_batch_s``, only
    for what could take less (``Evaluated.over_limit``: it fits, its batch is longer; ``pruning.py``).
    ``probe``: a candidate a few stages prove too big is not split (``_stage_over``)."""
    c = lines.costs_of(cand) if lines else candidate_costs(costs, cand, request)
    if c is None:
        raise ConfigError(f"no costs for t={cand.tensor_parallel}, b={cand.micro_batch_size}"
                          + (" with --sequence-parallel" if cand.sequence_parallel else "")
                          + (f" at context-parallel size {cand.context_parallel}" if cand.context else ""))
    chunked = cand.schedule != SEQUENTIAL and spec_of(cand.schedule).chunks > 1
    if probe and (over := _stage_over(c, cand, request, chunked)) is not None:
        return Evaluated(cand, (over,), None)
    if request.balance_stages and cand.pipeline_parallel > 1 and cand.layer_split is None and not chunked:
        split = balanced_split(c, cand, request.model.num_layers, request.cluster, request.param_bytes,
                               request.cluster.usable_memory_bytes, lines(cand) if lines else None)
        cand = replace(cand, layer_split=split)
    memory = plan_memory(c, cand, request.model.num_layers, request.param_bytes)
    if max(s.total for s in memory) > request.memory_limit_bytes:
        return Evaluated(cand, memory, None)
    pred = predict(c, cand, request.model.num_layers, request.cluster, request.param_bytes, max_batch_s)
    return Evaluated(cand, memory, pred, over_limit=pred is None)


def _stage_over(c: MicrobatchCosts, cand: Candidate, request: PlanRequest, chunked: bool) -> StageMemory | None:
    """A stage's memory that proves every split over the limit, else None. A stage's bytes grow with its
    layers, so: an edge stage with no layers or stage 1 with one (the fewest any split gives them) over the
    limit; or every stage over it with ``ceil(L/d)`` layers (some stage holds that many under any split).
    A search for its ``top`` plans takes it for the whole candidate's memory (only the message of a search
    where nothing fits reads it, and that search runs again in full)."""
    d, L, limit = cand.pipeline_parallel, request.model.num_layers, request.memory_limit_bytes
    if d < 2 or chunked or cand.layer_split is not None or cand.schedule == SEQUENTIAL:
        return None

    def memory(r: int, n: int) -> StageMemory:
        return slice_memory(c, cand, StageSlice(0, n, r == 0, r == d - 1), r, request.param_bytes)

    if not request.balance_stages:
        return next((m for r in representative_stages(d) if (m := memory(r, L // d)).total > limit), None)
    # the weights, gradients and optimizer state of ceil(L/d) layers alone (an edge stage holds more of them)
    bare = slice_memory(c, cand, StageSlice(0, -(-L // d), False, False), min(1, d - 1), request.param_bytes)
    if bare.weights + bare.second_weights + bare.grads + bare.optimizer > limit:
        return bare
    for r, n in ((0, 0), (d - 1, 0), (1, 1)) if d > 2 else ((0, 0), (1, 0)):
        if (probe := memory(r, n)).total > limit:
            return probe
    smallest = None
    for r in reversed(range(d)):  # the later stages hold fewer microbatches: the first to fit is likely there
        probe = memory(r, -(-L // d))
        if probe.total <= limit:
            return None
        smallest = probe if smallest is None or probe.total < smallest.total else smallest
    return smallest


def _rank_key(e: Evaluated) -> tuple:
    c = e.candidate
    policy = c.recompute_policy.label if c.recompute_policy else ""
    return (-round(e.samples_per_sec, 9), e.memory_bytes_per_gpu, c.pipeline_parallel, c.recompute, policy,
            c.distributed_optimizer, c.sequence_parallel, c.context_parallel, c.cp_comm_type, c.expert_parallel)


def _layouts(cands: Iterator[Candidate]) -> list[list[Candidate]]:
    """Runs of candidates that differ only in their recomputation (cheapest first, as generated)."""
    out: list[list[Candidate]] = []
    for c in cands:
        if out and _group(out[-1][0]) == _group(c):
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _bounds(group: list[Candidate], costs: LayerCosts, request: PlanRequest, lines: StageLines) -> list[float]:
    """Each candidate's lower bound; without a pipeline a costlier recomputation is never faster than a
    cheaper one (same layers and communication, more compute), so there the bounds only grow."""
    out = [batch_time_lower_bound(c, costs, request, lines) for c in group]
    if group[0].pipeline_parallel == 1:
        out = [max(out[:i + 1]) for i in range(len(out))]
    return out


def search(request: PlanRequest, costs: LayerCosts | None = None, *, require_fit: bool = True,
           top: int | None = None, keep: Mapping[str, Selector] | None = None) -> SearchResult:
    """Rank every feasible candidate; ``ConfigError`` if none fits (unless ``require_fit`` is off).

    ``top``: only the first ``top`` plans of that ranking are needed (and, with ``keep``, each selector's
    best; selectors read the layout, not the recomputation): candidates that provably cannot enter them
    are skipped (``pruning.py``), layouts visited by their lower bound; the answer is the exhaustive one's.
    Within a layout a recomputation whose bound exceeds a cheaper one's batch time that fits is skipped in
    either mode (without a pipeline: every costlier one once one fits)."""
    start = time.perf_counter()
    if costs is not None and request.model.moe is not None and not any(c.moe for c in costs.table.values()):
        raise ConfigError("a model with experts is planned from the analytic estimate only (a measured profile "
                          "holds no expert terms yet): plan it with tools/plan.py, without --profile")
    costs = costs or default_costs(request)
    keep = dict(keep or {})
    limits = None if top is None else Thresholds(top, keep)
    lines = StageLines(costs, request.cluster, request.param_bytes, request.expert_load)
    layouts = [(g, _bounds(g, costs, request, lines)) for g in _layouts(candidates(request, costs))]
    if limits:
        layouts.sort(key=lambda gb: min(gb[1]))
    feasible: list[Evaluated] = []
    considered = too_big = pruned = 0
    smallest: Evaluated | None = None
    for group, bounds in layouts:
        considered += len(group)
        if limits and above(min(bounds), limits.limit(group[0])):  # selectors read the layout only
            pruned += len(group)
            continue
        fastest: float | None = None  # the layout's shortest batch time that fits so far
        for cand, bound in zip(group, bounds):
            limit = limits.limit(cand) if limits else math.inf
            if fastest is not None and (cand.pipeline_parallel == 1 or above(bound, fastest)) or above(bound, limit):
                pruned += 1
                continue
            ev = evaluate(cand, costs, request, limit, lines, probe=limits is not None)
            if ev.over_limit:
                pruned += 1
                fastest = math.inf if fastest is None else fastest  # it fits: a one-stage layout is done
            elif ev.prediction is None:
                too_big += 1
                if smallest is None or ev.memory_bytes_per_gpu < smallest.memory_bytes_per_gpu:
                    smallest = ev
            else:
                feasible.append(ev)
                fastest = min(ev.prediction.batch_s, math.inf if fastest is None else fastest)
                if limits:
                    limits.add(ev.candidate, ev.prediction.batch_s)
    if limits and not feasible and (top or keep):  # nothing fits: the message names the smallest of them all
        full = search(request, costs, require_fit=require_fit, keep=keep)
        return replace(full, ranked=full.ranked[:top], seconds=time.perf_counter() - start)
    feasible.sort(key=_rank_key)
    best_of = {name: next((e for e in feasible if pick(e.candidate)), None) for name, pick in keep.items()}
    ranked = tuple(feasible if top is None else feasible[:top])
    result = SearchResult(request, costs.source, ranked, considered, too_big, smallest,
                          time.perf_counter() - start, pruned, len(feasible), best_of)
    if require_fit and not feasible:
        _nothing_fits(request, considered, smallest)
    return result


def _nothing_fits(request: PlanRequest, considered: int, smallest: Evaluated | None) -> None:
    m = request.model
    what = (f"{m.kind} with {m.num_layers} layers, hidden {m.hidden_size} on {request.num_gpus} GPUs "
            f"of {request.cluster.usable_memory_bytes / GiB:.1f} GiB usable{_margin_text(request)}, global batch "
            f"{request.global_batch_size}")
    if considered == 0:
        raise ConfigError(f"no layout of {what}: no (t, d, w, b) divides the GPUs, layers and global batch")
    raise ConfigError(f"nothing fits: {what}; the smallest of {considered} candidates needs "
                      f"{smallest.memory_bytes_per_gpu / GiB:.1f} GiB per GPU")
