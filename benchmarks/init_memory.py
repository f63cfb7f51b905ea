"""Model initialization per rank (issue 21 item 5): time and peak host memory of building a stage.

    python benchmarks/init_memory.py --size 100 --json docs/data/init_memory.json   # ~100M params, a minute
    python benchmarks/init_memory.py --size 1000 --device cuda --json out.json       # the issue's 1B, on a GPU
    python benchmarks/init_memory.py --size 1000 --hidden 2048 --cases t2 --json docs/data/init_memory_1b.json
        # the issue's 1B stage at t = 2 on the CPU: both tensor ranks, both paths (~6 GiB per process)
    python benchmarks/init_memory.py --quick                                         # smoke run, seconds

A GPT of about ``--size`` million parameters (hidden ``--hidden``, ``--vocab`` tokens) is built
the way a rank of the trainer builds it (``RankWeights``: 2BW's two bf16 weight versions and fp32
gradient buffers, on ``--device``), each case in a fresh process whose peak RSS is reset just before
(``/proc/self/clear_refs``): the whole model at d = 1, each stage of d = 2, and tensor rank 0 of
t = 2, with ``--use-cpu-initialization`` (the full tensors drawn on the CPU and split) and without
(per partition: each rank draws only its own shards, on its device). Reported per case: the rank's
parameters, seconds, the peak RSS the build added, and that peak over the buffers it allocates
(what a rank must hold: 1.0 means nothing beyond its own buffers). Construction needs no process
group, so t = 2 and d = 2 ranks are built one at a time in one machine.

The full build's peak can hide a transient: the CPU path's full matrix is drawn and freed before
the second version and the gradient buffers exist (and while the weight buffer's later pages are
not yet touched). So each case is also built a second time (``weights_only``: one version, no
gradient buffer) with the peak RSS reset before each parameter is drawn: the largest peak beyond
the RSS before it and its own view of the buffer is what drawing the values needs, reported
against the largest full (unsharded) matrix of the stage in fp32. The CPU path draws each full
matrix (1.0x the largest); the per-partition path draws only its shard, in fp32 before rounding
to the weights' dtype (0.5x at t = 2 for a matrix split in two).
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
T2_CASES = (  # the 1B stage at t = 2: both tensor ranks, both paths
    ("t2 rank0 cpu-init", 2, 0, 1, 0, True), ("t2 rank0 per-partition", 2, 0, 1, 0, False),
    ("t2 rank1 cpu-init", 2, 1, 1, 0, True), ("t2 rank1 per-partition", 2, 1, 1, 0, False),
)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # peak RSS := current RSS


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def build_case(model: dict, t: int, tp: int, d: int, pp: int, cpu_init: bool, device: str,
               weights_only: bool = False) -> dict:
    """Build one rank's stage (in this process) and measure it (``weights_only``: one weight version,
    no gradient buffer, to see the drawing's transient)."""
    import torch
    from torch import nn

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.pipeline.weights import RankWeights
    from megatron_2bw.tensor_parallel import init
    from megatron_2bw.tensor_parallel.group import TPGroup

    torch.set_num_threads(1)
    dev = torch.device(device)
    spec = ModelSpec(ModelConfig(**model), ModelGroups(TPGroup(None, tp, t)), seed=1234)
    drawn: list[tuple[str, int]] = []  # weights_only: (parameter, peak RSS of its drawing beyond its own view)
    if weights_only:
        plain = init.materialize

        def measured(p, out, *, cpu: bool) -> None:
            _reset_peak()
            rss = _status("VmRSS")
            plain(p, out, cpu=cpu)
            drawn.append((p.init.name, _status("VmHWM") - rss - out.numel() * out.element_size()))

        init.materialize = measured
    _reset_peak()
    before = _status("VmRSS")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    w = RankWeights(lambda: spec.build_stage(d, pp), num_versions=1 if weights_only else 2, dtype=torch.bfloat16,
                     device=dev, tp_rank=tp, grad_dtype=torch.float32, cpu_init=cpu_init,
                     num_grad_buffers=0 if weights_only else None)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    buffers = w.weight_bytes + w.grad_bytes
    out = {"params": w.numel, "seconds": seconds, "host_peak_added_bytes": _status("VmHWM") - before,
           "buffer_bytes": buffers, "weight_bytes": w.weight_bytes, "grad_bytes": w.grad_bytes}
    with init.deferred():  # the largest full (unsharded) tensor of the stage, from its Inits (meta: no memory)
        mods = nn.ModuleList(spec.build_stage(d, pp))
    if drawn:
        name, out["drawing_transient_bytes"] = max(drawn, key=lambda x: x[1])
        out["drawing_transient_parameter"] = name
    out["largest_full_matrix_fp32_bytes"] = 4 * max(
        int(torch.Size(p.init.full_shape).numel()) for p in mods.parameters() if hasattr(p, "init"))
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
    p.add_argument("--vocab", type=int, default=50257,
                   help="vocabulary (each of d = 2's stages holds the tied embedding)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, two cases")
    p.add_argument("--cases", choices=("all", "t2"), default="all",
                   help="all: d = 1, d = 2's stages, t = 2 rank 0; t2: both t = 2 ranks, both paths (the issue's 1B)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a child: one case as JSON arguments
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(build_case(**json.loads(args.case))))
        return 0
    model = model_for(2, 128, 1000, seq=64) if args.quick else model_for(args.size, args.hidden, args.vocab)
    cases = (CASES[0], CASES[-1]) if args.quick else T2_CASES if args.cases == "t2" else CASES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    rows = []
    def child(case: dict) -> dict | None:
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", json.dumps(case)],
                             capture_output=True, text=True, env=env, timeout=1800)
        if res.returncode != 0:
            sys.stderr.write(res.stderr)
            return None
        return json.loads(res.stdout.strip().splitlines()[-1])

    for label, t, tp, d, pp, cpu_init in cases:
        case = dict(model=model, t=t, tp=tp, d=d, pp=pp, cpu_init=cpu_init, device=args.device)
        full, alone = child(case), child({**case, "weights_only": True})
        if full is None or alone is None:
            return 1
        row = {"case": label, "t": t, "tp_rank": tp, "d": d, "stage": pp, "use_cpu_initialization": cpu_init, **full}
        row["peak_added_over_buffers"] = row["host_peak_added_bytes"] / row["buffer_bytes"]
        transient = alone["drawing_transient_bytes"]
        row["weights_only"] = {"seconds": alone["seconds"], "weight_bytes": alone["weight_bytes"],
                               "transient_bytes": transient,
                               "transient_parameter": alone["drawing_transient_parameter"],
                               "transient_over_largest_full_matrix": transient / full["largest_full_matrix_fp32_bytes"]}
        rows.append(row)
        print(f"{label:26s} params={row['params'] / 1e6:7.1f}M  {row['seconds']:6.2f} s  peak added "
              f"{row['host_peak_added_bytes'] / 2**20:8.0f} MiB = {row['peak_added_over_buffers']:.2f}x its buffers; "
              f"drawing's transient {transient / 2**20:.0f} MiB = "
              f"{row['weights_only']['transient_over_largest_full_matrix']:.2f}x the largest full matrix "
              f"({full['largest_full_matrix_fp32_bytes'] / 2**20:.0f} MiB fp32)", flush=True)
    if args.json:
        common.write_json(args.json, {"model": model, "device": args.device, "machine": common.machine_info(),
                                      "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
