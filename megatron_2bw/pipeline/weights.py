"""A stage's weight versions, each one flat buffer; gradients in flat buffers by step parity.

PipeDream-2BW keeps exactly two versions: W(t) for new microbatches and the shadow version
for microbatches already in flight. Each version is a separate copy of the stage's layers
whose parameters are views into one flat buffer, so "switching versions" is picking a module
list (a reference), and the optimizer updates a version with a few vectorized passes over one
buffer. The flush schedules keep one version.

Gradients of step t accumulate into grad buffer ``t % 2`` (2BW) so that step t's gradient can
wait for its asynchronous reductions while step t+1's microbatches already run backward.

Gradient buffers hold ``grad_dtype``. When it is the weights' dtype, each parameter's ``.grad``
is a view of the buffer and autograd accumulates into it directly. When it is wider (fp32
gradients for bf16/fp16 weights: Megatron's ``--accumulate-allreduce-grads-in-fp32``), each
parameter carries ``main_grad``, a view of the current fp32 buffer, and a post-accumulate-grad
hook adds each backward's model-dtype ``.grad`` into it and frees it (``.grad = None``), so
the sum over microbatches is rounded once per addition in fp32 instead of in the model dtype.

The storage is cut into segments, one per (gradient dtype, reduction domain) (:mod:`.segments`): each
parameter's domain names the ranks its gradient is reduced over. With the default domain alone there
is one segment, the whole buffer.

Parameters carry two names: the local one (``"1.attn.qkv.weight"``: index in this stage's layer
list) that checkpoints use to match a stage's buffers, and the global one, the name the
parameter has in the full single-stage model (``"5.attn.qkv.weight"``), that checkpoint
payloads and cross-layout comparisons use.

Construction never holds more than the buffers: the stage is built inside ``init.deferred()``, so
its tensor-parallel weights are meta tensors with an ``Init``, and each is written straight into
its view of the first buffer on the device (``cpu_init``: the layout-independent CPU path,
``--use-cpu-initialization``; else each rank draws its own shard there). A further version is a
copy of the first buffer, its modules a deep copy whose parameters are placeholders.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..tensor_parallel import init
from . import segments as seg


def _accumulate_main_grad(p: torch.Tensor) -> None:
    """Add this backward's gradient into the parameter's fp32 buffer view and free it."""
    p.main_grad.add_(p.grad)
    p.grad = None


def _unique_params(modules: nn.ModuleList) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in modules.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


@dataclass(frozen=True)
class GlobalNames:
    """Where a stage sits in the full model's layer list, for global parameter names.

    ``first_index`` is the full-model list index of the stage's first layer; ``tied`` is the full
    model's name of the tied word-embedding weight (parameters marked ``shared_embedding``), so a
    last stage's copy of it carries the same name as the first stage's original.
    """

    first_index: int = 0
    tied: str | None = None
    # the full-model list index of each local layer where the stage's layers are not one run (a rank
    # holding several model chunks: its chunks' layers one after the other); None: first_index + i
    indices: tuple[int, ...] | None = None

    @classmethod
    def of_chunks(cls, ranges: list[tuple[int, int]], tied: str | None = None) -> GlobalNames:
        """The names of a rank whose layer list is the concatenation of ``ranges`` (one per chunk)."""
        return cls(ranges[0][0], tied, tuple(i for lo, hi in ranges for i in range(lo, hi)))

    def of(self, modules: nn.ModuleList, params: list[nn.Parameter]) -> list[str]:
        """The global name of each of ``params`` (parameters of ``modules``)."""
        by_id: dict[int, str] = {}
        for i, module in enumerate(modules):
            g = self.first_index + i if self.indices is None else self.indices[i]
            for name, p in module.named_parameters(remove_duplicate=False):
                by_id.setdefault(id(p), f"{g}.{name}")
        return [self.tied if self.tied and getattr(p, "shared_embedding", False) else by_id[id(p)] for p in params]


class RankWeights:
    def __init__(
        self, build: Callable[[], list[nn.Module]], *, num_versions: int, dtype: torch.dtype,
        device: torch.device, tp_rank: int = 0, count_shared_in_norm: bool = True,
        names: GlobalNames = GlobalNames(), num_grad_buffers: int | None = None,
        grad_dtype: torch.dtype | None = None, shards: int | dict[str, int] = 1, cpu_init: bool = True,
    ) -> None:
        with init.deferred():
            first = nn.ModuleList(build())
        _to(first, device, dtype)
        named = _unique_params(first)
        # by segment (:mod:`.segments`), and in each decayed matrices first, then vectors (biases, norms):
        # a segment's weight decay is one slice. ``shards`` (per domain, or one count for all): the
        # distributed optimizer's equal ranges tile each segment's padded storage, so its reduce-scatter and
        # all-gather run on the buffers themselves (``flat`` is the view up to the last parameter)
        self.grad_dtype = dtype if grad_dtype is None else grad_dtype
        order, self.segments, offsets = seg.plan([p for _, p in named], self.grad_dtype, shards)
        named = [named[i] for i in order]
        self.names = [n for n, _ in named]
        self.global_names = names.of(first, [p for _, p in named])
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.offsets = offsets + [self.segments[-1].end]
        self.numel = self.segments[-1].end
        self.padded_numel = self.segments[-1].start + self.segments[-1].padded
        # the stage's decayed prefix (one segment; with several, each segment states its own)
        self.n_decay = self.segments[0].n_decay if len(self.segments) == 1 else None
        self.inits = [getattr(p, "init", None) for _, p in named]  # each parameter's shards and domain
        # per parameter: the split dimension of a tensor-parallel linear weight (Megatron's
        # ``partition_dim``; None elsewhere) and whether it is split here (``--optimizer muon``)
        self.partition_dims = [getattr(p, "partition_dim", None) if p.dim() == 2 else None for _, p in named]
        self.tp_split = [bool(getattr(p, "tensor_parallel", False)) for _, p in named]
        # experts of a 3-D stack ``[E_local, out, in]`` (MoE): Muon orthogonalises each expert's matrix alone
        self.stacks = [p.shape[0] if getattr(p, "expert_stack", False) and p.dim() == 3 else 0 for _, p in named]
        self.dtype, self.device, self.num_versions = dtype, device, num_versions
        self.cpu_init = cpu_init

        self.slots: list[nn.ModuleList] = []
        self.flat: list[torch.Tensor] = []
        self.padded_flat: list[torch.Tensor] = []  # the storage behind each ``flat`` (zero tail)
        self.params: list[list[nn.Parameter]] = []
        for v in range(num_versions):
            self._add_version(first if v == 0 else _placeholder_copy(first), order)

        self._add_grads(num_versions if num_grad_buffers is None else num_grad_buffers, grad_dtype, tp_rank,
                        count_shared_in_norm)
        self.storages = {f.untyped_storage().data_ptr() for f in self.flat + self.grad_flat}

    def _add_grads(self, num_grad: int, grad_dtype: torch.dtype | None, tp_rank: int,
                   count_shared_in_norm: bool) -> None:
        """The gradient buffers (``num_grad`` of them, in ``grad_dtype``) and what a model-wide norm counts."""
        self.padded_grad = [torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.device)
                            for _ in range(num_grad)]
        self.grad_flat = [g[:self.numel] for g in self.padded_grad]
        self.grad_views = [self._views(g) for g in self.grad_flat]
        self._slot_grad: list[int | None] = [None] * self.num_versions
        # gradients wider than the weights accumulate through ``main_grad`` (module docstring)
        self.main_grads = self.grad_dtype != self.dtype
        if self.main_grads:
            for p in (p for ps in self.params for p in ps):
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)

        ref = self.params[0]
        counted = [
            (getattr(p, "tensor_parallel", False) or tp_rank == 0)
            and (count_shared_in_norm or not getattr(p, "shared_embedding", False))
            for p in ref
        ]
        self.norm_views = [[v for v, c in zip(views, counted) if c] for views in self.grad_views]
        self.counted = counted  # parameters this rank counts in a model-wide norm (no tensor or tied duplicates)
        self.shared_range = next(
            ((self.offsets[i], self.offsets[i + 1]) for i, p in enumerate(ref)
             if getattr(p, "shared_embedding", False)),
            None,
        )

    def _add_version(self, mods: nn.ModuleList, order: list[int]) -> None:
        """Move ``mods``' parameters into one new flat buffer (they become views of it): the first
        version's values copied or made in place (deferred ones), a further version's copied from the first."""
        padded = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        ps = [p for _, p in _unique_params(mods)]
        ps = [ps[i] for i in order]
        with torch.no_grad():
            if self.flat:
                padded.copy_(self.padded_flat[0])
            else:
                padded[self.numel:].zero_()
            flat = padded[:self.numel]
            for s in self.segments[:-1]:  # the padding between segments (zero weights)
                padded[s.end:s.start + s.padded].zero_()
            adopted = {}
            for p, view in zip(ps, self._views(flat)):
                if not p.is_meta:
                    view.copy_(p.data)
                    p.data = view
                    continue
                if not self.flat:
                    init.materialize(p, view, cpu=self.cpu_init)
                adopted[id(p)] = _adopt(p, view)
            if adopted:  # a meta tensor cannot take a buffer's view as its data: new Parameter objects
                for m in mods.modules():
                    for k, q in m._parameters.items():
                        if q is not None and id(q) in adopted:
                            m._parameters[k] = adopted[id(q)]
                ps = [adopted.get(id(p), p) for p in ps]
        self.slots.append(mods)
        self.flat.append(flat)
        self.padded_flat.append(padded)
        self.params.append(ps)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def slot(self, version: int) -> int:
        """The buffer holding W(version): versions alternate between the buffers (one buffer: always 0)."""
        return version % self.num_versions

    def layers(self, version: int) -> nn.ModuleList:
        """The layer list whose parameters hold W(version)."""
        return self.slots[self.slot(version)]

    def grad_buffer(self, step: int) -> int:
        return step % len(self.grad_flat)

    def point_grads(self, slot: int, buf: int) -> None:
        """Make ``slot``'s parameters accumulate into grad buffer ``buf`` (a reference switch)."""
        if self._slot_grad[slot] != buf:
            for p, g in zip(self.params[slot], self.grad_views[buf]):
                if self.main_grads:
                    p.main_grad = g
                else:
                    p.grad = g
            self._slot_grad[slot] = buf

    @property
    def weight_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flat)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient buffers (fp32 ones when gradients accumulate in fp32)."""
        return sum(g.numel() * g.element_size() for g in self.grad_flat)

    def state_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Global parameter name -> view of ``flat``, a buffer laid out like a version (or a copy of one)."""
        return dict(zip(self.global_names, self._views(flat)))


def _to(mods: nn.ModuleList, device: torch.device, dtype: torch.dtype) -> None:
    """``Module.to(device, dtype)`` for everything but deferred (meta) parameters, which keep only their shape."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_meta else t.to(device=device, dtype=dtype if t.is_floating_point() else None)

    for m in mods.modules():
        for p in m._parameters.values():
            if p is not None and not p.is_meta:
                with torch.no_grad():
                    p.data = move(p.data)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = move(b)


def _adopt(p: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
    """A Parameter over ``view`` with ``p``'s flag and attributes (``tensor_parallel``, ``init``, ...)."""
    q = nn.Parameter(view, requires_grad=p.requires_grad)
    q.__dict__.update(p.__dict__)
    return q


def _placeholder_copy(mods: nn.ModuleList) -> nn.ModuleList:
    """A deep copy of ``mods`` whose parameters are meta placeholders (the new version's values are a
    copy of the first buffer, so copying the old storage as well would cost a version more)."""
    memo: dict = {}
    for _, p in _unique_params(mods):
        q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        q.__dict__.update(p.__dict__)
        memo[id(p)] = q
    return copy.deepcopy(mods, memo)


class _Parameters(nn.Module):
    """Parameters only, half matrices (decayed) and half vectors: a stand-in stage of a given size."""

    def __init__(self, numel: int, per_param: int) -> None:
        super().__init__()
        sizes = [min(per_param, numel - o) for o in range(0, numel, per_param)]
        half = len(sizes) // 2
        self.matrices = nn.ParameterList([nn.Parameter(torch.zeros(1, n)) for n in sizes[:half]])
        self.vectors = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in sizes[half:]])


def sized_weights(numel: int, *, dtype: torch.dtype, device: torch.device, num_versions: int = 2,
                  params_per_view: int = 1 << 16, grad_dtype: torch.dtype | None = None,
                  shards: int = 1) -> RankWeights:
    """A RankWeights of ``numel`` zero parameters in pieces of ``params_per_view`` (for timing updates)."""
    return RankWeights(lambda: [_Parameters(numel, params_per_view)], num_versions=num_versions, dtype=dtype,
                        device=device, grad_dtype=grad_dtype, shards=shards)
