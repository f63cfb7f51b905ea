"""Does 2BW's slack hide the cross-stage reductions? Time each update spends waiting for them.

Every schedule launches the same reduction chain after a step's last backward (data-parallel
all-reduce, tied-embedding all-reduce between the first and last stage, global gradient norm)
and waits for it before the update. Flush and GPipe update at once, so the wait is on their
critical path; 2BW updates only just before the first forward of step t+2 needs W(t+1), so the
chain should have finished by then. This measures, per stage, the seconds APPLY_UPDATE waited per
step (``stats.update_wait_s``) next to the step time, at d = 2 on CPU processes.

``--distributed-optimizer`` instead runs 2BW at d = 2, w = 2 (four processes) with and without
``--use-distributed-optimizer``, alternating within each round in one launch, and reports the
median step time of each: the all-gather of W(t+1) must hide like the reductions do (review P1).

    python benchmarks/update_overlap.py [--steps 8] [--json FILE]
    python benchmarks/update_overlap.py --distributed-optimizer [--rounds 5] [--json docs/data/zero_overlap.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
from megatron_2bw.local_workers import run_workers
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import Axes, build_state
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.executor import PipelineRank

SCHEDULES = ("2bw", "flush", "gpipe")


def _worker(model: dict, b: int, m: int, steps: int) -> dict:
    torch.set_num_threads(1)
    state = build_state(Axes(pipeline=2), torch.device("cpu"))
    cfg = ModelConfig(**model)
    spec = ModelSpec(cfg, ModelGroups(), seed=1)
    data = torch.randint(0, cfg.vocab_size, (m, b, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for schedule in SCHEDULES:
        stage = build_stage(lambda: spec.build_stage(2, state.pp_rank), spec.loss_fn(), state,
                              PipelineConfig(schedule, b, m, track_memory=False), OptimizerConfig(lr=1e-4),
                              (b, cfg.seq_length, cfg.hidden_size))
        get_batch = lambda mb: spec.make_batch(data[mb % m])  # noqa: E731
        stage.train(1, get_batch, lambda t: 1e-4)  # warm-up step
        stage.stats.update_wait_s = 0.0
        t0 = time.perf_counter()
        stage.train(steps, get_batch, lambda t: 1e-4)
        out[schedule] = {"step_s": (time.perf_counter() - t0) / steps, "wait_s": stage.stats.update_wait_s / steps}
    return out


def _zero_worker(model: dict, b: int, m: int, steps: int, rounds: int) -> list[dict]:
    """Per round: 2BW step time and update wait without and with the distributed optimizer: both stages
    built once, their segments alternating (order flipped every round) so that each pair runs close
    in time on a shared machine."""
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    state = build_state(Axes(data=2, pipeline=2), torch.device("cpu"))
    cfg = ModelConfig(**model)
    spec = ModelSpec(cfg, ModelGroups(), seed=1)
    data = torch.randint(0, cfg.vocab_size, (2 * m, b, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    get_batch = lambda mb: spec.make_batch(data[state.dp_rank * m + mb % m])  # noqa: E731
    stages = {}
    for on in (False, True):
        stages[on] = build_stage(lambda: spec.build_stage(2, state.pp_rank), spec.loss_fn(), state,
                                   PipelineConfig("2bw", b, m, track_memory=False),
                                   OptimizerConfig(lr=1e-4, use_distributed_optimizer=on),
                                   (b, cfg.seq_length, cfg.hidden_size))
        stages[on].train(1, get_batch, lambda t: 1e-4)  # warm-up step
        _time_gather_waits(stages[on])
    out = []
    for rd in range(rounds):
        row = {}
        for on in ((False, True) if rd % 2 == 0 else (True, False)):
            stage = stages[on]
            stage.stats.update_wait_s = stage.gather_wait_s = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            stage.train(steps, get_batch, lambda t: 1e-4)
            row["zero" if on else "plain"] = {"step_s": (time.perf_counter() - t0) / steps,
                                              "wait_s": stage.stats.update_wait_s / steps,
                                              "gather_wait_s": stage.gather_wait_s / steps}
        out.append(row)
    return out


def _time_gather_waits(stage: PipelineRank) -> None:
    """Count the seconds the stage's forwards wait for the all-gather of their weights (``gather_wait_s``)."""
    wait_slot = stage.reducer.wait_slot

    def timed(slot: int) -> None:
        t0 = time.perf_counter()
        wait_slot(slot)
        stage.gather_wait_s += time.perf_counter() - t0

    stage.gather_wait_s = 0.0
    stage.reducer.wait_slot = timed


def _zero_main(args, model: dict) -> int:
    ranks = run_workers(_zero_worker, 4, model, args.micro_batch, args.m, args.steps, args.rounds, timeout=1800)
    # a round's step time is its slowest rank's (the pipeline runs at the pace of its slowest stage)
    med = {k: statistics.median(max(r[i][k]["step_s"] for r in ranks) for i in range(args.rounds))
           for k in ("plain", "zero")}
    wait = {k: statistics.median(max(r[i][k]["wait_s"] for r in ranks) for i in range(args.rounds))
            for k in ("plain", "zero")}
    gather = statistics.median(max(r[i]["zero"]["gather_wait_s"] for r in ranks) for i in range(args.rounds))
    ratio = med["zero"] / med["plain"]
    pairs = [max(r[i]["zero"]["step_s"] for r in ranks) / max(r[i]["plain"]["step_s"] for r in ranks)
             for i in range(args.rounds)]
    print("2bw d=2 w=2 | step ms (median of rounds) | update wait ms per step")
    for k in ("plain", "zero"):
        print(f"{k:5} | {med[k] * 1e3:8.1f} | {wait[k] * 1e3:8.2f}")
    print(f"forwards' wait for the all-gather, ms per step (median): {gather * 1e3:.2f}")
    print(f"distributed optimizer / plain = {ratio:.3f} (ratio of medians); {statistics.median(pairs):.3f} "
          f"(median of the {args.rounds} paired rounds)")
    if args.json:
        result = {"model": model, "micro_batch": args.micro_batch, "m": args.m, "d": 2, "w": 2, "steps": args.steps,
                  "rounds": args.rounds, "step_s_median": med, "update_wait_s_median": wait, "ratio": ratio,
                  "zero_gather_wait_s_median": gather,
                  "paired_ratio_median": statistics.median(pairs),
                  "per_round_step_s": [{k: max(r[i][k]["step_s"] for r in ranks) for k in ("plain", "zero")}
                                       for i in range(args.rounds)]}
        _write_json(args.json, result)
    return 0


def _write_json(path: str, obj: dict) -> None:
    """Atomically: a temp name, then a rename."""
    import os  # noqa: PLC0415

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--m", type=int, default=8)
    p.add_argument("--json")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="2BW at d=2, w=2 with and without --use-distributed-optimizer, side by side")
    args = p.parse_args(argv)
    model = dict(kind="gpt", num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                 max_position_embeddings=128, vocab_size=1000)
    if args.distributed_optimizer:
        return _zero_main(args, model)
    rounds = [run_workers(_worker, 2, model, args.micro_batch, args.m, args.steps, timeout=900)
              for _ in range(args.rounds)]
    rows = []
    print("schedule stage | step ms (median) | update wait ms per step (median) | wait / step")
    for s in SCHEDULES:
        for r in range(2):
            step = statistics.median(rd[r][s]["step_s"] for rd in rounds)
            wait = statistics.median(rd[r][s]["wait_s"] for rd in rounds)
            rows.append({"schedule": s, "stage": r, "step_s": step, "update_wait_s": wait,
                         "wait_fraction": wait / step})
            print(f"{s:6} {r} | {step * 1e3:8.1f} | {wait * 1e3:8.2f} | {wait / step:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "micro_batch": args.micro_batch, "m": args.m, "d": 2, "results": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
