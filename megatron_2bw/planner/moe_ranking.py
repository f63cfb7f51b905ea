"""2BW vs Flush vs the best zero-bubble schedule for the planner-scale MoE presets on 64 to 1,024 H100s
(``tools/plan.py --moe-ranking``; the table of ``docs/planner.md`` section 12).

One search per (preset, GPU count), asked for the best plan of each schedule family (``search``'s ``keep``
selectors: the same answer as three exhaustive searches): every layout, microbatch, recomputation, optimizer
sharding and expert-parallel size is tried for each. Flush's family holds the plans without a pipeline too
(one stage runs as Flush). The all-to-all is priced per schedule as the planner prices the other per-microbatch
terms (``moe_costs``): on the critical path of every microbatch's forward and backward, so it is in each
schedule's microbatch time and, for the flushing ones, in their bubble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..config.moe_presets import get_moe_preset
from .hardware import Cluster
from .moe_report import alltoall_per_step
from .report import recompute_text
from .search import DEFAULT_MEMORY_MARGIN, FINER_RECOMPUTE, Evaluated, PlanRequest, search

PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3-class")
GPUS = (64, 128, 256, 512, 1024)
GLOBAL_BATCH = 2048  # sequences of 4,096 tokens: 8M tokens per step at every GPU count (strong scaling)
PRECISION = "bf16"
FAMILIES: Mapping[str, Any] = {
    "2BW": lambda c: c.schedule == "2bw",
    "Flush": lambda c: c.schedule == "flush",
    "zero-bubble": lambda c: c.schedule.startswith("zb-"),
}


@dataclass(frozen=True)
class RankingRow:
    """The best plan of each schedule family for one preset on ``num_gpus`` (None: none of it fits)."""

    preset: str
    num_gpus: int
    best: Mapping[str, Evaluated | None]

    def ratio(self, over: str) -> float | None:
        """2BW's samples/s over the family ``over``'s."""
        a, b = self.best.get("2BW"), self.best.get(over)
        return a.samples_per_sec / b.samples_per_sec if a and b else None

    @property
    def winner(self) -> str:
        fitting = {k: v.samples_per_sec for k, v in self.best.items() if v is not None}
        return max(fitting, key=fitting.get) if fitting else "-"


def moe_ranking(cluster: Cluster, force_balanced: bool = False, expert_load: float | None = None,
                presets: tuple[str, ...] = PRESETS, gpus: tuple[int, ...] = GPUS,
                global_batch: int = GLOBAL_BATCH) -> list[RankingRow]:
    """One row per (preset, GPU count): the best 2BW, Flush and zero-bubble plans."""
    rows = []
    for name in presets:
        model = get_moe_preset(name)
        for n in gpus:
            req = PlanRequest(model, cluster, n, global_batch, PRECISION, recompute_policies=FINER_RECOMPUTE,
                              memory_margin=DEFAULT_MEMORY_MARGIN, sequence_parallel_options=(False, True),
                              moe_force_balanced=force_balanced, moe_expert_load=expert_load)
            result = search(req, top=1, keep=FAMILIES, require_fit=False)
            rows.append(RankingRow(name, n, dict(result.best_of)))
    return rows


def _plan_text(ev: Evaluated | None) -> str:
    if ev is None:
        return "none fits"
    c = ev.candidate
    share = alltoall_per_step(ev) / ev.prediction.batch_s
    sched = c.schedule if c.schedule != "flush" or c.pipeline_parallel > 1 else "no pipeline"
    redo = "" if not c.recompute and c.recompute_policy is None else f", recompute {recompute_text(c)}"
    return (f"{ev.samples_per_sec:7.1f} ({sched}, t{c.tensor_parallel} d{c.pipeline_parallel} "
            f"w{c.data_parallel} e{c.expert_parallel} b{c.micro_batch_size}{redo}, a2a {100 * share:.0f}%)")


def format_moe_ranking(rows: list[RankingRow], load_text: str) -> str:
    """The ranking as a markdown table (samples/s of each family's best plan, its layout and recomputation
    (``yes``: whole stages; ``selective``, ``uniform1``: Megatron's), the all-to-all's share of its step, 2BW's
    ratio to the others)."""
    out = [f"2BW vs Flush vs the best zero-bubble schedule, planner-scale MoE presets, {PRECISION}, global batch "
           f"{GLOBAL_BATCH} x 4096 tokens; load: {load_text}", "",
           "| model | GPUs | 2BW samples/s (plan) | Flush | best zero-bubble | 2BW/Flush | 2BW/ZB | fastest |",
           "|---|---:|---|---|---|---:|---:|---|"]
    for r in rows:
        ratios = [f"{x:.3f}" if x else "-" for x in (r.ratio("Flush"), r.ratio("zero-bubble"))]
        out.append(f"| {r.preset} | {r.num_gpus} | {_plan_text(r.best['2BW'])} | {_plan_text(r.best['Flush'])} | "
                   f"{_plan_text(r.best['zero-bubble'])} | {ratios[0]} | {ratios[1]} | {r.winner} |")
    return "\n".join(out)


def moe_ranking_json(rows: list[RankingRow]) -> list[dict[str, Any]]:
    def plan(ev: Evaluated | None) -> dict[str, Any] | None:
        if ev is None:
            return None
        c = ev.candidate
        return {"schedule": c.schedule, "tensor_parallel": c.tensor_parallel, "pipeline_parallel": c.pipeline_parallel,
                "data_parallel": c.data_parallel, "expert_parallel": c.expert_parallel,
                "micro_batch_size": c.micro_batch_size, "recompute": recompute_text(c),
                "samples_per_sec": round(ev.samples_per_sec, 3),
                "batch_seconds": round(ev.prediction.batch_s, 6),
                "alltoall_seconds_per_step": round(alltoall_per_step(ev), 6),
                "memory_bytes_per_gpu": ev.memory_bytes_per_gpu}

    return [{"model": r.preset, "num_gpus": r.num_gpus, "best": {k: plan(v) for k, v in r.best.items()},
             "ratio_2bw_over_flush": r.ratio("Flush"), "ratio_2bw_over_zero_bubble": r.ratio("zero-bubble"),
             "fastest": r.winner} for r in rows]
