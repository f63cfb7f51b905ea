"""ZeRO-1 shards for the distributed optimizer (``--use-distributed-optimizer``).

Data-parallel rank r of w owns the contiguous range ``[lo, hi) = [r*s, min((r+1)*s, N))`` of the
stage's flat parameter buffer of N elements, ``s = ceil(N / w)``. Its fp32 master copy and its
optimizer state hold ``s`` elements on every rank (the last rank's tail is padding: zero weights
with zero gradients, which every optimizer here leaves at zero), so each rank keeps the same
bytes: the optimizer state of ``s`` parameters plus, when weights are not fp32, a 4-byte master
of ``s``. Parameters are ordered decayed-first (:class:`~.weights.StageWeights`), so the shard's
weight-decay prefix is ``clamp(n_decay - lo, 0, hi - lo)``.

Each shard runs the unsharded update's elementwise arithmetic, so the result is bitwise the
unsharded one, with one caveat: torch's fused AdamW kernel computes the last (length mod vector
width) elements of each call with scalar code that can differ in the last bit, so Adam matches
bitwise when the shard and weight-decay boundaries are multiples of the vector width (true for
usual layer sizes) and otherwise to an ulp in those few elements.

The collectives work on ``w * c``-element pieces (``c`` shard elements per bucket) while the flat
buffers hold N elements in whole-buffer order, so each bucket goes through a staging buffer: the
reduce-scatter gathers every rank's range piece into it, the all-gather scatters it back out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# the same collectives under their newer names where torch has them (the older ones warn there)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ShardLayout:
    """Which range of an N-element flat buffer data-parallel rank ``rank`` of ``w`` owns."""

    numel: int
    w: int
    rank: int

    @property
    def size(self) -> int:
        """Elements of every rank's shard (padded): ``ceil(numel / w)``."""
        return -(-self.numel // self.w)

    def bounds(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``rank``'s range in the flat buffer (the last one may be short or empty)."""
        lo = min(rank * self.size, self.numel)
        return lo, min(lo + self.size, self.numel)

    @property
    def lo(self) -> int:
        return self.bounds(self.rank)[0]

    @property
    def hi(self) -> int:
        return self.bounds(self.rank)[1]

    def decay_prefix(self, n_decay: int) -> int:
        """The shard's weight-decayed prefix: the part of ``[0, n_decay)`` inside ``[lo, hi)``."""
        return min(max(n_decay - self.lo, 0), self.hi - self.lo)

    def counted_views(self, flat: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parts inside ``[lo, hi)`` of ``views`` (views of ``flat``): the shard's share of a norm."""
        base, esize = flat.data_ptr(), flat.element_size()
        out = []
        for v in views:
            o = (v.data_ptr() - base) // esize
            a, b = max(o, self.lo), min(o + v.numel(), self.hi)
            if a < b:
                out.append(flat[a:b])
        return out

    def padded(self, part: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new ``size``-element tensor holding ``part`` (this rank's range of a buffer), zeros after it."""
        out = torch.zeros(self.size, dtype=dtype or part.dtype, device=part.device)
        out[:part.numel()].copy_(part)
        return out

    def take(self, full: torch.Tensor, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """This rank's padded shard of a whole-buffer tensor ``full`` (e.g. a checkpoint's)."""
        if full.numel() != self.numel:
            raise ValueError(f"a state of {full.numel()} elements for a buffer of {self.numel}")
        return self.padded(full[self.lo:self.hi].to(device=device or full.device), dtype)


def _buckets(layout: ShardLayout, chunk: int):
    s = layout.size
    for a in range(0, s, max(chunk, 1)):
        yield a, min(a + max(chunk, 1), s)


def reduce_scatter(flat: torch.Tensor, layout: ShardLayout, group, chunk: int) -> None:
    """``flat[lo:hi]`` = the sum over ``group`` of every rank's ``flat[lo:hi]``; the rest is left as is."""
    w, lo, hi = layout.w, layout.lo, layout.hi
    for a, b in _buckets(layout, chunk):
        c = b - a
        staging = flat.new_zeros(w * c)
        for r in range(w):
            r_lo, r_hi = layout.bounds(r)
            p_lo, p_hi = min(r_lo + a, r_hi), min(r_lo + b, r_hi)
            if p_hi > p_lo:
                staging[r * c:r * c + p_hi - p_lo].copy_(flat[p_lo:p_hi])
        out = flat.new_empty(c)
        _reduce_scatter(out, staging, group=group)
        n = min(lo + b, hi) - (lo + a)
        if n > 0:
            flat[lo + a:lo + a + n].copy_(out[:n])


def all_gather(flat: torch.Tensor, shard: torch.Tensor, layout: ShardLayout, group, chunk: int) -> None:
    """Every other rank's range of ``flat`` = that rank's ``shard`` (``size`` elements, ``flat``'s dtype)."""
    w = layout.w
    for a, b in _buckets(layout, chunk):
        c = b - a
        staging = flat.new_empty(w * c)
        _all_gather(staging, shard[a:b].contiguous(), group=group)
        for r in range(w):
            r_lo, r_hi = layout.bounds(r)
            p_lo, p_hi = min(r_lo + a, r_hi), min(r_lo + b, r_hi)
            if r != layout.rank and p_hi > p_lo:
                flat[p_lo:p_hi].copy_(staging[r * c:r * c + p_hi - p_lo])


def gather_full(shard: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """The whole-buffer tensor (``numel`` elements, on the CPU) whose shards the ranks of ``group`` hold."""
    out = shard.new_empty(layout.w * layout.size)
    _all_gather(out, shard.contiguous(), group=group)
    return out[:layout.numel].cpu()
