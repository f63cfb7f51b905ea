"""Measure what one microbatch costs in each block on this device; write the planner's profile.

The planner sees a model as ``num_layers`` identical transformer layers, an embedding (first
stage) and a head with the loss (last stage). For each microbatch size ``b`` asked for, this
module builds the embedding, ``chain_layers`` distinct transformer layers (2 by default) and the
head - never the whole model: a 3.8B model profiles on one GPU - and runs a random microbatch
through them the way a pipeline stage does: forward block after block, then the backward in
reverse, each block's time taken on its own (the blocks are cut apart with ``detach``). Running
distinct blocks in sequence matters: a block timed alone in a loop finds its weights and buffers
still in cache (on a CPU the head with its loss ran 40% faster alone than after two layers).
Per block:

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

The optimizer step is timed too (``optimizer``): the engine's update path over a flat buffer -
the gradient norm over per-parameter views, the unscale, the AdamW update, zeroing the
gradient - at two buffer sizes, fitted as ``fixed_s + per_param_s * params``.

Output: ``LayerCosts`` (what ``search``/``plan.py --profile`` read) inside a :class:`Profile`
that also keeps these extras. ``Profile.to_json`` writes the ``megatron_2bw-profile-v1`` schema
of ``layer_costs.py`` plus entry-level keys that ``layer_costs.load_profile`` ignores
(``measured``) and top-level ``meta`` / ``optimizer`` / ``model``; :func:`load_full_profile`
reads them back. Tensor-parallel sizes ``t > 1`` run on ``t`` processes
(:func:`profile_tensor_parallel`) and their times include the tensor-parallel all-reduces.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..models.presets import get_preset
from ..models.spec import ModelSpec
from ..pipeline.accounting import SavedBytes
from ..tensor_parallel.group import TPGroup
from .layer_costs import BlockCost, LayerCosts, MicrobatchCosts, layer_costs_from_json, read_profile_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCKS = ("embedding", "layer", "head")


# ---- small helpers ------------------------------------------------------------------------------

def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means the current device: CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 0


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def sample_batch(spec: ModelSpec, b: int, device: torch.device, generator: torch.Generator) -> dict:
    """A random microbatch of ``b`` samples in the layout ``ModelSpec.make_batch`` produces."""
    cfg = spec.cfg
    s, v = cfg.seq_length, cfg.vocab_size
    if cfg.kind == "gpt":
        sample = torch.randint(0, v, (b, s + 1), generator=generator)
    else:
        sample = dict(
            tokens=torch.randint(0, v, (b, s), generator=generator),
            token_types=(torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
            labels=torch.randint(0, v, (b, s), generator=generator),
            loss_mask=(torch.rand(b, s, generator=generator) < 0.15).float(),
            padding_mask=torch.ones(b, s),
            sop_label=torch.randint(0, 2, (b,), generator=generator),
        )
    batch = spec.make_batch(sample)
    return {k: (t.to(device) if isinstance(t, torch.Tensor) else t) for k, t in batch.items()}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


# ---- one block ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockMeasurement:
    """Everything measured for one block at one microbatch size (times in seconds, sizes in bytes)."""

    forward_s: float
    backward_s: float
    forward_nograd_s: float
    params: int
    stash_bytes: int
    input_bytes: int
    output_bytes: int
    workspace_bytes: int
    workspace_measured: bool
    forward_samples: tuple[float, ...] = ()
    backward_samples: tuple[float, ...] = ()

    def block_cost(self) -> BlockCost:
        """The planner's view of the block (``layer_costs.BlockCost``); a profiler at ``t > 1`` times
        the tensor-parallel all-reduces inside ``forward_s``/``backward_s``, so none are added."""
        return BlockCost(forward_s=self.forward_s, backward_s=self.backward_s, params=self.params,
                         stash_bytes=self.stash_bytes, input_bytes=self.input_bytes, output_bytes=self.output_bytes,
                         workspace_bytes=self.workspace_bytes)

    @property
    def recompute_stash_bytes(self) -> int:
        """What the block keeps per microbatch with recomputation: its input (token ids are batch data)."""
        return self.input_bytes

    def extras(self) -> dict[str, Any]:
        return {"forward_nograd_s": self.forward_nograd_s, "recompute_stash_bytes": self.recompute_stash_bytes,
                "workspace_measured": self.workspace_measured,
                "forward_samples_s": list(self.forward_samples), "backward_samples_s": list(self.backward_samples)}


class _Samples:
    """Per-block timing samples and the last measured sizes."""

    def __init__(self) -> None:
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.nograd: list[float] = []
        self.stash = self.input = self.output = 0
        self.workspace = 0

    def result(self, params: int, workspace_measured: bool) -> BlockMeasurement:
        return BlockMeasurement(
            forward_s=median(self.fwd), backward_s=median(self.bwd), forward_nograd_s=median(self.nograd),
            params=params, stash_bytes=self.stash, input_bytes=self.input, output_bytes=self.output,
            workspace_bytes=int(self.workspace) if workspace_measured else self.stash,
            workspace_measured=workspace_measured, forward_samples=tuple(self.fwd), backward_samples=tuple(self.bwd),
        )


def measure_chain(
    emb: nn.Module, layers: Sequence[nn.Module], head: nn.Module, loss_fn: Callable, batch: dict,
    device: torch.device, *, warmup: int = 2, reps: int = 5,
) -> tuple[BlockMeasurement, BlockMeasurement, BlockMeasurement]:
    """Time and size the blocks the way a pipeline stage runs them: one microbatch through the
    embedding, ``len(layers)`` distinct transformer layers and the head with the loss, then the
    backward in reverse, each block timed on its own (cut at its boundaries with ``detach``, so a
    block's backward is exactly its own). Running the distinct blocks in sequence keeps each from
    finding its weights and buffers still in cache from its previous repetition, which a block
    timed alone in a loop would (measured on a CPU: the head and loss 40% faster alone).
    Per transformer layer: the median over the layers and the repetitions. Also: the forward
    without autograd (what recomputation runs first), and on CUDA each backward's peak above what
    was allocated before it."""
    cuda = device.type == "cuda"
    emb_s, lay_s, head_s = _Samples(), _Samples(), _Samples()
    excl_params = _storages(_unique_params([emb, *layers, head]))
    savers = {"emb": SavedBytes(excl_params | _storages(batch.values())), "other": SavedBytes(excl_params)}

    def fwd(samples: _Samples, fn, saver: SavedBytes, record: bool):
        synchronize(device)
        t0 = time.perf_counter()
        with saver.measure():
            out = fn()
        synchronize(device)
        if record:
            samples.fwd.append(time.perf_counter() - t0)
        samples.stash = saver.bytes
        return out

    def bwd(samples: _Samples, outs, grads, record: bool) -> None:
        synchronize(device)
        if cuda:
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        torch.autograd.backward(outs, grads)
        synchronize(device)
        if record:
            samples.bwd.append(time.perf_counter() - t0)
        if cuda:  # what the backward needs on top of everything allocated before it
            samples.workspace = max(samples.workspace, torch.cuda.max_memory_allocated(device) - before)

    for i in range(warmup + reps):
        rec = i >= warmup
        # forward, block by block
        h = fwd(emb_s, lambda: emb(None, batch), savers["emb"], rec)
        emb_s.input, emb_s.output = _nbytes(batch["tokens"]), _nbytes(h)
        inputs, outputs = [], []
        x = h.detach().requires_grad_(True)
        for layer in layers:
            inputs.append(x)
            out = fwd(lay_s, lambda: layer(x, batch), savers["other"], rec)
            lay_s.input, lay_s.output = _nbytes(x), _nbytes(out)
            outputs.append(out)
            x = out.detach().requires_grad_(True)
        loss = fwd(head_s, lambda: loss_fn(head(x, batch), batch), savers["other"], rec)
        head_s.input, head_s.output = _nbytes(x), 0
        # backward in reverse, each block's own
        bwd(head_s, (loss,), None, rec)
        grad = x.grad
        for j in reversed(range(len(layers))):
            bwd(lay_s, (outputs[j],), (grad,), rec)
            grad = inputs[j].grad
        bwd(emb_s, (h,), (grad,), rec)
        del h, inputs, outputs, loss, grad, x
        # the forward without autograd, block by block
        with torch.no_grad():
            synchronize(device)
            t0 = time.perf_counter()
            y = emb(None, batch)
            synchronize(device)
            t1 = time.perf_counter()
            lay_times = []
            for layer in layers:
                ta = time.perf_counter()
                y = layer(y, batch)
                synchronize(device)
                lay_times.append(time.perf_counter() - ta)
            t2 = time.perf_counter()
            loss_fn(head(y, batch), batch)
            synchronize(device)
            t3 = time.perf_counter()
        if rec:
            emb_s.nograd.append(t1 - t0)
            lay_s.nograd.extend(lay_times)
            head_s.nograd.append(t3 - t2)
    for p in _unique_params([emb, *layers, head]):
        p.grad = None  # the next microbatch size starts from the same memory
    return (emb_s.result(sum(p.numel() for p in _unique_params([emb])), cuda),
            lay_s.result(sum(p.numel() for p in _unique_params([layers[0]])), cuda),
            head_s.result(sum(p.numel() for p in _unique_params([head])), cuda))


@dataclass(frozen=True)
class MicrobatchProfile:
    """The three blocks at one (t, b), measured."""

    tensor_parallel: int
    micro_batch_size: int
    embedding: BlockMeasurement
    layer: BlockMeasurement
    head: BlockMeasurement
    tied_params: int

    def costs(self) -> MicrobatchCosts:
        return MicrobatchCosts(self.layer.block_cost(), self.embedding.block_cost(), self.head.block_cost(),
                               tied_params=self.tied_params)

    def block(self, name: str) -> BlockMeasurement:
        return getattr(self, name)


@dataclass(frozen=True)
class OptimizerCost:
    """Time of one optimizer step (``APPLY_UPDATE``) over ``n`` parameters: ``fixed_s + per_param_s * n``."""

    fixed_s: float
    per_param_s: float

    def seconds(self, num_params: int) -> float:
        return self.fixed_s + self.per_param_s * num_params


@dataclass
class Profile:
    """A measured profile: the planner's ``LayerCosts`` plus what the simulator also uses."""

    model: ModelConfig
    entries: dict[tuple[int, int], MicrobatchProfile] = field(default_factory=dict)
    optimizer: OptimizerCost | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def layer_costs(self) -> LayerCosts:
        return LayerCosts(self.source or "profile", {k: e.costs() for k, e in self.entries.items()})

    def to_json(self) -> dict[str, Any]:
        """``megatron_2bw-profile-v1`` (``layer_costs.py``) plus extras its loader ignores."""
        data = self.layer_costs().to_json()
        data["source"] = self.source
        for entry in data["entries"]:
            e = self.entries[(entry["tensor_parallel"], entry["micro_batch_size"])]
            entry["measured"] = {name: e.block(name).extras() for name in BLOCKS}
        data["model"] = asdict(self.model)
        data["meta"] = self.meta
        if self.optimizer is not None:
            data["optimizer"] = asdict(self.optimizer)
        return data

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")


@dataclass(frozen=True)
class LoadedProfile:
    """What :func:`load_full_profile` returns: the costs, and the extras when the file has them."""

    costs: LayerCosts
    measured: Mapping[tuple[int, int], Mapping[str, Mapping[str, Any]]]
    optimizer: OptimizerCost | None
    model: ModelConfig | None
    meta: Mapping[str, Any]

    def forward_nograd_s(self, t: int, b: int, block: str) -> float | None:
        v = self.measured.get((t, b), {}).get(block, {}).get("forward_nograd_s")
        return float(v) if v is not None else None


def load_full_profile(path: str | Path) -> LoadedProfile:
    """Read a profile file: ``LayerCosts`` via the planner's own parser, plus this module's extras."""
    data = read_profile_json(path)
    costs = layer_costs_from_json(data, str(path))
    measured = {(int(e["tensor_parallel"]), int(e["micro_batch_size"])): e.get("measured", {}) for e in data["entries"]}
    opt = data.get("optimizer")
    model = data.get("model")
    return LoadedProfile(
        costs=costs, measured=measured,
        optimizer=OptimizerCost(float(opt["fixed_s"]), float(opt["per_param_s"])) if isinstance(opt, Mapping) else None,
        model=ModelConfig(**model) if isinstance(model, Mapping) else None,
        meta=data.get("meta", {}),
    )


# ---- the model ----------------------------------------------------------------------------------

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


def profile_optimizer(
    num_params: Sequence[int] = (1 << 18, 1 << 21), device: torch.device | str = "cpu", dtype: str = "fp32",
    *, warmup: int = 2, reps: int = 5, params_per_view: int = 1 << 16,
) -> OptimizerCost:
    """Time the engine's update path (``PipelineStage._apply``) on flat buffers of two sizes and fit
    ``fixed_s + per_param_s * n``: global-norm over per-parameter views, unscale, AdamW, zero grad."""
    from ..config import OptimizerConfig  # noqa: PLC0415
    from ..optimizer.flat import build_optimizer  # noqa: PLC0415

    device = resolve_device(device)
    tdtype = DTYPES[dtype]
    times = []
    for n in num_params:
        src = torch.randn(n, device=device, dtype=tdtype) * 0.02
        dst = src.clone()
        grad = torch.randn(n, device=device, dtype=tdtype) * 1e-3
        master = src.float().clone() if tdtype != torch.float32 else None
        views = list(grad.split(params_per_view))
        opt = build_optimizer(OptimizerConfig(dtype=dtype), n, n // 2, device)
        samples = []
        for i in range(warmup + reps):
            grad.normal_().mul_(1e-3)
            synchronize(device)
            t0 = time.perf_counter()
            sumsq = torch.stack(torch._foreach_norm(views)).float().square().sum()
            float(sumsq.item())
            g32 = grad.float() if grad.dtype != torch.float32 else grad
            g32.mul_(0.5)
            if master is not None:
                opt.update(master, master, g32, 1e-4)
                dst.copy_(master)
            else:
                opt.update(src, dst, g32, 1e-4)
            grad.zero_()
            synchronize(device)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
        times.append(median(samples))
    (n0, n1), (s0, s1) = (num_params[0], num_params[-1]), (times[0], times[-1])
    per = max((s1 - s0) / (n1 - n0), 0.0) if n1 != n0 else s1 / n1
    return OptimizerCost(fixed_s=max(s0 - per * n0, 0.0), per_param_s=per)


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
    if dtype not in DTYPES:
        raise ConfigError(f"unknown precision {dtype!r}; choose one of {', '.join(DTYPES)}")
    sizes = sorted(set(int(b) for b in micro_batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"micro batch sizes must be positive, got {list(micro_batch_sizes)}")
    if reps < 1 or warmup < 0:
        raise ConfigError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    dev = resolve_device(device)
    tdtype = DTYPES[dtype]
    tp = tp or TPGroup()
    if kernels is None:
        from ..fused import select_kernels  # noqa: PLC0415

        kernels = select_kernels("auto", dev.type)
    spec = ModelSpec(cfg, tp, seed, kernels=kernels)
    torch.manual_seed(seed)
    blocks = build_blocks(spec, dev, tdtype, chain_layers)
    prof = Profile(cfg)
    for b in sizes:
        start = time.perf_counter()
        try:
            prof.entries[(tp.size, b)] = profile_microbatch(spec, b, dev, tdtype, warmup=warmup, reps=reps,
                                                            blocks=blocks, seed=seed, chain_layers=chain_layers)
        except torch.cuda.OutOfMemoryError:
            if not skip_oom or not prof.entries:
                raise
            for p in _unique_params(blocks[0] + blocks[1]):
                p.grad = None
            torch.cuda.empty_cache()
            if log:
                log(f"b={b}: out of memory; profiled microbatch sizes up to {max(k[1] for k in prof.entries)}")
            break
        if log:
            e = prof.entries[(tp.size, b)]
            log(f"b={b}: layer fwd {e.layer.forward_s * 1e3:.3f} ms bwd {e.layer.backward_s * 1e3:.3f} ms, "
                f"stash {e.layer.stash_bytes / 2**20:.2f} MiB ({time.perf_counter() - start:.1f} s)")
    if optimizer:
        layer_params = next(iter(prof.entries.values())).layer.params
        prof.optimizer = profile_optimizer((max(layer_params // 4, 1 << 12), max(2 * layer_params, 1 << 14)), dev, dtype,
                                           warmup=warmup, reps=reps)
    devname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    prof.meta = {
        "device": devname, "device_type": dev.type, "torch": torch.__version__, "dtype": dtype,
        "threads": torch.get_num_threads(), "warmup": warmup, "reps": reps, "tensor_parallel": tp.size,
        "chain_layers": len(blocks[0]) - 1,
        "kernels": getattr(kernels, "describe", lambda: str(kernels))(), "host": platform.node(),
    }
    prof.source = source or (f"measured on {devname} ({dev.type}, {dtype}, torch {torch.__version__}, "
                             f"{torch.get_num_threads()} threads), median of {reps} after {warmup} warm-up")
    return prof


def merge_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile holding the entries of several (e.g. one per tensor-parallel size)."""
    if not profiles:
        raise ConfigError("no profiles to merge")
    out = Profile(profiles[0].model, {}, profiles[0].optimizer, dict(profiles[0].meta), profiles[0].source)
    for p in profiles:
        if p.model != out.model:
            raise ConfigError("cannot merge profiles of different models")
        for key, e in p.entries.items():
            if key in out.entries:
                raise ConfigError(f"two profiles measured (t={key[0]}, b={key[1]})")
            out.entries[key] = e
    if len(profiles) > 1:
        out.meta["tensor_parallel"] = sorted({k[0] for k in out.entries})
    return out


# ---- tensor-parallel sizes: one process per device ----------------------------------------------

def _tp_worker(rank: int, t: int, port: int, device_type: str, kwargs: dict, queue) -> None:
    import datetime  # noqa: PLC0415
    import pickle  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(max(1, kwargs.pop("threads", 1)))
            device = torch.device("cpu")
        kwargs.pop("threads", None)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=t, timeout=datetime.timedelta(minutes=10))
        try:
            from ..parallel_state import build_state  # noqa: PLC0415

            state = build_state(t, 1, 1, device)
            prof = profile_model(tp=TPGroup.from_state(state), device=device, **kwargs)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, pickle.dumps(prof) if rank == 0 else b""))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def profile_tensor_parallel(
    model: ModelConfig | str, t: int, micro_batch_sizes: Iterable[int] = (1, 2, 4), *, device_type: str | None = None,
    timeout_s: float = 1800.0, threads: int = 1, **kwargs,
) -> Profile:
    """Profile at tensor-parallel size ``t`` with ``t`` local processes (one GPU each on CUDA, gloo
    processes of ``threads`` threads on a CPU); keyword arguments as :func:`profile_model`."""
    import multiprocessing as mp  # noqa: PLC0415
    import pickle  # noqa: PLC0415
    import queue as queue_mod  # noqa: PLC0415
    import socket  # noqa: PLC0415

    cfg = _model(model)
    if t < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {t}")
    cfg.check_tensor_parallel(t)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and torch.cuda.device_count() < t:
        raise ConfigError(f"profiling t={t} needs {t} GPUs on this node, found {torch.cuda.device_count()}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    kw = dict(kwargs, model=cfg, micro_batch_sizes=tuple(micro_batch_sizes))
    if device_type == "cpu":
        kw["threads"] = threads
    procs = [ctx.Process(target=_tp_worker, args=(r, t, port, device_type, dict(kw), q), daemon=True) for r in range(t)]
    for p in procs:
        p.start()
    result, errors, got = None, [], 0
    deadline = time.monotonic() + timeout_s
    try:
        while got < t:
            try:
                rank, ok, value = q.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"profiling t={t} did not finish within {timeout_s:.0f} s") from None
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a profiling process (t={t}) died") from None
                continue
            got += 1
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
                break
            if rank == 0:
                result = pickle.loads(value)
        if errors:
            raise RuntimeError(f"profiling t={t} failed:\n" + "\n".join(errors))
        return result
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
