"""Model initialization per rank (issue 21 item 5): time and peak host memory of building a stage.

    python benchmarks/init_memory.py --size 100 --json docs/data/init_memory.json   # ~100M params, a minute
    python benchmarks/init_memory.py --size 1000 --device cuda --json out.json       # the issue's 1B, on a GPU
    python benchmarks/init_memory.py --quick                                         # smoke run, seconds

A GPT of about ``--size`` million parameters (hidden ``--hidden``, ``--vocab`` tokens) is built
the way a rank of the trainer builds it (``StageWeights``: 2BW's two bf16 weight versions and fp32
gradient buffers, on ``--device``), each case in a fresh process whose peak RSS is reset just before
(``/proc/self/clear_refs``): the whole model at d = 1, each stage of d = 2, and tensor rank 0 of
t = 2, with ``--use-cpu-initialization`` (the full tensors drawn on the CPU and split) and without
(per partition: each rank draws only its own shards, on its device). Reported per case: the rank's
parameters, seconds, the peak RSS the build added, and that peak over the buffers it allocates
(what a rank must hold: 1.0 means nothing beyond its own buffers). Construction needs no process
group, so t = 2 and d = 2 ranks are built one at a time in one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common

CASES = (  # (label, t, tp rank, d, pp rank, cpu_init)
    ("d1 cpu-init", 1, 0, 1, 0, True), ("d1 per-partition", 1, 0, 1, 0, False),
    ("d2 stage0 per-partition", 1, 0, 2, 0, False), ("d2 stage1 per-partition", 1, 0, 2, 1, False),
    ("t2 rank0 cpu-init", 2, 0, 1, 0, True), ("t2 rank0 per-partition", 2, 0, 1, 0, False),
)


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def build_case(model: dict, t: int, tp: int, d: int, pp: int, cpu_init: bool, device: str) -> dict:
    """Build one rank's stage (in this process) and measure it."""
    import torch

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.pipeline.weights import StageWeights
    from megatron_2bw.tensor_parallel.group import TPGroup

    torch.set_num_threads(1)
    dev = torch.device(device)
    spec = ModelSpec(ModelConfig(**model), TPGroup(None, tp, t), seed=1234)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # peak RSS := current RSS
    before = _status("VmRSS")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    w = StageWeights(lambda: spec.build_stage(d, pp), num_versions=2, dtype=torch.bfloat16, device=dev,
                     tp_rank=tp, grad_dtype=torch.float32, cpu_init=cpu_init)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    buffers = w.weight_bytes + w.grad_bytes
    out = {"params": w.numel, "seconds": seconds, "host_peak_added_bytes": _status("VmHWM") - before,
           "buffer_bytes": buffers}
    if dev.type == "cuda":
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    return out


def model_for(size_m: float, hidden: int, vocab: int = 50257, seq: int = 1024) -> dict:
    """A GPT of about ``size_m`` million parameters at ``hidden`` (an even number of layers: d = 2)."""
    vp = -(-vocab // 128) * 128
    layers = max(2, round((size_m * 1e6 - vp * hidden - seq * hidden) / (12 * hidden * hidden + 13 * hidden) / 2) * 2)
    return dict(kind="gpt", num_layers=layers, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                seq_length=seq, max_position_embeddings=seq, vocab_size=vocab)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=100, help="millions of parameters (the issue's target: 1000)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary (each of d = 2's stages holds the tied embedding)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, two cases")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a child: one case as JSON arguments
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(build_case(**json.loads(args.case))))
        return 0
    model = model_for(2, 128, 1000, seq=64) if args.quick else model_for(args.size, args.hidden, args.vocab)
    cases = (CASES[0], CASES[-1]) if args.quick else CASES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    rows = []
    for label, t, tp, d, pp, cpu_init in cases:
        case = dict(model=model, t=t, tp=tp, d=d, pp=pp, cpu_init=cpu_init, device=args.device)
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", json.dumps(case)],
                             capture_output=True, text=True, env=env, timeout=1800)
        if res.returncode != 0:
            sys.stderr.write(res.stderr)
            return 1
        row = {"case": label, "t": t, "d": d, "stage": pp, "use_cpu_initialization": cpu_init,
               **json.loads(res.stdout.strip().splitlines()[-1])}
        row["peak_added_over_buffers"] = row["host_peak_added_bytes"] / row["buffer_bytes"]
        rows.append(row)
        print(f"{label:26s} params={row['params'] / 1e6:7.1f}M  {row['seconds']:6.2f} s  peak added "
              f"{row['host_peak_added_bytes'] / 2**20:8.0f} MiB = {row['peak_added_over_buffers']:.2f}x its buffers",
              flush=True)
    if args.json:
        common.write_json(args.json, {"model": model, "device": args.device, "machine": common.machine_info(),
                                      "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
