"""Attention over a sequence sharded by context parallelism (``--cp-comm-type``).

Each rank holds queries, keys and values of its two chunks (``group.py``). ``all_gather`` gathers every
rank's keys and values (backward: a reduce-scatter of their gradients), puts them in sequence order and
runs the ordinary core once per local chunk against the keys up to that chunk's end (causal: the
bottom-right aligned mask), so the fused kernels do the work. ``p2p`` passes the keys and values round the
ring, ``c - 1`` hops, each hop's transfer posted before the blocks at hand are computed; it keeps one
log-sum-exp per query row and merges the blocks' partial softmaxes exactly (blocks wholly in a query's
future are skipped). Its blocks are computed in fp32 with the core written out (no public fused kernel
returns the log-sum-exp it needs) and recomputed in backward, so like a fused kernel it keeps only the
block's inputs and its output and log-sum-exp, never the ``[b, a, L, L]`` scores (the price: the blocks'
forward runs twice).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tensor_parallel.mappings import gather_seq
from ..tensor_parallel.recompute import checkpointed
from .group import CPGroup

_MASKED = -1e30  # finite: a query row with no visible key in one block weighs zero in the merge, never NaN


def _global_order(c: int, n: int, device: torch.device) -> torch.Tensor:
    """Indices taking the gathered keys (rank 0's two chunks, rank 1's, ...) into sequence order."""
    offset = [0] * (2 * c)
    for r in range(c):
        offset[r], offset[2 * c - 1 - r] = 2 * r * n, (2 * r + 1) * n
    return torch.cat([torch.arange(o, o + n, device=device) for o in offset])  # 2c ranges: no per-element loop


def _gather_kv(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """``[b, g, 2L, d]`` of every rank -> ``[b, g, s, d]`` in sequence order."""
    full = gather_seq(x.transpose(1, 2), cp).transpose(1, 2)  # [b, g, c*2L, d] in rank order
    return full.index_select(2, _global_order(cp.size, x.shape[2] // 2, x.device))


def _mask_rows(mask: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Rows ``lo:hi`` of a per-query mask (a key-only mask ``[b, 1, 1, s]`` applies to every row)."""
    return None if mask is None or mask.shape[-2] == 1 else mask[..., lo:hi, :]


def all_gather_attention(cp: CPGroup, core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """``core(q, k, v, mask, causal)`` is the model's attention core, ``causal`` with more keys than queries
    meaning the queries are the last of the keys' prefix; ``mask`` (which holds causality itself when given)
    keeps its columns whole."""
    kg, vg = _gather_kv(k, cp), _gather_kv(v, cp)
    if not causal:
        return core(q, kg, vg, mask, False)
    n = q.shape[2] // 2
    outs = []
    for j, chunk in enumerate(cp.chunks):
        end = (chunk + 1) * n  # the keys up to this chunk's end: the rest lie in its future
        rows = _mask_rows(mask, j * n, (j + 1) * n)
        rows = mask if rows is None else rows
        outs.append(core(q[:, :, j * n:(j + 1) * n], kg[:, :, :end], vg[:, :, :end],
                         None if rows is None else rows[..., :end], rows is None))
    return torch.cat(outs, dim=2)


class _RingStart(torch.autograd.Function):
    """Post this rank's keys and values to the next ring member and a receive from the previous one;
    the caller waits on ``works`` before reading the result. Backward sends the gradient back the way
    the data came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPGroup, works: list) -> torch.Tensor:
        ctx.cp = cp
        recv = torch.empty_like(x)
        works += dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), cp.next, cp.group),
                                         dist.P2POp(dist.irecv, recv, cp.prev, cp.group)])
        return recv

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cp = ctx.cp
        gx = torch.empty_like(g)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, g.contiguous(), cp.prev, cp.group),
                                            dist.P2POp(dist.irecv, gx, cp.next, cp.group)]):
            work.wait()
        return gx, None, None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
           p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(d)) v, log-sum-exp per row) of one block, fp32; grouped-query heads as the
    unfused core groups them (no copy of k or v per query head)."""
    b, a, n, d = q.shape
    g, m = k.shape[1], k.shape[2]
    scores = torch.matmul(q.float().reshape(b, g, (a // g) * n, d), k.float().transpose(-1, -2)).view(b, a, n, m)
    scores = scores * (1.0 / math.sqrt(d))
    if keep is not None:
        scores = scores.masked_fill(~keep, _MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    probs = F.dropout(torch.exp(scores - lse[..., None]), p, p > 0)
    return torch.matmul(probs.view(b, g, (a // g) * n, m), v.float()).view(b, a, n, d), lse


def _merge(acc: tuple | None, new: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results of the same queries over disjoint keys, combined exactly."""
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None], lse


def _block_keep(cp: CPGroup, mask: torch.Tensor | None, i: int, qc: int, kc: int, n: int,
                causal: bool, device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """(whether query chunk ``qc`` sees key chunk ``kc`` at all, the block's mask)."""
    if causal and kc > qc:
        return False, None
    keep = torch.ones(n, n, dtype=torch.bool, device=device).tril() if causal and kc == qc and mask is None else None
    if mask is not None:
        rows = _mask_rows(mask, i * n, (i + 1) * n)
        keep = (mask if rows is None else rows)[..., kc * n:(kc + 1) * n]
    return True, keep


def ring_attention(cp: CPGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   p: float, causal: bool) -> torch.Tensor:
    """The ``p2p`` core; ``mask`` (if any) holds causality itself and keeps its columns whole."""
    n = q.shape[2] // 2
    acc: list = [None, None]
    kv = torch.stack([k, v])
    for step in range(cp.size):
        works: list = []
        nxt = _RingStart.apply(kv, cp, works) if step < cp.size - 1 else None
        src_chunks = cp.chunks_of((cp.rank - step) % cp.size)
        for i, qc in enumerate(cp.chunks):
            for j, kc in enumerate(src_chunks):
                visible, keep = _block_keep(cp, mask, i, qc, kc, n, causal, q.device)
                if visible:
                    part = checkpointed(_block, q[:, :, i * n:(i + 1) * n], kv[0][:, :, j * n:(j + 1) * n],
                                        kv[1][:, :, j * n:(j + 1) * n], keep, p, tracker=None)
                    acc[i] = _merge(acc[i], part)
        for work in works:
            work.wait()
        kv = nxt if nxt is not None else kv
    return torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
