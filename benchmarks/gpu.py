"""Single-GPU tokens/s and model FLOP utilization of GPT 355M and 1.3B (bf16) with our layers.

Three loops per model, on the same layers (``ModelSpec`` with ``select_kernels('auto', 'cuda')``):

- ``engine_flush_d1``: our ``PipelineRank`` with d = 1 and PipeDream-Flush (what the trainer picks
  at d = 1), bf16 weights and gradients (``accumulate_allreduce_grads_in_fp32=False``; ``--fp32-grads``
  gives the trainer's bf16 default, fp32 gradient accumulation), fp32 master weights and Adam
  moments, global-norm clipping.
- ``engine_2bw_d1``: the same with PipeDream-2BW (two weight versions, one-step-stale gradients).
- ``plain``: a plain loop over the same layer list in pure bf16 (bf16 parameters updated by
  ``torch.optim.AdamW(fused=True)``, no fp32 master): the compute roofline of these layers.

Model FLOPs per step: Megatron-LM's closed form ``72 B s L h^2 (1 + s/6h + V/12Lh)`` with the padded
vocabulary, the function the trainer logs with (``megatron_2bw.config.arith``); MFU = achieved
FLOP/s over the device's dense peak in the run's precision (``peak_tflops_of``: H100/H200 SXM 989,
H100 PCIe 756, H100 NVL 835, A100 312 bf16 TFLOP/s).

A pipeline of two stages on one GPU (two processes sharing it over gloo) would only measure the
transport, so it is not run. On a machine without CUDA this exits 0 after printing
"no CUDA device; skipped" (``--allow-cpu`` runs a tiny model on the CPU to exercise the code).
Runtime on an H200: about 2-3 minutes, most of it building the 1.3B model.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import common

DEFAULT_MICRO = {"gpt-355m": 8, "gpt-1.3b": 4}
SYSTEMS = ("engine_flush_d1", "engine_2bw_d1", "plain")


def flops_per_step(cfg, b: int, m: int) -> float:
    """Model FLOPs of one step of m microbatches of b sequences: the trainer's formula (no recomputation, t = 1)."""
    from megatron_2bw.config.arith import flops_per_step as megatron_flops

    return megatron_flops(cfg, b * m, recompute=False, tensor_parallel=1)


def memory_stats(device) -> dict:
    """The allocator's peaks since the last reset (GiB): ``max_memory_allocated`` and ``max_memory_reserved``."""
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_memory_GiB": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_GiB": torch.cuda.max_memory_reserved(device) / 2**30}


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(spec, cfg, b: int, n: int, device):
    import torch

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (n, b, cfg.seq_length + 1), generator=g)
    return [{k: v.to(device) for k, v in spec.make_batch(t).items()} for t in tokens]


def run_engine(spec, cfg, b: int, m: int, steps: int, warmup: int, dtype: str, device, *, schedule: str = "flush",
               fp32_grads: bool = False) -> dict:
    import torch

    from megatron_2bw.config import OptimizerConfig, PipelineConfig
    from megatron_2bw.parallel_state import ParallelState
    from megatron_2bw.pipeline.build import build_stage

    state = ParallelState.single(device)
    pipe = PipelineConfig(schedule, b, m, recompute=False, track_memory=False)
    opt = OptimizerConfig("adam", lr=1e-4, dtype=dtype, clip_grad=1.0,
                          accumulate_allreduce_grads_in_fp32=True if fp32_grads else None if dtype == "fp32" else False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), state, pipe, opt,
                          (b, cfg.seq_length, cfg.hidden_size))
    build_s = time.perf_counter() - t0
    batches = _batches(spec, cfg, b, 2 * m, device)

    def get_batch(mb):
        return batches[mb % len(batches)]

    first = stage.train(warmup, get_batch, lambda t: 1e-4)
    _sync(device)
    t0 = time.perf_counter()
    res = stage.train(steps, get_batch, lambda t: 1e-4)
    _sync(device)
    dt = time.perf_counter() - t0
    out = dict(seconds=dt, steps=steps, build_s=build_s, last_loss=res[-1].loss,
               first_loss=first[0].loss if first else float("nan"),
               skipped=sum(r.skipped for r in res), grad_dtype=str(stage.opt.grad_dtype).replace("torch.", ""),
               **memory_stats(device))
    del stage
    return out


def run_plain(spec, cfg, b: int, m: int, steps: int, warmup: int, dtype, device) -> dict:
    import torch
    from torch import nn

    from megatron_2bw.models.spec import run_layers

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    layers = nn.ModuleList(spec.build(0, cfg.num_layers + 2)).to(device=device, dtype=dtype)
    build_s = time.perf_counter() - t0
    params = list(layers.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    loss_fn = spec.loss_fn()
    batches = _batches(spec, cfg, b, 2 * m, device)
    loss = None
    first: list[float] = []  # the first step's mean loss
    # pure fp16 has no GradScaler (it unscales fp32 parameters only): a static loss scale, a step
    # skipped when a gradient is not finite
    scale = 1024.0 if dtype == torch.float16 else 1.0

    def step(k):
        nonlocal loss
        total = 0.0
        for i in range(m):
            batch = batches[(k * m + i) % len(batches)]
            loss = loss_fn(run_layers(layers, batch), batch) / m
            (loss * scale).backward()
            if k == 0:
                total += loss.item()
        if k == 0:
            first.append(total)
        grads = [q.grad for q in params if q.grad is not None]
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        if scale == 1.0 or torch.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=True)

    for k in range(warmup):
        step(k)
    _sync(device)
    t0 = time.perf_counter()
    for k in range(steps):
        step(warmup + k)
    _sync(device)
    dt = time.perf_counter() - t0
    return dict(seconds=dt, steps=steps, build_s=build_s, last_loss=loss.item() * m, first_loss=first[0],
                grad_dtype=str(dtype).replace("torch.", ""), **memory_stats(device))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt-355m", "gpt-1.3b"])
    p.add_argument("--micro-batch", type=int, default=0, help="b (default: 8 for 355M, 4 for 1.3B)")
    p.add_argument("--m", type=int, default=4, help="microbatches per step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--fp32-grads", action="store_true",
                   help="engine rows accumulate gradients in fp32 (the trainer's bf16 default) instead of bf16")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--allow-cpu", action="store_true", help="no CUDA: run a tiny fp32 model on the CPU (tests the "
                                                            "script)")
    return p


# (result key, column head, format) of the printed table
COLUMNS = [("model", "model", ""), ("system", "system", ""), ("micro_batch", "b", ""), ("m", "m", ""),
        ("tokens_per_sec", "tokens/s", ".0f"), ("model_tflops_per_sec", "TFLOP/s", ".1f"), ("mfu", "MFU", ".3f"),
        ("peak_memory_GiB", "peak GiB", ".1f"), ("peak_reserved_GiB", "reserved GiB", ".1f"),
        ("grad_dtype", "grads", ""), ("build_s", "build s", ".1f")]


def _measure(spec, model: str, system: str, b: int, args: argparse.Namespace, dtypes: tuple, device, peak) -> dict:
    """One (model, system) row: tokens/s, model TFLOP/s and MFU over the timed steps (or the out-of-memory line)."""
    import torch

    cfg, (dtype_name, dtype) = spec.cfg, dtypes
    tokens_per_step = args.m * b * cfg.seq_length
    fps = flops_per_step(cfg, b, args.m)
    try:
        if system.startswith("engine_"):
            r = run_engine(spec, cfg, b, args.m, args.steps, args.warmup, dtype_name, device,
                           schedule=system.split("_")[1], fp32_grads=args.fp32_grads)
        else:
            r = run_plain(spec, cfg, b, args.m, args.steps, args.warmup, dtype, device)
        tflops = r["steps"] * fps / r["seconds"] / 1e12
        return dict(model=model, system=system, params=cfg.num_parameters(), micro_batch=b, m=args.m,
                    seq=cfg.seq_length, dtype=dtype_name, tokens_per_sec=r["steps"] * tokens_per_step / r["seconds"],
                    model_tflops_per_sec=tflops, mfu=(tflops / peak) if peak else None, **r)
    except torch.cuda.OutOfMemoryError as exc:  # type: ignore[attr-defined]
        return dict(model=model, system=system, error=f"out of memory: {exc}".splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)

    import torch

    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.fused import select_kernels
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.training.log_format import peak_tflops_of

    machine = common.machine_info()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("no CUDA device; skipped")
        common.write_json(args.json, {"skipped": True, "reason": "no CUDA device", "results": [], "machine": machine})
        return 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype_name, dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
    models = args.models if cuda else ["gpt-tiny"]
    kernels = select_kernels("auto", device.type)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = peak_tflops_of(name, dtype_name) if cuda else None  # TFLOP/s
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    results = []
    for model in models:
        cfg = get_preset(model)
        b = args.micro_batch or DEFAULT_MICRO.get(model, 2)
        spec = ModelSpec(cfg, ModelGroups(), 1234, kernels=kernels)
        for system in args.systems:
            row = _measure(spec, model, system, b, args, (dtype_name, dtype), device, peak)
            results.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    print(f"\n{name}: peak {dtype_name} {peak if peak else '-'} TFLOP/s; kernels {kernels.describe()}")
    print(common.table(results, COLUMNS))
    common.write_json(args.json, {
        "skipped": False, "results": results, "machine": dict(machine, device=name, peak_tflops=peak),
        "config": dict(models=models, m=args.m, steps=args.steps, warmup=args.warmup, kernels=kernels.describe(),
                       flops_per_step="72 B s L h^2 (1 + s/6h + V/12Lh), padded V (megatron_2bw.config.arith)",
                       fp32_grads=args.fp32_grads, pipeline_on_one_gpu="not run (two processes on one GPU over gloo "
                                                                       "measures only the transport)"),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
