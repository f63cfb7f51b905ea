"""``--cp-comm-type a2a``: attention heads scattered over the context group (all-to-all, as Megatron's
``a2a`` and DeepSpeed-Ulysses do).

Each rank holds all heads of its two chunks. One all-to-all per tensor trades that for ``1/c`` of the heads
over the whole sequence (keys and values likewise, by key/value group), so the ordinary core, fused
kernels included, runs once on the whole sequence with the plain causal mask; a second all-to-all brings
each rank its chunks of every head's output. Backward is the same exchanges reversed (an all-to-all is its
own adjoint). Needs the heads and key/value groups of a tensor rank divisible by c (checked at start-up,
``ModelConfig.check_context_parallel``). Documents (ids ``[b, s]``, whole on every rank) need no exchange:
the head group's core runs as one block of ``blocks.py``, whose tiles build the mask a few rows at a time;
another per-query mask's rows are gathered (it is not differentiated).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import BlockMask, block_attention
from .group import CPGroup, is_document_ids, rank_order

__all__ = ["a2a_attention"]


class _AllToAll(torch.autograd.Function):
    """Block ``i`` of dim 0 goes to context rank ``i``; block ``i`` of the result came from rank ``i``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
        ctx.cp = cp
        return _exchange(x, cp)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _exchange(g, ctx.cp), None


def _exchange(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=cp.group)
    return out


def _to_sequence(x: torch.Tensor, cp: CPGroup, to_seq: torch.Tensor) -> torch.Tensor:
    """``[b, n, 2L, d]`` (all ``n`` heads, local chunks) -> ``[b, n/c, s, d]`` (this rank's heads, in sequence
    order)."""
    b, n, l2, d = x.shape
    c = cp.size
    blocks = x.reshape(b, c, n // c, l2, d).transpose(0, 1)  # block i: head group i, for rank i
    got = _AllToAll.apply(blocks, cp)  # block i: this rank's head group, rank i's chunks
    full = got.permute(1, 2, 0, 3, 4).reshape(b, n // c, c * l2, d)
    return full.index_select(2, to_seq)


def _to_chunks(y: torch.Tensor, cp: CPGroup, to_ranks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_sequence`: ``[b, n/c, s, d]`` -> ``[b, n, 2L, d]``."""
    b, h, s, d = y.shape
    c = cp.size
    blocks = y.index_select(2, to_ranks).reshape(b, h, c, s // c, d).permute(2, 0, 1, 3, 4)  # block i: rank i's chunks
    got = _AllToAll.apply(blocks, cp)  # block i: head group i, this rank's chunks
    return got.transpose(0, 1).reshape(b, c * h, s // c, d)


def _gather_rows(mask: torch.Tensor, cp: CPGroup, to_seq: torch.Tensor) -> torch.Tensor:
    """Every rank's query rows of a per-query mask ``[b, 1, 2L, s]``, in sequence order."""
    parts = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(cp.size)]
    dist.all_gather(parts, mask.to(torch.uint8).contiguous(), group=cp.group)
    return torch.cat(parts, dim=-2).index_select(-2, to_seq).to(mask.dtype)


def a2a_attention(cp: CPGroup, backend: str, dense, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, p: float, causal: bool) -> torch.Tensor:
    """``dense(q, k, v, mask, p, causal)`` (the model's attention core) over the whole sequence for ``1/c`` of
    the heads; ``mask``: documents' ids, or a mask that holds causality itself and keeps its columns whole."""
    to_ranks = rank_order(cp.size, q.shape[2] // 2, q.device)
    to_seq = to_ranks.argsort()
    qf, kf, vf = (_to_sequence(x, cp, to_seq) for x in (q, k, v))
    if is_document_ids(mask):
        out = block_attention(qf, kf, vf, BlockMask(causal, q_doc=mask, k_doc=mask), p, backend)
        return _to_chunks(out, cp, to_ranks)
    if mask is not None and mask.shape[-2] > 1:
        mask = _gather_rows(mask, cp, to_seq)
    return _to_chunks(dense(qf, kf, vf, mask, p, causal and mask is None), cp, to_ranks)
