"""ZeRO-1 shards for the distributed optimizer (``--use-distributed-optimizer``).

Data-parallel rank r of w owns the contiguous range ``[lo, hi) = [r*s, min((r+1)*s, N))`` of the
stage's flat parameter buffer of N elements, ``s = ceil(N / w)``. Its fp32 master copy and its
optimizer state hold ``s`` elements on every rank (the last rank's tail is padding: zero weights
with zero gradients, which every optimizer here leaves at zero), so each rank keeps the same
bytes: the optimizer state of ``s`` parameters plus, when weights are not fp32, a 4-byte master
of ``s``. Parameters are ordered decayed-first (:class:`~.weights.RankWeights`), so the shard's
weight-decay prefix is ``clamp(n_decay - lo, 0, hi - lo)``.

Each shard runs the unsharded update's elementwise arithmetic, so the result is bitwise the
unsharded one, with one caveat: torch's fused AdamW kernel computes the last (length mod vector
width) elements of each call with scalar code that can differ in the last bit, so Adam matches
bitwise when the shard and weight-decay boundaries are multiples of the vector width (true for
usual layer sizes) and otherwise to an ulp in those few elements.

The weight and gradient buffers are padded to ``w * s`` elements (``RankWeights(shards=w)``), so
rank r's range is the r-th of w equal pieces of the padded storage and the collectives run on the
buffers themselves: the all-gather in place, the reduce-scatter into an ``s``-element scratch that
is copied into the rank's own range (gloo's in-place reduce-scatter is wrong for w > 2). On gloo
both are all-reduces of the whole buffer instead, which gloo runs several times faster.

A stage cut into segments by reduction domain (:mod:`.segments`) has one layout per segment, over its
domain's group: the ranges above are then of the segment, and its padding is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import CKPT_GATHER_CHUNK

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

    def own(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's ``size``-element range of a padded buffer (``w * size`` elements): a view."""
        return padded[self.rank * self.size:(self.rank + 1) * self.size]

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


def _block(work) -> None:
    work.wait()


def _gloo(group) -> bool:
    """gloo's reduce-scatter and all-gather are several times slower than its all-reduce of the whole
    buffer (about 10x and 5x for 8 MB on two CPU processes), so on gloo both are all-reduces."""
    return dist.get_backend(group) == "gloo"


def reduce_scatter(padded: torch.Tensor, layout: ShardLayout, group, scratch: torch.Tensor,
                   wait: Callable = _block) -> None:
    """This rank's range of ``padded`` = the sum over ``group`` of every rank's copy of that range; the
    other ranges are unspecified afterwards (nothing reads them). ``scratch``: ``size`` elements of
    ``padded``'s dtype. ``wait`` settles the collective's work handle (the reducer's ``settle``)."""
    if _gloo(group):
        wait(dist.all_reduce(padded, group=group, async_op=True))
        return
    wait(_reduce_scatter(scratch, padded, group=group, async_op=True))
    layout.own(padded).copy_(scratch)


def all_gather(padded: torch.Tensor, layout: ShardLayout, group, wait: Callable = _block) -> None:
    """In place: every other rank's range of ``padded`` = that rank's own range of its copy. On gloo the
    other ranges are zeroed and the buffer all-reduced: x + 0 + ... + 0 is x exactly (up to a zero's sign)."""
    if _gloo(group):
        lo, hi = layout.rank * layout.size, (layout.rank + 1) * layout.size
        padded[:lo].zero_()
        padded[hi:].zero_()
        wait(dist.all_reduce(padded, group=group, async_op=True))
        return
    wait(_all_gather(padded, layout.own(padded), group=group, async_op=True))


GATHER_CHUNK = CKPT_GATHER_CHUNK  # elements per message of :func:`gather_full` to one rank: 64 MiB of fp32


def gather_full(shard: torch.Tensor, layout: ShardLayout, group, everywhere: bool = True) -> torch.Tensor | None:
    """The whole-buffer tensor (``numel`` elements, on the CPU) whose shards the ranks of ``group`` hold:
    on every rank, or (``everywhere`` False) on the group's first rank only (None on the others).

    ``everywhere`` False (checkpoint saves) assembles the result in host memory: each rank's shard
    travels in pieces of at most :data:`GATHER_CHUNK` elements through one reused buffer on the
    shard's device (none on the CPU, where a piece lands in the result directly), so the first rank's
    device holds no copy of the whole state (gpu-review C4)."""
    if everywhere:
        out = shard.new_empty(layout.w * layout.size)
        _all_gather(out, shard.contiguous(), group=group)
        return out[:layout.numel].cpu()
    s, first = layout.size, dist.get_global_rank(group, 0)
    pieces = [(a, min(a + GATHER_CHUNK, s)) for a in range(0, s, GATHER_CHUNK)]
    gloo = _gloo(group)

    def p2p(op, tensor: torch.Tensor, peer: int) -> None:
        """NCCL: a one-op batch, on the group's communicator (a bare send/recv would make a two-rank
        communicator per pair at the first save, hundreds of MB of device memory each)."""
        if gloo:
            (dist.send if op is dist.isend else dist.recv)(tensor, peer, group=group)
            return
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group=group)]):
            work.wait()

    if layout.rank != 0:
        for a, b in pieces:
            p2p(dist.isend, shard[a:b].contiguous(), first)
        return None
    out = torch.empty(layout.w * s, dtype=shard.dtype, device="cpu")
    out[:s].copy_(shard)
    on_cpu = shard.device.type == "cpu"
    buf = None if on_cpu else torch.empty(min(GATHER_CHUNK, s), dtype=shard.dtype, device=shard.device)
    for r in range(1, layout.w):
        src = dist.get_global_rank(group, r)
        for a, b in pieces:
            dst = out[r * s + a:r * s + b]
            if on_cpu:
                p2p(dist.irecv, dst, src)
            else:
                p2p(dist.irecv, buf[:b - a], src)
                dst.copy_(buf[:b - a])
    return out[:layout.numel]
