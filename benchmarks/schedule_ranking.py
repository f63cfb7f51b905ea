"""docs/planner.md section 9's "What the ranking does" table: what the planner predicts for each schedule of
the registry on two fixed layouts of section 7's jobs (bf16, fused attention, the distributed optimizer, the
default 10% memory margin, the search's recomputation settings), through the specs as they are registered.

Per schedule and layout: the fastest candidate of the search that fits (samples/s, GiB per GPU, and its
recomputation where it needs one), else "does not fit" with the smallest one's GiB. Seconds of CPU.

    python benchmarks/schedule_ranking.py            # the markdown table
"""

from __future__ import annotations

import argparse
import sys

from megatron_2bw.cli import OneLineParser, add_model_flags, model_config
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.search import (
    DEFAULT_MEMORY_MARGIN,
    FINER_RECOMPUTE,
    PlanRequest,
    candidates,
    default_costs,
    evaluate,
)
from megatron_2bw.schedule.schedules import PLANNED_SCHEDULES

GiB = 2**30
# the docs' columns; gpipe left out; a schedule id with +pv: with optimizer post-validation
ORDER = ("flush", "2bw", "zb-h1", "zb-h2", "zb-h2+pv", "interleaved-1f1b", "zb-v", "zb-v+pv")
SHAPE = "--num-layers {} --hidden-size {} --num-attention-heads {} --seq-length 2048 --vocab-size 50257"
# (label, shape, cluster, GPUs, global batch, (t, d, w, b)): ../shared/reviews/scale-review.md's jobs
JOBS = (
    ("175B, 1024 A100, t8 d8 w16 b1", SHAPE.format(96, 12288, 96), "dgx-a100-80gb", 1024, 1536, (8, 8, 16, 1)),
    ("13B, 64 H100, t1 d4 w16 b2", SHAPE.format(40, 5120, 40), "dgx-h100", 64, 1024, (1, 4, 16, 2)),
)


def _model(shape: str):
    p = OneLineParser()
    add_model_flags(p)
    return model_config(p.parse_args(shape.split()))


def cell(job: tuple, schedule: str) -> str:
    """The table's cell of one job (a ``JOBS`` row) and schedule."""
    _, shape, cluster, gpus, batch, layout = job
    req = PlanRequest(_model(shape), load_cluster(cluster), gpus, batch, "bf16", schedules=(schedule,),
                      recompute_policies=FINER_RECOMPUTE, memory_margin=DEFAULT_MEMORY_MARGIN,
                      distributed_optimizer_options=(True,))
    costs = default_costs(req)
    evs = [evaluate(c, costs, req) for c in candidates(req, costs)
           if (c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.micro_batch_size) == layout]
    if not evs:
        return "does not run"
    fit = [e for e in evs if e.prediction is not None]
    if not fit:
        return f"does not fit ({min(e.memory_bytes_per_gpu for e in evs) / GiB:.1f})"
    best = max(fit, key=lambda e: (e.samples_per_sec, -e.memory_bytes_per_gpu))
    c = best.candidate
    rc = " rc" if c.recompute else f" {c.recompute_policy.label}" if c.recompute_policy else ""
    return f"{best.samples_per_sec:.1f}, {best.memory_bytes_per_gpu / GiB:.1f}{rc}"  # rc: whole-stage recomputation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", nargs="+", choices=PLANNED_SCHEDULES,
                   default=[s for s in ORDER if s in PLANNED_SCHEDULES]
                   + [s for s in PLANNED_SCHEDULES if s not in (*ORDER, "gpipe")])
    args = p.parse_args(argv)
    print("| job, layout | " + " | ".join(args.schedules) + " |")
    print("| --- |" + " --- |" * len(args.schedules))
    for i, job in enumerate(JOBS):
        label = job[0] + (" (samples/s, GiB/GPU)" if i == 0 else "")
        print(f"| {label} | " + " | ".join(cell(job, s) for s in args.schedules) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
