"""A stage's weight versions, each one flat buffer; gradients in flat buffers by step parity.

PipeDream-2BW keeps exactly two versions: W(t) for new microbatches and the shadow version
for microbatches already in flight. Each version is a separate copy of the stage's layers
whose parameters are views into one flat buffer, so "switching versions" is picking a module
list (a reference), and the optimizer updates a version with a few vectorized passes over one
buffer. The flush schedules keep one version.

Gradients of step t accumulate into grad buffer ``t % 2`` (2BW) so that step t's gradient can
wait for its asynchronous reductions while step t+1's microbatches already run backward.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn


def _unique_params(modules: nn.ModuleList) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in modules.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


class StageWeights:
    def __init__(
        self, build: Callable[[], list[nn.Module]], *, num_versions: int, dtype: torch.dtype,
        device: torch.device, tp_rank: int = 0, count_shared_in_norm: bool = True, master_fp32: bool = False,
    ) -> None:
        first = nn.ModuleList(build()).to(device=device, dtype=dtype)
        named = _unique_params(first)
        # decayed matrices first, then vectors (biases, norms): weight decay is one slice
        order = sorted(range(len(named)), key=lambda i: named[i][1].dim() < 2)
        named = [named[i] for i in order]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.n_decay = sum(n for (_, p), n in zip(named, self.sizes) if p.dim() >= 2)
        self.dtype, self.device, self.num_versions = dtype, device, num_versions

        self.slots: list[nn.ModuleList] = []
        self.flat: list[torch.Tensor] = []
        self.params: list[list[nn.Parameter]] = []
        for v in range(num_versions):
            mods = first if v == 0 else copy.deepcopy(first)
            flat = torch.empty(self.numel, dtype=dtype, device=device)
            ps = [p for _, p in _unique_params(mods)]
            ps = [ps[i] for i in order]
            with torch.no_grad():
                for p, view in zip(ps, self._views(flat)):
                    view.copy_(p.data)
                    p.data = view
            self.slots.append(mods)
            self.flat.append(flat)
            self.params.append(ps)

        num_grad = 2 if num_versions == 2 else 1
        self.grad_flat = [torch.zeros(self.numel, dtype=dtype, device=device) for _ in range(num_grad)]
        self.grad_views = [self._views(g) for g in self.grad_flat]
        self._slot_grad: list[int | None] = [None] * num_versions
        self.master = self.flat[0].float().clone() if master_fp32 else None

        ref = self.params[0]
        counted = [
            (getattr(p, "tensor_parallel", False) or tp_rank == 0)
            and (count_shared_in_norm or not getattr(p, "shared_embedding", False))
            for p in ref
        ]
        self.norm_views = [[v for v, c in zip(views, counted) if c] for views in self.grad_views]
        self.shared_range = next(
            ((self.offsets[i], self.offsets[i + 1]) for i, p in enumerate(ref) if getattr(p, "shared_embedding", False)),
            None,
        )
        self.storages = {f.untyped_storage().data_ptr() for f in self.flat + self.grad_flat}

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def slot(self, version: int) -> int:
        return version % self.num_versions

    def grad_buffer(self, step: int) -> int:
        return step % len(self.grad_flat)

    def point_grads(self, slot: int, buf: int) -> None:
        """Make ``slot``'s parameters accumulate into grad buffer ``buf`` (a reference switch)."""
        if self._slot_grad[slot] != buf:
            for p, g in zip(self.params[slot], self.grad_views[buf]):
                p.grad = g
            self._slot_grad[slot] = buf

    @property
    def weight_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flat) + (self.master.numel() * 4 if self.master is not None else 0)

    @property
    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grad_flat)

    def named_flat(self, slot: int) -> dict[str, torch.Tensor]:
        """Parameter name -> view of ``slot``'s buffer (for checkpoints and comparisons)."""
        return dict(zip(self.names, self._views(self.flat[slot])))
