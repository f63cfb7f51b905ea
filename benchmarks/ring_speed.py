"""The ``p2p`` ring on fused kernels against the written-out core, side by side in one run (issue 44).

``c`` gloo processes each build the same 2-layer GPT stack (``TransformerLayer``s, the ring as their core,
hidden 128, 4 heads of 32) and time one training step of its layers: forward and backward of one
microbatch of ``--seq`` tokens, ``s / c`` per rank. Paths, each timed on the same processes in turn:

- ``kernel``: the ring's blocks on the kernel that returns the log-sum-exp (``context_parallel/blocks.py``;
  on the CPU ``aten._scaled_dot_product_flash_attention_for_cpu``);
- ``unfused``: the written-out fp32 core in whole ``n x n`` blocks, as the ring ran before it had kernels
  (``--attention-backend unfused`` with the tile as large as the block);
- ``unfused-tiled`` (``--tiled``): the written-out core in tiles of ``blocks.TILE_ROWS`` query rows.

Each row: the slowest rank's step time (median of ``--reps``), the speed-up over ``unfused`` and the largest
difference of the layers' output from the ``kernel`` path's (fp32: rounding only). Default: s = 4096,
c = 2 (seconds); the issue's 16k: ``--seq 16384`` (minutes: the unfused path takes about a minute a step).
"""

from __future__ import annotations

import argparse
import sys
import time

import common

HIDDEN, HEADS, LAYERS = 128, 4, 2


def _paths(tiled: bool) -> list[tuple[str, str, int | None]]:
    """(name, --attention-backend, tile rows; None: the default, 0: the whole block)."""
    paths = [("kernel", "auto", None), ("unfused", "unfused", 0)]
    return paths + ([("unfused-tiled", "unfused", None)] if tiled else [])


def worker(seq: int, reps: int, tiled: bool) -> list[dict]:
    """One rank: each path's step times and its output (rank-local), for the parent to compare."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.context_parallel import blocks
    from megatron_2bw.context_parallel.group import CPGroup
    from megatron_2bw.fused import Kernels
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.transformer import TransformerLayer

    c, rank = dist.get_world_size(), dist.get_rank()
    cp = CPGroup(dist.new_group(list(range(c))), rank, c, "p2p", tuple(range(c)))
    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=seq,
                      max_position_embeddings=seq, vocab_size=512, hidden_dropout=0.0, attention_dropout=0.0)
    x0 = torch.randn(1, seq // c, HIDDEN, generator=torch.Generator().manual_seed(rank))
    default_rows, out = blocks.TILE_ROWS, []
    for name, backend, rows in _paths(tiled):
        torch.manual_seed(0)
        layers = [TransformerLayer(cfg, ModelGroups(cp=cp), 1234, i, causal=True, kernels=Kernels(attention=backend))
                  for i in range(LAYERS)]
        blocks.TILE_ROWS = default_rows if rows is None else (rows or seq)
        times, y = [], None
        for _ in range(reps):
            x = x0.clone().requires_grad_(True)
            dist.barrier()
            t0 = time.perf_counter()
            h = x
            for layer in layers:
                h = layer(h, {})
            h.square().mean().backward()
            times.append(time.perf_counter() - t0)
            y = h.detach()
        out.append({"path": name, "backend": backend, "tile_rows": blocks.TILE_ROWS, "step_s": times, "out": y})
    blocks.TILE_ROWS = default_rows
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (the issue's: 16384)")
    p.add_argument("--c", type=int, default=2, help="context-parallel size (processes)")
    p.add_argument("--reps", type=int, default=1, help="steps timed per path (the median is reported)")
    p.add_argument("--tiled", action="store_true", help="also the written-out core in tiles")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.seq % (2 * args.c):
        sys.exit(f"error: --seq {args.seq} is not divisible by 2 x --c {args.c}")
    ranks = common.spawn(worker, args.c, args.seq, args.reps, args.tiled, timeout=3600.0)
    rows = []
    for k, (name, backend, _) in enumerate(_paths(args.tiled)):
        step = max(common.median(r[k]["step_s"]) for r in ranks)
        diff = max(float((r[k]["out"] - r[0]["out"]).abs().max()) for r in ranks)
        rows.append({"path": name, "backend": backend, "tile_rows": ranks[0][k]["tile_rows"], "step_s": step,
                     "max_abs_diff_vs_kernel": diff})
    base = next(r["step_s"] for r in rows if r["path"] == "unfused")
    for r in rows:
        r["speedup_vs_unfused"] = base / r["step_s"]
    print(common.table(rows, [("path", "path", ""), ("tile_rows", "tile rows", ""), ("step_s", "step s", ".2f"),
                              ("speedup_vs_unfused", "x unfused", ".1f"),
                              ("max_abs_diff_vs_kernel", "max |diff|", ".1e")]))
    result = {"benchmark": "ring_speed", "seq": args.seq, "c": args.c, "layers": LAYERS, "hidden": HIDDEN,
              "heads": HEADS, "reps": args.reps, "machine": common.machine_info(), "rows": rows}
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
