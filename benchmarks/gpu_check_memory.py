"""gpu_check's checkpoint-memory rows: the device bytes a save and a resume allocate beyond training's (their own
module so gpu_check.py keeps the size rules)."""

from __future__ import annotations

import functools
import gc
import tempfile

import gpu
from gpu_check import FAIL, NEEDS_GPU, PASS, SAVE_EXTRA_FRACTION, _row, _sync


def _extra_device_bytes(fn, device) -> int | None:
    """The device bytes ``fn`` allocates at its peak beyond what was allocated before (None off CUDA: it only runs)."""
    import torch

    _sync(device)
    if device.type != "cuda":
        fn()
        return None
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def _checkpoint_rows(what: str, same: bool, extras: dict[str, int | None], weight_bytes: int) -> list[dict]:
    """The bitwise resume's row, then the save's and the resume's extra device bytes against the limit."""
    rows = [_row(f"checkpoint resume {what}", PASS if same else FAIL,
                 "resumed weights == saved (bitwise)" if same else "resumed weights differ from the saved ones")]
    for step, extra in extras.items():
        name = f"checkpoint {step} device memory {what}"
        if extra is None:
            rows.append(_row(name, NEEDS_GPU, "device bytes are measured by the CUDA allocator (the code ran)"))
            continue
        ok = extra <= SAVE_EXTRA_FRACTION * weight_bytes
        rows.append(_row(name, PASS if ok else FAIL, f"+{extra / 2**20:.1f} MiB over training's allocation "
                         f"({extra / weight_bytes:.2f} x the weight bytes; limit {SAVE_EXTRA_FRACTION})",
                         extra_device_MiB=extra / 2**20, weight_MiB=weight_bytes / 2**20))
    return rows


def check_checkpoint_memory(device, dtype: str, kernels) -> list[dict]:
    """The device bytes a save and a resume allocate beyond training's, and a bitwise resume."""
    import torch

    from megatron_2bw.checkpoint import checkpointing as ck
    from megatron_2bw.checkpoint.names import WORD
    from megatron_2bw.config import OptimizerConfig, PipelineConfig
    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import ParallelState
    from megatron_2bw.pipeline.build import build_stage
    from megatron_2bw.pipeline.weights import GlobalNames
    from megatron_2bw.tensor_parallel.random import RNGTracker

    model = "gpt-355m" if device.type == "cuda" else "gpt-tiny"
    cfg = get_preset(model)
    b, m = 2, 2
    state = ParallelState.single(device)

    def build():
        tracker = RNGTracker(1234, 0, device)
        spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker, kernels=kernels)
        return build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), state,
                           PipelineConfig("2bw", b, m, track_memory=False),
                           OptimizerConfig("adam", lr=1e-4, dtype=dtype), (b, cfg.seq_length, cfg.hidden_size),
                           rng_tracker=tracker, names=GlobalNames(0, tied=WORD)), spec

    stage, spec = build()
    batches = gpu._batches(spec, cfg, b, 2 * m, device)
    stage.train(2, lambda mb: batches[mb % len(batches)], lambda t: 1e-4)
    weight_bytes = sum(f.numel() * f.element_size() for f in stage.weights.flat)
    cuda = device.type == "cuda"
    measure = functools.partial(_extra_device_bytes, device=device)
    with tempfile.TemporaryDirectory() as root:
        config = {"model": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "optimizer": {},
                  "pipeline": {"layer_split": None}}

        def save():
            ck.save(root, 2, state, lambda: ck.payload(stage, iteration=2, tracker=stage.rng,
                                                       consumed_samples=2 * b * m, global_batch=b * m, config=config,
                                                       args={"micro_batch_size": b}))

        save_extra = measure(save)
        saved = [f.detach().cpu().clone() for f in stage.weights.flat]
        stage = None  # freed (``save`` reads it through its cell)
        gc.collect()
        fresh, _ = build()
        resume_extra = measure(lambda: ck.restore(ck.load_rank_file(root, 2, 1, 1, 0, 0), fresh, fresh.rng, device))
        same = all(torch.equal(a, f.detach().cpu()) for a, f in zip(saved, fresh.weights.flat, strict=False))
    rows = _checkpoint_rows(f"{model} {dtype}", same, {"save": save_extra, "resume": resume_extra}, weight_bytes)
    fresh = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ d = 2 over NCCL
