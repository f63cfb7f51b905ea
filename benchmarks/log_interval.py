"""Logging without drains: 2BW with ``--log-interval 1`` against ``--log-interval 100``, real trainer, d = 2, m = 4.

Both runs are ``pretrain_gpt.py`` under ``torch.distributed.run`` (2 processes, one torch thread
each, CPU, gloo) with the same model (preset ``gpt-demo``: 4 layers, hidden 256, sequence 128, the
demo corpus's 8000-piece vocabulary), seed, data and schedule, without evaluations or saves. Only
``--log-interval`` differs: 1 prints Megatron's training line (and the stage statistics) after every
step, 100 once per 100 steps. Each step's loss and statistics are reduced asynchronously either way,
so neither run drains its pipeline before the end (the JSON carries each run's ``pipeline_drains``).

Measurement: the two settings run in alternating rounds (the machine's speed drifts); a run's
throughput is its steady state, the rate at which rank 0 writes the metrics file's ``train``
records between record ``--skip`` and the fourth-last (start-up, the pipeline fill and the final
drain left out). Per round, ratio = samples/s of log-interval 1 / samples/s of log-interval 100;
the medians over rounds are reported. Target: the ratio is at least 0.97.

JSON (``--json``): ``{"results": [{"log_interval", "samples_per_sec" (median over rounds),
"samples_per_sec_rounds", "foreign_load_cpus_rounds" (other jobs' CPU use during each run, in
cores: on a shared machine the ratio is only as good as this is small), "pipeline_drains", "steps"}],
"ratio_log1_over_log100" (median of the per-round ratios), "ratio_rounds", "target": 0.97, "within_target",
"config", "machine"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import common
from convergence_runs import _children_cpu, ensure_data, run_group

ROOT = common.ROOT
INTERVALS = (1, 100)
TARGET = 0.97


def trainer_command(args, log_interval: int, data_prefix: str, tok_model: str, metrics: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(ROOT, "pretrain_gpt.py"), "--model-preset", args.preset, "--seq-length", str(args.seq),
            "--max-position-embeddings", str(args.seq), "--device", "cpu", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "2bw", "--micro-batch-size", str(args.micro_batch),
            "--global-batch-size", str(args.micro_batch * args.m), "--train-iters", str(args.iters),
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
            "--data-path", data_prefix, "--split", "98,2,0", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", tok_model, "--log-interval", str(log_interval), "--eval-iters", "0",
            "--metrics-file", metrics]


def steady_rate(metrics: str, skip: int) -> tuple[float, int, int]:
    """(steps/s between train record ``skip`` and the fourth-last, steps recorded, pipeline drains)."""
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    times = [r["time"] for r in rows if r["type"] == "train"]
    (end,) = [r for r in rows if r["type"] == "end"]
    lo, hi = skip, len(times) - 4
    if hi - lo < 2:
        raise RuntimeError(f"{metrics}: too few steps ({len(times)}) for --skip {skip}")
    return (hi - lo) / (times[hi] - times[lo]), len(times), end["pipeline_drains"]


def run_one(args, log_interval: int, data_prefix: str, tok_model: str, tag: str) -> dict:
    metrics = os.path.join(args.out_dir, f"metrics_log{log_interval}_{tag}.jsonl")
    log = os.path.join(args.out_dir, f"log_log{log_interval}_{tag}.txt")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = trainer_command(args, log_interval, data_prefix, tok_model, metrics)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    busy0, own0, t0 = common.cpu_busy_seconds(), _children_cpu(), time.time()
    with open(log, "w") as f:
        rc = run_group(cmd, args.timeout, cwd=ROOT, env=env, stdout=f, stderr=f)
    if rc != 0:
        raise RuntimeError(f"--log-interval {log_interval}: trainer exited with status {rc} (log: {log})")
    busy, own, wall = common.cpu_busy_seconds() - busy0, _children_cpu() - own0, time.time() - t0
    rate, steps, drains = steady_rate(metrics, args.skip)
    return {"samples_per_sec": rate * args.micro_batch * args.m, "steps": steps, "pipeline_drains": drains,
            "foreign_load_cpus": max(0.0, busy - own) / wall if busy > 0 else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=60, help="training steps of each run")
    p.add_argument("--skip", type=int, default=8, help="train records left out at the start (start-up, fill)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two runs")
    p.add_argument("--preset", default="gpt-demo")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="b")
    p.add_argument("--m", type=int, default=4, help="microbatches per step (w = 1)")
    p.add_argument("--data-dir", default=None, help="cached corpus/tokenizer/dataset (default demo_data, quick: "
                                                    "demo_data/quick)")
    p.add_argument("--out-dir", default=None, help="metrics files and logs (default runs/log_interval[_quick])")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per training run before it is killed")
    p.add_argument("--quick", action="store_true", help="tiny model, 16 steps, one round: a smoke run")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.skip, args.rounds, args.preset, args.seq, args.micro_batch = 16, 4, 1, "gpt-tiny", 16, 1
    data_dir = args.data_dir or os.path.join(ROOT, "demo_data", "quick" if args.quick else "")
    data_prefix, tok_model = ensure_data(data_dir, 500 if args.quick else 8000, 0.3 if args.quick else 4)
    if args.out_dir:  # a directory given: new, empty or this benchmark's earlier output (the default is its own)
        common.out_dir(args.out_dir, "log_interval")
    args.out_dir = args.out_dir or os.path.join(ROOT, "runs", "log_interval_quick" if args.quick else "log_interval")
    os.makedirs(args.out_dir, exist_ok=True)
    machine, t0 = common.machine_info(), time.time()
    runs: dict[int, list[dict]] = {k: [] for k in INTERVALS}
    for k in range(args.rounds):
        for interval in INTERVALS if k % 2 == 0 else INTERVALS[::-1]:
            runs[interval].append(run_one(args, interval, data_prefix, tok_model, f"round{k}"))
            print(f"round {k}: --log-interval {interval}: {runs[interval][-1]['samples_per_sec']:.1f} samples/s",
                  flush=True)
    ratios = [a["samples_per_sec"] / b["samples_per_sec"] for a, b in zip(runs[1], runs[100], strict=False)]
    results = [{"log_interval": i, "samples_per_sec": common.median(r["samples_per_sec"] for r in runs[i]),
                "samples_per_sec_rounds": [r["samples_per_sec"] for r in runs[i]],
                "foreign_load_cpus_rounds": [r["foreign_load_cpus"] for r in runs[i]],
                "pipeline_drains": sorted({r["pipeline_drains"] for r in runs[i]}), "steps": runs[i][0]["steps"]}
               for i in INTERVALS]
    ratio = common.median(ratios)
    print(common.table(results, [("log_interval", "--log-interval", "d"), ("samples_per_sec", "samples/s", ".1f"),
                                 ("pipeline_drains", "drains", "")]))
    print(f"ratio log 1 / log 100: {ratio:.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)}; target >= {TARGET})")
    common.write_json(args.json, {
        "results": results, "ratio_log1_over_log100": ratio, "ratio_rounds": ratios, "target": TARGET,
        "within_target": ratio >= TARGET, "seconds": time.time() - t0, "machine": machine,
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
