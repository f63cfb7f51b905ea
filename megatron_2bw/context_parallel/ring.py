"""The ``p2p`` context-parallel core: keys and values passed round the ring, softmax merged exactly.

Forward: ``c`` steps; at each, the next hop's transfer is posted before the blocks at hand are computed
(query chunk x key chunk, fp32, the core written out: no public fused kernel returns the log-sum-exp a
merge needs; blocks wholly in a query's future skipped). Each query row keeps one log-sum-exp, and the
blocks' partial softmaxes are merged exactly. It saves only what a fused kernel saves: this rank's q, k,
v, the output and the log-sum-exp per row (and, with dropout, each block's generator state), so its
activations fall as 1/c. Backward, as ring-attention does it: the keys and values go round again with
their gradients' accumulators beside them; each block's probabilities are recomputed from the saved
log-sum-exp, and one last hop brings each rank its own keys' and values' gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tensor_parallel.recompute import RNGSnapshot
from .group import CPGroup, mask_rows

_MASKED = -1e30  # finite: a query row with no visible key in one block weighs zero in the merge, never NaN


def block_keep(mask: torch.Tensor | None, i: int, qc: int, kc: int, n: int, causal: bool,
               device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """(whether query chunk ``qc`` sees key chunk ``kc`` at all, the block's mask); ``i`` is the query
    chunk's local index (its rows of a per-query mask)."""
    if causal and kc > qc:
        return False, None
    keep = torch.ones(n, n, dtype=torch.bool, device=device).tril() if causal and kc == qc and mask is None else None
    if mask is not None:
        keep = mask_rows(mask, i * n, (i + 1) * n)[..., kc * n:(kc + 1) * n]
    return True, keep


def _scores(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``q k^T / sqrt(d)`` of one block in fp32 ``[b, a, n, m]``, masked; grouped-query heads as the unfused
    core groups them (no copy of k per query head)."""
    b, a, n, d = q.shape
    g, m = k.shape[1], k.shape[2]
    s = torch.matmul(q.float().reshape(b, g, (a // g) * n, d), k.float().transpose(-1, -2)).view(b, a, n, m)
    s = s * (1.0 / math.sqrt(d))
    return s if keep is None else s.masked_fill(~keep, _MASKED)


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, a, n, m]`` -> ``[b, g, (a/g) n, m]``: a group's query rows stacked against its one key matrix."""
    b, a, n, m = x.shape
    return x.reshape(b, g, (a // g) * n, m)


def _replayed_mask(shape: torch.Size, p: float, state: RNGSnapshot, device: torch.device) -> torch.Tensor:
    """The forward's scaled dropout keep-mask of one block, drawn again from its saved generator state
    (the generator itself left as it was)."""
    now = RNGSnapshot.capture(device, None)
    state.restore(device, None)
    try:
        return F.dropout(torch.ones(shape, device=device), p, True)
    finally:
        now.restore(device, None)


def _exchange(cp: CPGroup, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], list]:
    """Post ``tensors`` to the next ring member and receives of the same from the previous one."""
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), cp.next, cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, cp.prev, cp.group) for r in recv]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _visible(cp: CPGroup, step: int, mask, causal: bool, n: int, device: torch.device):
    """The blocks of ring step ``step``: (query chunk i, key chunk j, the block's mask) of every visible one."""
    src = cp.chunks_of((cp.rank - step) % cp.size)
    for i, qc in enumerate(cp.chunks):
        for j, kc in enumerate(src):
            seen, keep = block_keep(mask, i, qc, kc, n, causal, device)
            if seen:
                yield i, j, keep


def _ring_forward(cp: CPGroup, q, k, v, mask, p: float, causal: bool):
    """(output fp32 ``[b, a, 2n, d]``, log-sum-exp ``[b, a, 2n]``, the blocks' generator states)."""
    (b, a, n2, d), g = q.shape, k.shape[1]
    n = n2 // 2
    outs: list = [None, None]
    lses: list = [None, None]
    states: list = []
    kv = torch.stack([k, v])
    for step in range(cp.size):
        nxt, works = _exchange(cp, kv) if step < cp.size - 1 else ([kv], [])
        for i, j, keep in _visible(cp, step, mask, causal, n, q.device):
            s = _scores(q[:, :, i * n:(i + 1) * n], kv[0][:, :, j * n:(j + 1) * n], keep)
            lse = torch.logsumexp(s, dim=-1)
            probs = torch.exp(s - lse[..., None])
            if p > 0:
                states.append(RNGSnapshot.capture(q.device, None))
                probs = probs * F.dropout(torch.ones_like(probs), p, True)
            o = torch.matmul(_grouped(probs, g), kv[1][:, :, j * n:(j + 1) * n].float()).view(b, a, n, d)
            if outs[i] is None:
                outs[i], lses[i] = o, lse
            else:
                new = torch.logaddexp(lses[i], lse)
                outs[i] = outs[i] * torch.exp(lses[i] - new)[..., None] + o * torch.exp(lse - new)[..., None]
                lses[i] = new
        _wait(works)
        kv = nxt[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2), states


def _ring_backward(cp: CPGroup, q, k, v, out, lse, dout, mask, p: float, causal: bool, states: list):
    """(dq, dk, dv) in fp32: the keys and values go round again, their gradients' accumulators beside them."""
    (b, a, n2, d), g = q.shape, k.shape[1]
    n, scale = n2 // 2, 1.0 / math.sqrt(d)
    dout = dout.float()
    delta = (dout * out.float()).sum(-1)  # rowsum(dO * O): the softmax backward's correction
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, dkv = torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    blocks = iter(states)
    for step in range(cp.size):
        for i, j, keep in _visible(cp, step, mask, causal, n, q.device):
            rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
            qi, kj, vj = q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols]
            probs = torch.exp(_scores(qi, kj, keep) - lse[:, :, rows, None])
            drop = _replayed_mask(probs.shape, p, next(blocks), q.device) if p > 0 else None
            used = probs if drop is None else probs * drop
            do = _grouped(dout[:, :, rows], g)
            dkv[1][:, :, cols] += torch.matmul(_grouped(used, g).transpose(-1, -2), do)
            dp = torch.matmul(do, vj.float().transpose(-1, -2)).view(b, a, n, n)
            dp = dp if drop is None else dp * drop
            ds = probs * (dp - delta[:, :, rows, None]) * scale
            dq[:, :, rows] += torch.matmul(_grouped(ds, g), kj.float()).view(b, a, n, d)
            dkv[0][:, :, cols] += torch.matmul(_grouped(ds, g).transpose(-1, -2), _grouped(qi.float(), g))
        if step < cp.size - 1:
            (kv, dkv), works = _exchange(cp, kv, dkv)
        else:  # each rank's own keys' and values' gradients come home
            (dkv,), works = _exchange(cp, dkv)
        _wait(works)
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, p: float, causal: bool, cp: CPGroup):
        out, lse, states = _ring_forward(cp, q, k, v, mask, p, causal)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.p, ctx.causal, ctx.cp, ctx.states = p, causal, cp, states
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.cp, q, k, v, out, lse, dout, mask, ctx.p, ctx.causal, ctx.states)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(cp: CPGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   p: float, causal: bool) -> torch.Tensor:
    """The ``p2p`` core (``q [b, a, 2n, d]``, ``k, v [b, g, 2n, d]``, this rank's two chunks); ``mask`` (if
    any) holds causality itself and keeps its columns whole; ``causal``: the model's, which skips the key
    blocks in a query's future."""
    return _RingAttention.apply(q, k, v, mask, p, causal, cp)
