"""The cost model against published throughputs: each published layout, predicted vs measured.

``published.json`` (next to this module) holds end-to-end results with their source: the model
shape, the layout ``(t, p, GPUs, global batch[, microbatch])`` and the TFLOP/s per GPU the source
reports. Each run is priced by the planner's own cost model on exactly that layout (even stages, the
schedule and recomputation the source used; where the source does not state the microbatch, the
planner's fastest power of two that divides the batch), and the published TFLOP/s is converted to
samples/s with the source's own FLOP count (Megatron's Eq. 3, which counts the recomputed forward).
``docs/planner.md`` section 7 prints the table; ``tests/test_planner_calibration.py`` holds every
run within ``TOLERANCE``.

``published.json``'s ``schedule_ratios`` hold runs that measured several schedules on one layout (the
Zero Bubble paper's ZB-1p and ZB-2p beside 1F1B): the planner predicts each schedule's throughput over
Flush's on that layout, compared with the published ratio (section 7.1, ``tools/plan.py
--schedule-calibration``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from ..config import ModelConfig
from ..errors import ConfigError
from ..schedule.recompute_policy import RecomputePolicy
from .cost_model import predict
from .hardware import GiB, load_cluster
from .layer_costs import analytic_layer_costs
from .memory_model import Candidate, ParamBytes, plan_memory
from .search import Evaluated, PlanRequest, evaluate, micro_batch_sizes

PUBLISHED = Path(__file__).resolve().parent / "published.json"
TOLERANCE = 0.15  # issue 22: predictions within 15% of the published throughput


def megatron_flops_per_sample(model: ModelConfig) -> float:
    """Narayanan et al. 2021, Eq. 3 per sequence: ``96 s l h^2 (1 + s/(6h) + V/(16 l h))``; counts the
    forward, the backward (2x) and the recomputed forward of every layer, and the logit GEMMs."""
    s, l, h, V = model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    return 96 * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def model_flops_per_sample(model: ModelConfig) -> float:
    """FLOPs of one sequence without recomputation (for MFU): 3/4 of Eq. 3."""
    return 0.75 * megatron_flops_per_sample(model)


def parse_recompute(text: str) -> tuple[bool, RecomputePolicy | None]:
    """``"stage"`` (the engine's whole-stage recomputation), ``"none"``, ``"selective"`` or
    ``"full uniform|block N"`` (Megatron's flags)."""
    parts = text.split()
    if text == "stage":
        return True, None
    if text == "none":
        return False, None
    if parts == ["selective"]:
        return False, RecomputePolicy("selective")
    if len(parts) == 3 and parts[0] == "full":
        return False, RecomputePolicy("full", parts[1], int(parts[2]))
    raise ConfigError(f"published.json: unknown recompute {text!r}")


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement and the layout it ran."""

    name: str
    source: str
    model: ModelConfig
    cluster: str
    precision: str
    tensor_parallel: int
    pipeline_parallel: int
    num_gpus: int
    global_batch_size: int
    micro_batch_size: int | None
    schedule: str
    recompute: str
    distributed_optimizer: bool
    tflops_per_gpu: float
    flash_attention: bool = False  # the source's attention kernel (2021 Megatron: unfused, s^2 kept)
    sequence_parallel: bool = False  # Korthikanti et al. 2022 (``model.sequence_parallel`` says the same)

    @property
    def data_parallel(self) -> int:
        return self.num_gpus // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def samples_per_sec(self) -> float:
        """The published TFLOP/s as samples/s, by the source's FLOP count."""
        return self.tflops_per_gpu * 1e12 * self.num_gpus / megatron_flops_per_sample(self.model)


def load_published(path: str | Path = PUBLISHED, section: str = "runs") -> tuple[dict[str, str], list[PublishedRun]]:
    """``(sources, runs)`` of a published-results file (the schema of ``published.json``); ``section``: which
    list of runs (``tensor_parallel_runs``: Korthikanti et al. 2022, ``calibration_tp.py``)."""
    data = json.loads(Path(path).read_text())
    d = data["defaults"]
    runs = []
    for r in data[section]:
        get = lambda k, r=r: r.get(k, d.get(k))  # noqa: E731 - per-run value, else the file's default
        sp = bool(get("sequence_parallel"))
        model = ModelConfig("gpt", r["num_layers"], r["hidden_size"], r["num_attention_heads"], get("seq_length"),
                            vocab_size=get("vocab_size"), hidden_dropout=get("hidden_dropout"),
                            attention_dropout=get("attention_dropout"), sequence_parallel=sp)
        run = PublishedRun(r["name"], r["source"], model, get("cluster"), get("precision"), r["tensor_parallel"],
                           r["pipeline_parallel"], r["num_gpus"], r["global_batch_size"], r.get("micro_batch_size"),
                           get("schedule"), get("recompute"), bool(get("distributed_optimizer")),
                           _tflops(r, model), bool(get("flash_attention")), sp)
        if run.num_gpus % (run.tensor_parallel * run.pipeline_parallel):
            raise ConfigError(f"published.json: {run.name}: t*p does not divide the GPUs")
        runs.append(run)
    return data["sources"], runs


def _tflops(r: dict[str, Any], model: ModelConfig) -> float:
    """The run's TFLOP/s per GPU by Eq. 3: as published, or from a published iteration time (Korthikanti et al.
    2022 state seconds per iteration)."""
    if "tflops_per_gpu" in r:
        return float(r["tflops_per_gpu"])
    return megatron_flops_per_sample(model) * r["global_batch_size"] / r["iteration_seconds"] / r["num_gpus"] / 1e12


@dataclass(frozen=True)
class CalibrationRow:
    """A published run beside the planner's prediction of its layout."""

    run: PublishedRun
    evaluated: Evaluated
    samples_per_sec: float  # predicted (also when the planner's memory model says it does not fit)

    @property
    def ratio(self) -> float:
        return self.samples_per_sec / self.run.samples_per_sec

    @property
    def fits(self) -> bool:
        return self.evaluated.prediction is not None

    @property
    def predicted_tflops_per_gpu(self) -> float:
        """The prediction in the source's unit (its FLOP count, recomputation included)."""
        return self.samples_per_sec * megatron_flops_per_sample(self.run.model) / self.run.num_gpus / 1e12

    def mfu(self, peak: float, predicted: bool = True) -> float:
        """Model FLOPs (no recomputation) per second per GPU over ``peak``."""
        sps = self.samples_per_sec if predicted else self.run.samples_per_sec
        return sps * model_flops_per_sample(self.run.model) / self.run.num_gpus / peak


def predict_run(run: PublishedRun) -> CalibrationRow:
    """The cost model on ``run``'s layout (the fastest stated-or-possible microbatch)."""
    cluster = replace(load_cluster(run.cluster), flash_attention=run.flash_attention)
    t, p, w, B = run.tensor_parallel, run.pipeline_parallel, run.data_parallel, run.global_batch_size
    stage, policy = parse_recompute(run.recompute)
    sizes = (run.micro_batch_size,) if run.micro_batch_size else micro_batch_sizes(16)
    req = PlanRequest(run.model, cluster, run.num_gpus, B, run.precision, max_micro_batch_size=max(sizes),
                      balance_stages=False)
    costs = analytic_layer_costs(run.model, cluster, run.precision, (t,), sizes)
    best: CalibrationRow | None = None
    for b in sizes:
        if B % (b * w) or (p > 1 and B // (b * w) < p):
            continue
        cand = Candidate(t, p, w, b, B // (b * w), stage, run.schedule if p > 1 else "flush",
                         recompute_policy=policy, distributed_optimizer=run.distributed_optimizer,
                         sequence_parallel=run.sequence_parallel)
        ev = evaluate(cand, costs, req)
        pred = ev.prediction or predict(costs.at(t, b, run.sequence_parallel), cand, run.model.num_layers, cluster,
                                        req.param_bytes)
        sps = pred.samples_per_sec
        row = CalibrationRow(run, ev, sps)
        if best is None or (row.fits, row.samples_per_sec) > (best.fits, best.samples_per_sec):
            best = row
    if best is None:
        raise ConfigError(f"published.json: {run.name}: no microbatch divides the batch")
    return best


def calibration(runs: Iterable[PublishedRun] | None = None) -> list[CalibrationRow]:
    """Every published run, predicted."""
    return [predict_run(r) for r in (load_published()[1] if runs is None else runs)]


def format_calibration(rows: list[CalibrationRow]) -> str:
    """The predicted-vs-published table (docs/planner.md section 7)."""
    lines = [f"{'run':<14} {'source':<21} {'t':>2} {'p':>3} {'GPUs':>5} {'B':>5} {'b':>3} {'fits':>4} "
             f"{'published':>10} {'predicted':>10} {'ratio':>6} {'TFLOP/s pub/pred':>17} {'MFU pub/pred':>13}"]
    for r in rows:
        run, c = r.run, r.evaluated.candidate
        peak = load_cluster(run.cluster).peak(run.precision)
        flag = "" if abs(r.ratio - 1) <= TOLERANCE else " *"
        lines.append(
            f"{run.name:<14} {run.source.removeprefix('megatron-'):<21} "
            f"{run.tensor_parallel:>2} {run.pipeline_parallel:>3} "
            f"{run.num_gpus:>5} {run.global_batch_size:>5} {c.micro_batch_size:>3} {'yes' if r.fits else 'no':>4} "
            f"{run.samples_per_sec:>10.2f} {r.samples_per_sec:>10.2f} {r.ratio:>6.2f} "
            f"{run.tflops_per_gpu:>8.0f}/{r.predicted_tflops_per_gpu:<8.0f} "
            f"{r.mfu(peak, False):>6.2f}/{r.mfu(peak):<6.2f}{flag}")
    lines.append(f"samples/s; ratio = predicted / published ({'*'}: outside {TOLERANCE:.0%}); "
                 "TFLOP/s by Megatron's Eq. 3 (recomputation counted); MFU without it")
    return "\n".join(lines)


def calibration_json(rows: list[CalibrationRow]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        run, c = r.run, r.evaluated.candidate
        out.append({"name": run.name, "source": run.source, "tensor_parallel": run.tensor_parallel,
                    "pipeline_parallel": run.pipeline_parallel, "num_gpus": run.num_gpus,
                    "global_batch_size": run.global_batch_size, "micro_batch_size": c.micro_batch_size,
                    "fits": r.fits, "memory_GiB_per_gpu": round(r.evaluated.memory_bytes_per_gpu / GiB, 2),
                    "published_samples_per_sec": round(run.samples_per_sec, 3),
                    "predicted_samples_per_sec": round(r.samples_per_sec, 3), "ratio": round(r.ratio, 4),
                    "published_tflops_per_gpu": run.tflops_per_gpu,
                    "predicted_tflops_per_gpu": round(r.predicted_tflops_per_gpu, 1)})
    return out


# ---- schedule ratios: the Zero Bubble paper's ZB-1p / ZB-2p over 1F1B on one layout ------------------

# The paper's schedules and ours: ZB-1p is the automatic scheduler under 1F1B's activation memory (its
# Table 5 gives it ZB-H1's bubble in every setting), ZB-2p the same under twice that (ZB-H2's memory), both
# run with the paper's optimizer post-validation (its section 5), which only ZB-2p's overlapping steps gain
# from (zb-h1's steps do not overlap: zb-h1+pv prices as zb-h1).
ZB_SCHEDULES = {"zb-1p": "zb-h1", "zb-2p": "zb-h2+pv"}
BASELINE = "1f1b"  # the paper's 1F1B is our PipeDream-Flush


@dataclass(frozen=True)
class ScheduleRatioRun:
    """One layout of ``published.json``'s ``schedule_ratios``: the throughput of several schedules on it."""

    name: str
    source: str
    model: ModelConfig
    cluster: str
    precision: str
    pipeline_parallel: int
    num_gpus: int
    micro_batch_size: int
    num_micro_batches: int
    recompute: str
    flash_attention: bool
    published: dict[str, float]  # the source's schedule name -> samples per GPU per second
    published_memory_gb: dict[str, float] = field(default_factory=dict)  # the same -> GB (1e9 bytes) per GPU

    @property
    def layer_split(self) -> tuple[int, ...]:
        """The paper's split: the first and the last stage hold one layer fewer than the others."""
        d, n = self.pipeline_parallel, (self.model.num_layers + 2) // self.pipeline_parallel
        split = (n - 1,) + (n,) * (d - 2) + (n - 1,)
        if sum(split) != self.model.num_layers:
            raise ConfigError(f"published.json: {self.name}: {self.model.num_layers} layers do not split as "
                              f"n - 1, n, ..., n, n - 1 over {d} stages")
        return split

    def published_ratio(self, schedule: str) -> float:
        return self.published[schedule] / self.published[BASELINE]


def load_schedule_ratios(path: str | Path = PUBLISHED) -> tuple[dict[str, str], list[ScheduleRatioRun]]:
    """``(sources, runs)`` of ``published.json``'s ``schedule_ratios`` section."""
    data = json.loads(Path(path).read_text())
    d, section = data["defaults"], data["schedule_ratios"]
    runs = []
    for r in section["runs"]:
        get = lambda k, r=r: r.get(k, section.get(k, d.get(k)))  # noqa: E731 - run, then section, then file default
        model = ModelConfig("gpt", r["num_layers"], r["hidden_size"], r["num_attention_heads"], get("seq_length"),
                            vocab_size=get("vocab_size"), hidden_dropout=get("hidden_dropout"),
                            attention_dropout=get("attention_dropout"))
        if r["num_gpus"] != r["pipeline_parallel"]:
            raise ConfigError(f"published.json: {r['name']}: schedule ratios are pure pipelines (one stage per GPU)")
        runs.append(ScheduleRatioRun(r["name"], r["source"], model, get("cluster"), get("precision"),
                                     r["pipeline_parallel"], r["num_gpus"], r["micro_batch_size"],
                                     r["num_micro_batches"], get("recompute"), bool(get("flash_attention")),
                                     {k: float(v) for k, v in r["samples_per_gpu_per_sec"].items()},
                                     {k: float(v) for k, v in r.get("memory_GB", {}).items()}))
    return data["sources"], runs


@dataclass(frozen=True)
class ScheduleRatioRow:
    """A layout's predicted throughput ratios to Flush beside the published ones."""

    run: ScheduleRatioRun
    flush_samples_per_gpu: float       # predicted 1F1B samples per GPU per second
    predicted: dict[str, float]        # the source's schedule name -> predicted ratio to 1F1B
    # the source's schedule name -> predicted GB (1e9 bytes) on the fullest GPU (the zero-bubble ones from
    # their specs' in-flight and deferred weight-gradient counts)
    memory_gb: dict[str, float] = field(default_factory=dict)

    def error(self, schedule: str) -> float:
        """Predicted over published ratio, less 1."""
        return self.predicted[schedule] / self.run.published_ratio(schedule) - 1


def predict_schedule_ratios(run: ScheduleRatioRun) -> ScheduleRatioRow:
    """Flush and each zero-bubble schedule on ``run``'s layout (t = 1, w = 1, the paper's split), every one
    priced through its registry spec."""
    cluster = replace(load_cluster(run.cluster), flash_attention=run.flash_attention)
    stage, policy = parse_recompute(run.recompute)
    costs = analytic_layer_costs(run.model, cluster, run.precision, (1,), (run.micro_batch_size,)).at(
        1, run.micro_batch_size)
    cand = Candidate(1, run.pipeline_parallel, 1, run.micro_batch_size, run.num_micro_batches, stage, "flush",
                     layer_split=run.layer_split, recompute_policy=policy)
    L = run.model.num_layers
    pb = ParamBytes.for_precision(run.precision)
    flush = predict(costs, cand, L, cluster)

    def gb(c: Candidate) -> float:
        return max(s.total for s in plan_memory(costs, c, L, pb)) / 1e9

    predicted, memory = {}, {BASELINE: gb(cand)}
    for theirs, ours in ZB_SCHEDULES.items():
        if theirs in run.published:
            zb = replace(cand, schedule=ours)
            predicted[theirs] = flush.batch_s / predict(costs, zb, L, cluster).batch_s
            memory[theirs] = gb(zb)
    return ScheduleRatioRow(run, flush.samples_per_sec / run.num_gpus, predicted, memory)


def schedule_ratio_calibration(runs: Iterable[ScheduleRatioRun] | None = None) -> list[ScheduleRatioRow]:
    """Every schedule-ratio layout, predicted."""
    return [predict_schedule_ratios(r) for r in (load_schedule_ratios()[1] if runs is None else runs)]


def format_schedule_ratios(rows: list[ScheduleRatioRow]) -> str:
    """The predicted-vs-published ratio table (docs/planner.md section 7)."""
    names = list(ZB_SCHEDULES)
    head = " ".join(f"{n + ' pub/pred':>16}" for n in names)
    mem_head = " ".join(f"{n + ' GB':>11}" for n in [BASELINE, *names])
    lines = [f"{'run':<14} {'p':>3} {'b':>2} {'m':>4} {'1F1B/GPU pub/pred':>18} {head}  {mem_head}"]
    for r in rows:
        run = r.run
        cells = " ".join(f"{run.published_ratio(n):>7.3f}/{r.predicted[n]:<7.3f}"
                         + ("*" if abs(r.error(n)) > TOLERANCE else " ") for n in names if n in r.predicted)
        mems = " ".join(f"{_num(run.published_memory_gb.get(n), '.0f'):>5}/{_num(r.memory_gb.get(n), '.1f'):<5}"
                        for n in [BASELINE, *names])
        lines.append(f"{run.name:<14} {run.pipeline_parallel:>3} {run.micro_batch_size:>2} {run.num_micro_batches:>4} "
                     f"{run.published[BASELINE]:>8.2f}/{r.flush_samples_per_gpu:<9.2f} {cells}  {mems}")
    lines.append(f"ratios to 1F1B (Flush) throughput ({'*'}: outside {TOLERANCE:.0%}); ZB-1p priced as zb-h1, "
                 "ZB-2p as zb-h2 with post-validation (zb-h2+pv); GB (1e9 bytes) per GPU published/predicted")
    return "\n".join(lines)


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def schedule_ratios_json(rows: list[ScheduleRatioRow]) -> list[dict[str, Any]]:
    return [{"name": r.run.name, "source": r.run.source, "pipeline_parallel": r.run.pipeline_parallel,
             "micro_batch_size": r.run.micro_batch_size, "num_micro_batches": r.run.num_micro_batches,
             "published_1f1b_samples_per_gpu": r.run.published[BASELINE],
             "predicted_1f1b_samples_per_gpu": round(r.flush_samples_per_gpu, 3),
             "memory_GB": {n: {"published": r.run.published_memory_gb.get(n), "predicted": round(v, 2)}
                           for n, v in r.memory_gb.items()},
             "ratios": {n: {"published": round(r.run.published_ratio(n), 4), "predicted": round(r.predicted[n], 4)}
                        for n in r.predicted}} for r in rows]
