"""The ``p2p`` context-parallel core: keys and values passed round the ring, softmax merged exactly.

Forward: ``c`` steps; at each, the next hop's transfer is posted before the blocks at hand are computed
(query chunk x key chunk; blocks wholly in a query's future skipped), each block on a kernel that returns
its log-sum-exp (``blocks.py``: torch's fused flash kernels on the CPU and CUDA; the written-out core in
query-row tiles where none applies, so no ``n x n`` block exists). Each query row keeps one log-sum-exp,
and the blocks' partial softmaxes are merged exactly in fp32. It saves only what a fused kernel saves:
this rank's q, k, v, the output and the log-sum-exp per row (and, with dropout, each block's replay
state), so its activations fall as 1/c. Backward, as ring-attention does it: the keys and values go round
again, each step's hop posted before its blocks are computed, and their gradients' accumulators follow
one hop behind; one last hop brings each rank its own keys' and values' gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import BlockMask, block_backward, block_forward, block_kernel
from .group import CPGroup, is_document_ids


def block_mask(mask: torch.Tensor | None, i: int, qc: int, kc: int, n: int, causal: bool) -> BlockMask | None:
    """The mask of query chunk ``qc`` (local index ``i``) against key chunk ``kc`` (chunks of ``n``
    tokens); None when the block lies wholly in the queries' future. ``mask``: None, documents' ids
    ``[b, s]``, a key mask ``[b, 1, 1, s]`` or this rank's rows of a per-query mask ``[b, 1, 2n, s]``."""
    if causal and kc > qc:
        return None
    cols = slice(kc * n, (kc + 1) * n)
    edge = {"causal": causal and kc == qc, "q_off": qc * n, "k_off": kc * n}
    if mask is None:
        return BlockMask(**edge)
    if is_document_ids(mask):
        return BlockMask(**edge, q_doc=mask[:, qc * n:(qc + 1) * n], k_doc=mask[:, cols])
    if mask.shape[-2] == 1:
        return BlockMask(**edge, keys=mask[..., cols])
    return BlockMask(**edge, rows=mask[..., i * n:(i + 1) * n, cols])


def _exchange(cp: CPGroup, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], list]:
    """Post ``tensors`` to the next ring member and receives of the same from the previous one."""
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), cp.next, cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, cp.prev, cp.group) for r in recv]
    return recv, dist.batch_isend_irecv(ops)


def _wait(*works: list) -> None:
    """Settle the transfers and drop their handles (a handle keeps its tensors alive until released)."""
    for group in works:
        for work in group:
            work.wait()
        group.clear()


def _visible(cp: CPGroup, step: int, mask, causal: bool, n: int):
    """The blocks of ring step ``step``: (query chunk i, key chunk j, the block's mask) of every visible one."""
    src = cp.chunks_of((cp.rank - step) % cp.size)
    for i, qc in enumerate(cp.chunks):
        for j, kc in enumerate(src):
            bm = block_mask(mask, i, qc, kc, n, causal)
            if bm is not None:
                yield i, j, bm


def _ring_forward(cp: CPGroup, q, k, v, mask, p: float, causal: bool, kernel: str):
    """(output fp32 ``[b, a, 2n, d]``, log-sum-exp ``[b, a, 2n]``, the blocks' replay states)."""
    n = q.shape[2] // 2
    outs: list = [None, None]
    lses: list = [None, None]
    states: list = []
    kv = torch.stack([k, v])
    for step in range(cp.size):
        nxt, works = _exchange(cp, kv) if step < cp.size - 1 else ([kv], [])
        for i, j, bm in _visible(cp, step, mask, causal, n):
            cols = slice(j * n, (j + 1) * n)
            o, lse, state = block_forward(q[:, :, i * n:(i + 1) * n], kv[0][:, :, cols], kv[1][:, :, cols], bm, p,
                                          kernel)
            states.append(state)
            if outs[i] is None:
                outs[i], lses[i] = o, lse
            else:
                new = torch.logaddexp(lses[i], lse)
                outs[i].mul_(torch.exp(lses[i] - new)[..., None])
                outs[i].add_(o.mul_(torch.exp(lse - new)[..., None]))
                lses[i] = new
            del o
        _wait(works)
        kv = nxt[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), states


def _ring_backward(cp: CPGroup, q, k, v, out, lse, dout, mask, p: float, causal: bool, kernel: str, states: list):
    """(dq, dk, dv) in fp32: the keys and values go round again (each hop posted before the step's blocks),
    their gradients' accumulators one hop behind."""
    n = q.shape[2] // 2
    dout = dout.to(q.dtype).contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, dkv = torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    blocks = iter(states)
    for step in range(cp.size):
        nxt, kv_works = _exchange(cp, kv) if step < cp.size - 1 else ([kv], [])
        for i, j, bm in _visible(cp, step, mask, causal, n):
            rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
            gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                        out[:, :, rows], lse[:, :, rows], bm, p, kernel, next(blocks))
            dq[:, :, rows] += gq
            dkv[0][:, :, cols] += gk
            dkv[1][:, :, cols] += gv
            del gq, gk, gv  # not alive beside the hop's receive buffer
        (dkv,), works = _exchange(cp, dkv)  # the last hop brings each rank its own keys' and values' gradients
        _wait(kv_works, works)
        kv = nxt[0]
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, p: float, causal: bool, cp: CPGroup, kernel: str):
        out, lse, states = _ring_forward(cp, q, k, v, mask, p, causal, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.p, ctx.causal, ctx.cp, ctx.states, ctx.kernel = p, causal, cp, states, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.cp, q, k, v, out, lse, dout, mask, ctx.p, ctx.causal, ctx.kernel, ctx.states)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(cp: CPGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   p: float, causal: bool, backend: str = "auto", kernel: str | None = None) -> torch.Tensor:
    """The ``p2p`` core (``q [b, a, 2n, d]``, ``k, v [b, g, 2n, d]``, this rank's two chunks); ``mask`` (if
    any): documents' ids ``[b, s]``, or a mask whose key columns are whole; ``causal``: the model's, which
    skips the key blocks in a query's future. ``kernel`` overrides ``blocks.block_kernel``'s choice by
    ``backend`` (a benchmark's side-by-side run)."""
    kernel = kernel or block_kernel(q, p, backend, masked=mask is not None)
    return _RingAttention.apply(q, k, v, mask, p, causal, cp, kernel)
