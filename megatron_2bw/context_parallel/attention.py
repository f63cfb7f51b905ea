"""Attention over a sequence sharded by context parallelism (``--cp-comm-type``).

Each rank holds queries, keys and values of its two chunks (``group.py``). ``all_gather`` gathers every
rank's keys and values (backward: a reduce-scatter of their gradients), puts them in sequence order and
runs the ordinary core once per local chunk against the keys up to that chunk's end (causal: the
bottom-right aligned mask), so the fused kernels do the work. Documents (their ids ``[b, s]``) run each
chunk as one block of ``blocks.py``, whose tiles build the chunk's mask rows ``[n, prefix]`` a tile at a
time. ``p2p`` is the ring (``ring.py``).
"""

from __future__ import annotations

import torch

from ..tensor_parallel.mappings import gather_seq
from .blocks import BlockMask, block_attention
from .group import CPGroup, is_document_ids, mask_rows, sequence_order
from .ring import ring_attention

__all__ = ["all_gather_attention", "ring_attention"]


def _gather_kv(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """``[b, g, 2L, d]`` of every rank -> ``[b, g, s, d]`` in sequence order."""
    full = gather_seq(x.transpose(1, 2), cp).transpose(1, 2)  # [b, g, c*2L, d] in rank order
    return full.index_select(2, sequence_order(cp.size, x.shape[2] // 2, x.device))


def all_gather_attention(cp: CPGroup, backend: str, dense, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None, p: float, causal: bool) -> torch.Tensor:
    """``dense(q, k, v, mask, p, causal)`` is the model's attention core, ``causal`` with more keys than
    queries meaning the queries are the last of the keys' prefix; ``mask`` (documents' ids, or a mask that
    holds causality itself and keeps its columns whole)."""
    kg, vg = _gather_kv(k, cp), _gather_kv(v, cp)
    if not causal:
        return dense(q, kg, vg, mask, p, False)
    n = q.shape[2] // 2
    outs = []
    for j, chunk in enumerate(cp.chunks):
        end = (chunk + 1) * n  # the keys up to this chunk's end: the rest lie in its future
        qj, kj, vj = q[:, :, j * n:(j + 1) * n], kg[:, :, :end], vg[:, :, :end]
        if is_document_ids(mask):
            bm = BlockMask(True, chunk * n, 0, mask[:, chunk * n:end], mask[:, :end])
            outs.append(block_attention(qj, kj, vj, bm, p, backend))
            continue
        rows = mask_rows(mask, j * n, (j + 1) * n)
        outs.append(dense(qj, kj, vj, None if rows is None else rows[..., :end], p, rows is None))
    return torch.cat(outs, dim=2)
