"""Measure what one microbatch costs in each block on this device; write the planner's profile.

The planner sees a model as ``num_layers`` identical transformer layers, an embedding (first
stage) and a head with the loss (last stage). For each microbatch size ``b`` asked for, this
module builds the embedding, ``chain_layers`` distinct transformer layers (2 by default) and the
head - never the whole model: a 3.8B model profiles on one GPU - and runs a random microbatch
through them the way a pipeline stage does (``block_timing.measure_chain``). Per block:

- ``forward_s`` / ``backward_s``: median of ``reps`` timed repetitions after ``warmup`` untimed
  ones (for the layer: over the repetitions and the chained layers), with the device synchronized
  around each block (``torch.cuda.synchronize`` on CUDA). The forward is the training forward
  (autograd recording); the backward computes the parameter gradients and the gradient of the
  block's input, as a pipeline stage does.
- ``forward_nograd_s``: the same forward under ``torch.no_grad`` - what a stage's first forward
  costs with recomputation on (the engine runs it without autograd, then re-runs it with autograd
  inside the backward).
- ``params``: parameters the block holds on this GPU.
- ``stash_bytes``: bytes of the tensors autograd saves for the backward, measured with the same
  saved-tensor hook the engine uses (``pipeline.accounting.SavedBytes``: each storage once,
  parameters left out). A layer's stash includes its input (its first LayerNorm saves it). The
  embedding's excludes the token ids, which the memory model counts as the embedding's
  ``input_bytes`` (``memory_model.edge_activation_bytes``).
- with recomputation a stage keeps only its input per microbatch: ``input_bytes`` of its first
  block (what ``recompute_stash_bytes`` records in the extras).
- ``input_bytes`` / ``output_bytes``: the tensors crossing the block's boundaries.
- ``workspace_bytes``: on CUDA, the allocator's peak during the block's backward above what was
  allocated before it (the stash included in the latter); elsewhere an estimate (the stash again:
  the gradients of the activations live while the backward runs), flagged as such in the extras.

The optimizer step is timed too (``optimizer``): the engine's own update path
(``pipeline.updater.Updater``) over a flat buffer at two sizes, fitted as
``fixed_s + per_param_s * params``.

Output: ``LayerCosts`` (what ``search``/``plan.py --profile`` read) inside a
:class:`~.profile_file.Profile` that also keeps these extras (``profile_file``). Tensor-parallel
sizes ``t > 1`` run on ``t`` processes (:func:`profile_tensor_parallel`) and their times include
the tensor-parallel all-reduces.
"""

from __future__ import annotations

import platform
import time
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from ..config import ModelConfig, OptimizerConfig
from ..config.precision import precision_of
from ..config.presets import get_preset
from ..errors import ConfigError
from ..models.bert import random_samples
from ..models.groups import ModelGroups
from ..models.spec import ModelSpec
from ..tensor_parallel.group import TPGroup
from .block_timing import BlockMeasurement, measure_chain, median, resolve_device, synchronize, unique_params  # noqa: F401 - re-exported: the profiler's public names
from .profile_file import (  # noqa: F401 - re-exported: the profiler's public names
    BLOCKS,
    LoadedProfile,
    MicrobatchProfile,
    OptimizerCost,
    Profile,
    load_full_profile,
    merge_profiles,
)


def sample_batch(spec: ModelSpec, b: int, device: torch.device, generator: torch.Generator) -> dict:
    """A random microbatch of ``b`` samples in the layout ``ModelSpec.make_batch`` produces."""
    cfg = spec.cfg
    if cfg.kind == "gpt":  # stays: the sample format is the dataset's (data/build.py), chosen by kind
        sample = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=generator)
    else:
        sample = random_samples(b, cfg.seq_length, cfg.vocab_size, generator)
    batch = spec.make_batch(sample)
    return {k: (t.to(device) if isinstance(t, torch.Tensor) else t) for k, t in batch.items()}


def _model(model: ModelConfig | str) -> ModelConfig:
    return get_preset(model) if isinstance(model, str) else model


def profile_microbatch(
    spec: ModelSpec, b: int, device: torch.device, dtype: torch.dtype, *, warmup: int = 2, reps: int = 5,
    blocks: tuple[list[nn.Module], list[nn.Module]] | None = None, seed: int = 1234, chain_layers: int = 2,
) -> MicrobatchProfile:
    """Measure embedding, transformer layers and head (with the loss) at microbatch size ``b``."""
    if blocks is None:
        blocks = build_blocks(spec, device, dtype, chain_layers)
    front, (head,) = blocks
    emb, layers = front[0], front[1:]
    gen = torch.Generator().manual_seed(seed + b)
    batch = sample_batch(spec, b, device, gen)
    m_emb, m_layer, m_head = measure_chain(emb, layers, head, spec.loss_fn(), batch, device, warmup=warmup, reps=reps)
    word = getattr(getattr(emb, "word", None), "weight", None)
    return MicrobatchProfile(spec.tp.size, b, m_emb, m_layer, m_head, word.numel() if word is not None else 0)


def build_blocks(spec: ModelSpec, device: torch.device, dtype: torch.dtype, chain_layers: int = 2):
    """([embedding, first ``chain_layers`` transformer layers], [head]) on ``device`` in ``dtype``,
    in training mode; never the whole model."""
    L = spec.cfg.num_layers
    k = max(1, min(chain_layers, L))
    front = nn.ModuleList(spec.build(0, 1 + k)).to(device=device, dtype=dtype).train()
    back = nn.ModuleList(spec.build(L + 1, L + 2)).to(device=device, dtype=dtype).train()
    return (list(front), list(back))


def _update_stage(n: int, params_per_view: int, dtype: torch.dtype, device: torch.device,
                  grad_dtype: torch.dtype | None = None):
    """An :class:`~..pipeline.updater.Updater` over ``n`` parameters in views of ``params_per_view``
    (the first half matrices, which weight decay applies to), two weight versions as in 2BW, with
    gradient buffers in ``grad_dtype`` (the training run's: fp32 by default with bf16)."""
    from ..pipeline.weights import RankWeights  # noqa: PLC0415

    sizes = [min(params_per_view, n - o) for o in range(0, n, params_per_view)]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) * 0.02 for s in sizes]
    params = [p.view(1, -1) if i < len(sizes) // 2 else p for i, p in enumerate(params)]
    module = nn.ParameterList([nn.Parameter(p) for p in params])
    return RankWeights(lambda: [module], num_versions=2, dtype=dtype, device=device, grad_dtype=grad_dtype)


def profile_optimizer(
    num_params: Sequence[int] = (1 << 18, 1 << 21), device: torch.device | str = "cpu", dtype: str = "fp32",
    *, warmup: int = 2, reps: int = 5, params_per_view: int = 1 << 16,
) -> OptimizerCost:
    """Time the engine's update path (``Updater.step_alone``: gradient norm over per-parameter views,
    unscale, clipping, AdamW, master copy, zeroing the gradient) on ``num_params`` parameters of
    two sizes and fit ``fixed_s + per_param_s * n``."""
    from ..pipeline.updater import Updater  # noqa: PLC0415

    device = resolve_device(device)
    opt = OptimizerConfig(dtype=dtype)
    times = []
    for n in num_params:
        weights = _update_stage(n, params_per_view, opt.torch_dtype, device, opt.torch_grad_dtype)
        updater = Updater(weights, opt)
        samples = []
        for step in range(warmup + reps):
            weights.grad_flat[weights.grad_buffer(step)].normal_().mul_(1e-3)
            synchronize(device)
            t0 = time.perf_counter()
            updater.step_alone(step, 1e-4)
            synchronize(device)
            if step >= warmup:
                samples.append(time.perf_counter() - t0)
        times.append(median(samples))
    return _fit_linear(num_params, times)


def _fit_linear(num_params: Sequence[int], times: Sequence[float]) -> OptimizerCost:
    """``fixed_s + per_param_s * n`` through the first and last (size, time) points, never negative."""
    (n0, n1), (s0, s1) = (num_params[0], num_params[-1]), (times[0], times[-1])
    per = max((s1 - s0) / (n1 - n0), 0.0) if n1 != n0 else s1 / n1
    return OptimizerCost(fixed_s=max(s0 - per * n0, 0.0), per_param_s=per)


def _check_request(dtype: str, micro_batch_sizes: Iterable[int], warmup: int,
                   reps: int) -> tuple[torch.dtype, list[int]]:
    """The torch dtype and the sorted distinct microbatch sizes of a request; ConfigError if it is invalid."""
    tdtype = OptimizerConfig(dtype=dtype).torch_dtype
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"micro batch sizes must be positive, got {list(micro_batch_sizes)}")
    if reps < 1 or warmup < 0:
        raise ConfigError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    return tdtype, sizes


def _describe_run(prof: Profile, dev: torch.device, dtype: str, tp: TPGroup, kernels, chain_layers: int,
                  warmup: int, reps: int, source: str | None) -> None:
    """Fill ``prof.meta`` and ``prof.source`` with where and how the profile was measured."""
    devname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    prof.meta = {
        "device": devname, "device_type": dev.type, "torch": torch.__version__, "dtype": dtype,
        "threads": torch.get_num_threads(), "warmup": warmup, "reps": reps, "tensor_parallel": tp.size,
        "chain_layers": chain_layers,
        "kernels": getattr(kernels, "describe", lambda: str(kernels))(), "host": platform.node(),
    }
    prof.source = source or (f"measured on {devname} ({dev.type}, {dtype}, torch {torch.__version__}, "
                             f"{torch.get_num_threads()} threads), median of {reps} after {warmup} warm-up")


def _measure_sizes(prof: Profile, spec: ModelSpec, blocks, sizes: list[int], dev: torch.device, tdtype: torch.dtype,
                   skip_oom: bool, log: Callable[[str], None] | None, **kw) -> None:
    """One entry of ``prof`` per microbatch size; with ``skip_oom``, stop at the first that runs out of memory."""
    tp = spec.tp
    for b in sizes:
        start = time.perf_counter()
        try:
            prof.entries[(tp.size, b)] = profile_microbatch(spec, b, dev, tdtype, blocks=blocks, **kw)
        except torch.cuda.OutOfMemoryError:
            if not skip_oom or not prof.entries:
                raise
            for p in unique_params(blocks[0] + blocks[1]):
                p.grad = None
            torch.cuda.empty_cache()
            if log:
                log(f"b={b}: out of memory; profiled microbatch sizes up to {max(k[1] for k in prof.entries)}")
            break
        if log:
            e = prof.entries[(tp.size, b)]
            log(f"b={b}: layer fwd {e.layer.forward_s * 1e3:.3f} ms bwd {e.layer.backward_s * 1e3:.3f} ms, "
                f"stash {e.layer.stash_bytes / 2**20:.2f} MiB ({time.perf_counter() - start:.1f} s)")


def profile_model(
    model: ModelConfig | str, micro_batch_sizes: Iterable[int] = (1, 2, 4), *, device: str | torch.device | None = None,
    dtype: str = "fp32", tp: TPGroup | None = None, warmup: int = 2, reps: int = 5, seed: int = 1234,
    optimizer: bool = True, kernels=None, source: str | None = None, log: Callable[[str], None] | None = None,
    skip_oom: bool = False, chain_layers: int = 2,
) -> Profile:
    """Profile ``model`` (a preset name or a ``ModelConfig``) on ``device`` (default: the current one)
    at every microbatch size of ``micro_batch_sizes``.

    ``tp``: a tensor-parallel group already initialized (run the same call on every rank of it);
    the blocks are built sharded and the measured times include the tensor-parallel all-reduces.
    ``skip_oom``: on CUDA, stop at the first microbatch size that runs out of memory (the sizes
    measured so far are kept; none at all is an error).
    ``chain_layers``: distinct transformer layers run in sequence per repetition (see
    :func:`measure_chain`); the layer's numbers are the median over them.
    """
    cfg = _model(model)
    tdtype, sizes = _check_request(dtype, micro_batch_sizes, warmup, reps)
    dev = resolve_device(device)
    tp = tp or TPGroup()
    if kernels is None:
        from ..fused import select_kernels  # noqa: PLC0415

        kernels = select_kernels("auto", dev.type)
    spec = ModelSpec(cfg, ModelGroups(tp), seed, kernels=kernels, precision=precision_of(dtype))
    torch.manual_seed(seed)
    blocks = build_blocks(spec, dev, tdtype, chain_layers)
    prof = Profile(cfg)
    _measure_sizes(prof, spec, blocks, sizes, dev, tdtype, skip_oom, log,
                   warmup=warmup, reps=reps, seed=seed, chain_layers=chain_layers)
    if optimizer:
        layer_params = next(iter(prof.entries.values())).layer.params
        shapes = (max(layer_params // 4, 1 << 12), max(2 * layer_params, 1 << 14))
        prof.optimizer = profile_optimizer(shapes, dev, dtype, warmup=warmup, reps=reps)
    _describe_run(prof, dev, dtype, tp, kernels, len(blocks[0]) - 1, warmup, reps, source)
    return prof


# ---- tensor-parallel sizes: one process per device ----------------------------------------------

def _tp_worker(device_type: str, threads: int, kwargs: dict) -> Profile | None:
    """One rank of a tensor-parallel profile (inside ``run_workers``); rank 0 returns the profile."""
    import torch.distributed as dist  # noqa: PLC0415

    from ..parallel_state import Axes, build_state  # noqa: PLC0415

    rank, t = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, threads))
        device = torch.device("cpu")
    state = build_state(Axes(tensor=t), device)
    prof = profile_model(tp=TPGroup.from_state(state), device=device, **kwargs)
    return prof if rank == 0 else None


def profile_tensor_parallel(
    model: ModelConfig | str, t: int, micro_batch_sizes: Iterable[int] = (1, 2, 4), *, device_type: str | None = None,
    timeout_s: float = 1800.0, threads: int = 1, **kwargs,
) -> Profile:
    """Profile at tensor-parallel size ``t`` with ``t`` local processes (one GPU each on CUDA, gloo
    processes of ``threads`` threads on a CPU); keyword arguments as :func:`profile_model`."""
    from ..local_workers import run_workers  # noqa: PLC0415

    cfg = _model(model)
    if t < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {t}")
    cfg.check_tensor_parallel(t)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and torch.cuda.device_count() < t:
        raise ConfigError(f"profiling t={t} needs {t} GPUs on this node, found {torch.cuda.device_count()}")
    kw = dict(kwargs, model=cfg, micro_batch_sizes=tuple(micro_batch_sizes))
    results = run_workers(_tp_worker, t, device_type, threads, kw, timeout=timeout_s, pg_timeout=600.0,
                          backend="nccl" if device_type == "cuda" else "gloo")
    return results[0]
