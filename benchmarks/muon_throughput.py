"""What Muon costs on CPU: its update and its 2BW training step against AdamW's, and the TP gather.

Three measurements, side by side (gloo, one torch thread per process):

1. ``update``: one optimizer update (``Updater.step_alone``: norm, unscale, the optimizer, the copy
   into the version buffer) of each stage of a d = 2 split of ``--preset`` (gpt-demo), AdamW vs Muon,
   median of ``--reps`` (single process, one stage at a time).
2. ``step``: the 2BW training step at d = 2 (2 processes, the real engine), AdamW vs Muon, median
   step time over ``--rounds`` rounds of ``--steps`` steps.
3. ``tp``: at t = 2 (2 processes) the Muon work of one whole layer's four matrices split as
   Megatron splits them, three ways: ``gather`` (what ``--optimizer muon`` does: one all-gather of the
   split directions, then every rank orthogonalizes the whole matrices), ``distributed`` (the
   alternative: each Newton-Schulz iteration all-reduces the partial Gram matrices X_r X_r^T of the
   split along the long dimension, and each rank multiplies only its slice), and ``local`` (the
   unsplit orthogonalization on one process, t = 1, for reference); ``allgather_only`` is the
   collective alone.

    python benchmarks/muon_throughput.py [--json docs/data/muon_throughput.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import common
import torch
import torch.distributed as dist

from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.config.presets import get_preset
from megatron_2bw.local_workers import run_workers
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.optimizer.muon import NS_COEFFICIENTS, NS_EPS, zeropower_via_newtonschulz
from megatron_2bw.parallel_state import ParallelState, build_state
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.updater import Updater
from megatron_2bw.pipeline.weights import RankWeights

OPTIMIZERS = ("adam", "muon")


def _opt(name: str) -> OptimizerConfig:
    return OptimizerConfig(name, lr=1e-3, muon_lr=2e-2)


def update_times(preset: str, seq: int, reps: int) -> list[dict]:
    cfg = get_preset(preset, seq_length=seq, max_position_embeddings=seq)
    spec = ModelSpec(cfg, ModelGroups(), 1)
    rows = []
    for stage in range(2):
        for name in OPTIMIZERS:
            w = RankWeights(lambda: spec.build_stage(2, stage), num_versions=2, dtype=torch.float32,  # noqa: B023
                             device=torch.device("cpu"))
            upd = Updater(w, _opt(name))
            g = torch.Generator().manual_seed(0)
            times = []
            for t in range(reps + 2):
                w.grad_flat[w.grad_buffer(t)].copy_(torch.randn(w.numel, generator=g) * 1e-3)
                t0 = time.perf_counter()
                upd.step_alone(t, 1e-3)
                if t >= 2:
                    times.append(time.perf_counter() - t0)
            muon_share = sum(n for n, d in zip(w.sizes, w.partition_dims, strict=False) if d is not None) / w.numel
            rows.append({"stage": stage, "optimizer": name, "params": w.numel, "update_s": statistics.median(times),
                         "state_bytes": upd.state_bytes, "muon_param_share": muon_share})
    return rows


def _step_worker(preset: str, seq: int, b: int, m: int, steps: int) -> dict:
    state = build_state(Axes(pipeline=2), torch.device("cpu"))
    cfg = get_preset(preset, seq_length=seq, max_position_embeddings=seq)
    spec = ModelSpec(cfg, ModelGroups(), seed=1)
    data = torch.randint(0, cfg.vocab_size, (m, b, seq + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in OPTIMIZERS:
        stage = build_stage(lambda: spec.build_stage(2, state.pp_rank), spec.loss_fn(), state,
                              PipelineConfig("2bw", b, m, track_memory=False), _opt(name), (b, seq, cfg.hidden_size))
        get_batch = lambda mb: spec.make_batch(data[mb % m])  # noqa: E731
        stage.train(1, get_batch, lambda t: 1e-3)  # warm-up
        t0 = time.perf_counter()
        stage.train(steps, get_batch, lambda t: 1e-3)
        out[name] = (time.perf_counter() - t0) / steps
    return out


def _distributed_ns(x_r: torch.Tensor, split_long: int, group, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz on a matrix split along its long dimension over ``group``: this rank's slice of the
    result (X oriented wide, m <= n, split along n: X X^T = sum_r X_r X_r^T, all-reduced each iteration)."""
    a, b, c = NS_COEFFICIENTS
    x = x_r.bfloat16()
    if split_long == 0:  # rows are the long dimension: work on the transpose
        x = x.T
    sq = x.float().square().sum().reshape(1)
    dist.all_reduce(sq, group=group)
    x = x / sq.sqrt().clamp(min=NS_EPS).bfloat16()
    for _ in range(steps):
        gram = (x @ x.T).float()
        dist.all_reduce(gram, group=group)
        gram = gram.bfloat16()
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if split_long == 0 else x


def _layer(h: int) -> list[tuple[tuple[int, int], int]]:
    """One transformer layer's Muon matrices (whole shape, Megatron's split dimension)."""
    return [((3 * h, h), 0), ((h, h), 1), ((4 * h, h), 0), ((h, 4 * h), 1)]


def _tp_worker(h: int, reps: int) -> dict:
    state: ParallelState = build_state(Axes(tensor=2), torch.device("cpu"))
    g, r = state.groups.tp, state.tp_rank
    gen = torch.Generator().manual_seed(0)
    whole = [(torch.randn(*s, generator=gen), d) for s, d in _layer(h)]
    parts = [(x.chunk(2, dim=d)[r].contiguous(), d) for x, d in whole]

    def gather():
        packed = torch.cat([p.reshape(-1) for p, _ in parts])
        out = packed.new_empty(2 * packed.numel())
        dist.all_gather_into_tensor(out, packed, group=g)
        ranks, o, res = out.view(2, -1), 0, []
        for p, d in parts:
            full = torch.cat([ranks[k, o:o + p.numel()].view(p.shape) for k in range(2)], dim=d)
            res.append(zeropower_via_newtonschulz(full, 5).chunk(2, dim=d)[r])
            o += p.numel()
        return res

    def allgather_only():
        packed = torch.cat([p.reshape(-1) for p, _ in parts])
        out = packed.new_empty(2 * packed.numel())
        dist.all_gather_into_tensor(out, packed, group=g)

    def distributed():
        # Megatron's splits are along the long dimension here, where the partial Gram sum works
        return [_distributed_ns(p, d, g) for p, d in parts]

    def local():
        return [zeropower_via_newtonschulz(x, 5) for x, _ in whole]

    out = {}
    for name, fn in (("gather", gather), ("distributed", distributed), ("allgather_only", allgather_only),
                     ("local", local)):
        fn()
        times = []
        for _ in range(reps):
            dist.barrier(group=g)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    # the two ways agree to bf16 precision (the distributed one rounds the Gram sum in another order)
    a, b = gather(), distributed()
    out["max_rel_diff_gather_vs_distributed"] = max(((x - y).abs().max() / x.abs().max()).item()
                                                    for x, y in zip(a, b, strict=False))
    elems = sum(p.numel() for p, _ in parts)
    out["gather_elements"] = elems
    out["distributed_allreduce_elements"] = sum(5 * min(x.shape) ** 2 + 1 for x, _ in whole)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-demo")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = get_preset(args.preset)
    upd = update_times(args.preset, args.seq, args.reps)
    for row in upd:
        print(f"update stage {row['stage']} {row['optimizer']:5s}: {row['update_s'] * 1e3:8.1f} ms "
              f"({row['params']} params, {row['muon_param_share']:.2f} in Muon matrices, state {row['state_bytes']} B)")
    rounds = [run_workers(_step_worker, 2, args.preset, args.seq, args.micro_batch, args.m, args.steps, timeout=900,
                          start_method=common.START_METHOD) for _ in range(args.rounds)]
    step = {o: [statistics.median(rd[k][o] for rd in rounds) for k in range(2)] for o in OPTIMIZERS}
    for o in OPTIMIZERS:
        print(f"2bw step d=2 {o:5s}: {max(step[o]) * 1e3:.1f} ms (stages {[round(x * 1e3, 1) for x in step[o]]})")
    tp = run_workers(_tp_worker, 2, cfg.hidden_size, args.reps, timeout=900, start_method=common.START_METHOD)
    tp_med = {k: statistics.median(r[k] for r in tp) for k in tp[0]}
    print(f"t=2, one layer's matrices (h={cfg.hidden_size}): gather+NS {tp_med['gather'] * 1e3:.1f} ms, distributed NS "
          f"{tp_med['distributed'] * 1e3:.1f} ms, all-gather alone {tp_med['allgather_only'] * 1e3:.2f} ms, unsplit NS "
          f"on one process {tp_med['local'] * 1e3:.1f} ms")
    ratio = {s: next(r["update_s"] for r in upd if r["stage"] == s and r["optimizer"] == "muon")
             / next(r["update_s"] for r in upd if r["stage"] == s and r["optimizer"] == "adam") for s in range(2)}
    common.write_json(args.json, {
        "config": {"preset": args.preset, "seq": args.seq, "d": 2, "micro_batch": args.micro_batch, "m": args.m,
                   "reps": args.reps, "steps": args.steps, "rounds": args.rounds, "threads_per_process": 1},
        "update": upd, "update_ratio_muon_over_adam": ratio,
        "step_s_2bw_d2": {o: max(v) for o, v in step.items()}, "step_s_per_stage": step,
        "step_ratio_muon_over_adam": max(step["muon"]) / max(step["adam"]),
        "tp2_one_layer": tp_med, "machine": common.machine_info(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
