"""Does 2BW's slack hide the cross-stage reductions? Time each update spends waiting for them.

Every schedule launches the same reduction chain after a step's last backward (data-parallel
all-reduce, tied-embedding all-reduce between the first and last stage, global gradient norm)
and waits for it before the update. Flush and GPipe update at once, so the wait is on their
critical path; 2BW updates only just before the first forward of step t+2 needs W(t+1), so the
chain should have finished by then. This measures, per stage, the seconds APPLY_UPDATE waited per
step (``stats.update_wait_s``) next to the step time, at d = 2 on CPU processes.

    python benchmarks/update_overlap.py [--steps 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import build_state
from megatron_2bw.pipeline.executor import PipelineStage
from megatron_2bw.tensor_parallel.group import TPGroup
from megatron_2bw.testing.local_workers import run_workers

SCHEDULES = ("2bw", "flush", "gpipe")


def _worker(model: dict, b: int, m: int, steps: int) -> dict:
    torch.set_num_threads(1)
    state = build_state(1, 2, 1, torch.device("cpu"))
    cfg = ModelConfig(**model)
    spec = ModelSpec(cfg, TPGroup(), seed=1)
    data = torch.randint(0, cfg.vocab_size, (m, b, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for schedule in SCHEDULES:
        stage = PipelineStage(lambda: spec.build_stage(2, state.pp_rank), spec.loss_fn(), state,
                              PipelineConfig(schedule, b, m, track_memory=False), OptimizerConfig(lr=1e-4),
                              (b, cfg.seq_length, cfg.hidden_size))
        get_batch = lambda mb: spec.make_batch(data[mb % m])  # noqa: E731
        stage.train(1, get_batch, lambda t: 1e-4)  # warm-up step
        stage.stats.update_wait_s = 0.0
        t0 = time.perf_counter()
        stage.train(steps, get_batch, lambda t: 1e-4)
        out[schedule] = {"step_s": (time.perf_counter() - t0) / steps, "wait_s": stage.stats.update_wait_s / steps}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--m", type=int, default=8)
    p.add_argument("--json")
    args = p.parse_args(argv)
    model = dict(kind="gpt", num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                 max_position_embeddings=128, vocab_size=1000)
    rounds = [run_workers(_worker, 2, model, args.micro_batch, args.m, args.steps, timeout=900)
              for _ in range(args.rounds)]
    rows = []
    print("schedule stage | step ms (median) | update wait ms per step (median) | wait / step")
    for s in SCHEDULES:
        for r in range(2):
            step = statistics.median(rd[r][s]["step_s"] for rd in rounds)
            wait = statistics.median(rd[r][s]["wait_s"] for rd in rounds)
            rows.append({"schedule": s, "stage": r, "step_s": step, "update_wait_s": wait, "wait_fraction": wait / step})
            print(f"{s:6} {r} | {step * 1e3:8.1f} | {wait * 1e3:8.2f} | {wait / step:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "micro_batch": args.micro_batch, "m": args.m, "d": 2, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
