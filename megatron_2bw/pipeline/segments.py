"""A stage's flat storage cut into segments, one per (gradient dtype, reduction domain), as Megatron-Core keys
its gradient buffers.

Each parameter names its reduction domain (``tensor_parallel.init.Init.domain``): the ranks its gradient is
reduced over and its distributed-optimizer state sharded over (``"dp"``, the whole data group, by default;
``"edp"``, the expert-data group, for expert weights, which are not replicas across the data group). The
weight and gradient buffers of a stage hold one contiguous segment per key, the default domain's first,
each padded to a multiple of its own shard count (the size of its domain's group under the distributed
optimizer, else 1), so the reducer, the distributed optimizer and the checkpoints work on a segment as
they worked on the whole buffer. Padding between segments is zero weights with zero gradients, which every
optimizer leaves at zero (the padding rule of :mod:`.zero`). With the default domain alone there is one
segment and the storage is exactly the single flat buffer it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..tensor_parallel.init import DATA, domain_of


@dataclass(frozen=True)
class Segment:
    """One segment: ``numel`` elements of parameters from ``start`` of the stage's flat storage (decayed
    matrices first: its first ``n_decay``), then padding up to ``padded`` (a multiple of ``shards``)."""

    domain: str
    grad_dtype: torch.dtype
    start: int
    numel: int
    padded: int
    n_decay: int
    shards: int
    first: int  # index of its first parameter in the stage's parameter order
    count: int  # its parameters

    @property
    def key(self) -> tuple[torch.dtype, str]:
        return self.grad_dtype, self.domain

    @property
    def end(self) -> int:
        """One past its last parameter element (the padding follows)."""
        return self.start + self.numel

    @property
    def params(self) -> range:
        return range(self.first, self.first + self.count)

    def of(self, flat: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """Its range of a stage buffer (the storage's whole padded range with ``padded``): a view."""
        return flat[self.start:self.start + (self.padded if padded else self.numel)]


def _domain_order(name: str) -> tuple[int, str]:
    return (0 if name == DATA else 1, name)


def plan(params: list[torch.Tensor], grad_dtype: torch.dtype, shards: int | Mapping[str, int]
         ) -> tuple[list[int], list[Segment], list[int]]:
    """(the stage's parameter order, its segments, each parameter's offset in that order): by segment (the
    default domain's first, the others by name), decayed matrices before vectors inside each."""
    order = sorted(range(len(params)), key=lambda i: (_domain_order(domain_of(params[i])), params[i].dim() < 2))
    segments, offsets, start = [], [], 0
    i = 0
    while i < len(order):
        dom = domain_of(params[order[i]])
        j = i
        while j < len(order) and domain_of(params[order[j]]) == dom:
            j += 1
        sizes = [params[k].numel() for k in order[i:j]]
        count = shards if isinstance(shards, int) else shards.get(dom, 1)
        numel = sum(sizes)
        n_decay = sum(n for k, n in zip(order[i:j], sizes) if params[k].dim() >= 2)
        o = start
        for n in sizes:
            offsets.append(o)
            o += n
        padded = -(-numel // count) * count
        segments.append(Segment(dom, grad_dtype, start, numel, padded, n_decay, count, i, j - i))
        start += padded
        i = j
    if not segments:  # a stage without parameters: one empty segment of the default domain
        segments.append(Segment(DATA, grad_dtype, 0, 0, 0, 0, 1, 0, 0))
    return order, segments, offsets
