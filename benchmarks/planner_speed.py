"""How long ``tools/plan.py`` takes per cluster size: the whole command, the search inside it, and the
candidates it priced and pruned (medians of ``--rounds`` runs, each in a fresh process so that no cache
of an earlier run helps).

The whole search: every schedule of the registry, the recomputation policies, sequence parallelism, the
distributed optimizer and uneven splits, for GPT-2.2B on the paper's V100 servers (sequence 512, global
batch 8 per GPU: 512 on 64 GPUs, the command the planner is usually timed with) and GPT-3 175B on A100s
(batch 1536). ``--exhaustive-sizes`` also times ``tools/plan.py --exhaustive`` (every candidate priced:
what the search did before it pruned) at those sizes.

    python benchmarks/planner_speed.py --json docs/data/planner_speed.json
    python benchmarks/planner_speed.py --sizes 8 64 --rounds 1 --exhaustive-sizes   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from common import ROOT, cpu_busy_seconds, table, write_json

PLAN = os.path.join(ROOT, "tools", "plan.py")
GPT_2P2B = ["--model-preset", "gpt-2.2b", "--seq-length", "512", "--cluster", "aws-p3.16xlarge"]
GPT_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
            "--vocab-size", "50257", "--cluster", "dgx-a100-80gb", "--precision", "bf16"]
# (label, model and cluster flags, global batch of N GPUs, extra flags, fewest GPUs it fits on)
CASES = (
    ("gpt-2.2b V100, replicated optimizer", GPT_2P2B, lambda n: 8 * n, ["--no-distributed-optimizer"], 1),
    ("gpt-2.2b V100, whole search", GPT_2P2B, lambda n: 8 * n, [], 1),
    ("gpt-175b A100, whole search", GPT_175B, lambda n: 1536, [], 64),
)


def run_once(argv: list[str]) -> dict:
    """One ``tools/plan.py --json`` in a fresh process: wall and CPU seconds, and its JSON's counts."""
    before, busy = resource.getrusage(resource.RUSAGE_CHILDREN), cpu_busy_seconds()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, PLAN, *argv, "--json"], capture_output=True, text=True, timeout=3600,
                          cwd=ROOT)
    wall = time.perf_counter() - start
    after, busy = resource.getrusage(resource.RUSAGE_CHILDREN), cpu_busy_seconds() - busy
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"error: tools/plan.py {' '.join(argv)} failed: {proc.stderr.strip()}")
    out = json.loads(proc.stdout)
    best = out["best"]
    return {"wall_s": wall, "cpu_s": cpu, "others_cpus": max(0.0, (busy - cpu) / wall),
            "search_s": out["search_seconds"], "considered": out["considered"], "priced": out["priced"],
            "pruned": out["pruned"], "fit": out["feasible"],
            "best": {k: best[k] for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch_size",
                                          "schedule", "recompute", "recompute_policy", "sequence_parallel",
                                          "distributed_optimizer", "layer_split", "samples_per_sec")},
            "best_t1_samples_per_sec": out["best_t1"]["samples_per_sec"] if out.get("best_t1") else None}


def measure(label: str, flags: list[str], n: int, batch: int, rounds: int, exhaustive: bool) -> dict:
    argv = [*flags, "--num-gpus", str(n), "--global-batch-size", str(batch)] + (["--exhaustive"] if exhaustive else [])
    runs = [run_once(argv) for _ in range(rounds)]
    first = runs[0]
    if any(r["best"] != first["best"] or r["considered"] != first["considered"] for r in runs):
        raise SystemExit(f"error: {label} N={n}: runs disagree")
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "search_s", "others_cpus")}
    return {"case": label, "num_gpus": n, "global_batch_size": batch, "exhaustive": exhaustive,
            "command": ["tools/plan.py", *argv, "--json"], "rounds": rounds,
            "wall_seconds_median": round(med["wall_s"], 3), "cpu_seconds_median": round(med["cpu_s"], 3),
            "search_seconds_median": round(med["search_s"], 3),
            "other_processes_busy_cpus_median": round(med["others_cpus"], 2),  # the load other jobs added
            "wall_seconds": [round(r["wall_s"], 3) for r in runs],
            **{k: first[k] for k in ("considered", "priced", "pruned", "fit", "best", "best_t1_samples_per_sec")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024], help="numbers of GPUs")
    p.add_argument("--rounds", type=int, default=3, help="runs per size (medians)")
    p.add_argument("--exhaustive-sizes", type=int, nargs="*", default=[64],
                   help="sizes also timed with --exhaustive (the first case only)")
    p.add_argument("--cases", type=int, nargs="+", default=list(range(len(CASES))),
                   help=f"which of the {len(CASES)} cases (indices)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1 or any(n < 1 for n in args.sizes) or any(not 0 <= i < len(CASES) for i in args.cases):
        p.error("--rounds and --sizes must be positive, --cases among the case indices")
    rows = []
    for i in args.cases:
        label, flags, batch, extra, fewest = CASES[i]
        for n in (n for n in args.sizes if n >= fewest):
            rows.append(measure(label, flags + extra, n, batch(n), args.rounds, False))
            print(f"{label} N={n}: {rows[-1]['wall_seconds_median']:.2f} s", file=sys.stderr, flush=True)
    label, flags, batch, extra, _ = CASES[args.cases[0]]
    for n in args.exhaustive_sizes:
        rows.append(measure(label, flags + extra, n, batch(n), 1, True))
    print(table(rows, [("case", "case", ""), ("num_gpus", "GPUs", ""), ("exhaustive", "exhaustive", ""),
                       ("wall_seconds_median", "command s", ".2f"), ("cpu_seconds_median", "CPU s", ".2f"),
                       ("search_seconds_median", "search s", ".2f"),
                       ("other_processes_busy_cpus_median", "others' CPUs", ".1f"), ("considered", "considered", ""),
                       ("priced", "priced", ""), ("pruned", "pruned", "")]))
    write_json(args.json, {
        "benchmark": "planner_speed",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": list(os.getloadavg())},
        "about": "tools/plan.py per cluster size, each run a fresh process: wall and CPU seconds of the whole "
                 "command and the search's own (wall) seconds, medians, with the CPUs other processes kept busy "
                 "meanwhile (a shared machine's wall times follow that load; the CPU seconds much less), and the "
                 "candidates considered, priced and pruned",
        "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
