"""One block of attention (queries against keys) that returns its log-sum-exp, on a fused kernel where one applies.

The ring (``ring.py``) merges blocks by their log-sum-exp, so each block needs ``(out, lse)`` and a backward
that takes the merged output's ``lse``. Kernels that return both (:func:`block_kernel` picks one):

- ``cpu``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (torch >= 2.3; no dropout;
  grouped heads and an additive mask of the query's dtype taken as they are);
- ``cuda-flash``: ``aten._scaled_dot_product_flash_attention`` and its backward (fp16/bf16, head dim <= 256
  and a multiple of 8, sm80+; dropout replayed by the kernel's own Philox state; no mask);
- ``written``: the core written out in fp32 (``--attention-backend unfused``/``local``, CPU dropout, a CUDA
  block with a mask, any other device or dtype); dropout replayed from each tile's saved generator state.

A block with a mask the kernel cannot take whole (documents, a per-query mask, a causal edge not on the
block's diagonal) and every ``written`` block runs in tiles of at most :data:`TILE_ROWS` query rows, so no
``[nq, nk]`` tensor (the ring's ``n x n``) exists: each tile builds its mask rows from the documents' ids
(:class:`BlockMask`), forward and again in backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..tensor_parallel.recompute import RNGSnapshot

MASKED = -1e30  # finite: a query row with no visible key in a block weighs zero in the merge, never NaN
TILE_ROWS = 512  # query rows per tile: a tile's fp32 scores are b * heads * TILE_ROWS * nk elements
_CPU_OP = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockMask:
    """What hides a block's keys from its queries, as small tensors (never an ``[nq, nk]`` one).

    ``causal``: query ``q_off + i`` sees key ``k_off + j`` only when ``q_off + i >= k_off + j`` (global
    positions); ``q_doc [b, nq]`` / ``k_doc [b, nk]``: document ids (a query sees its own document's keys);
    ``keys [b, 1, 1, nk]``: a key mask (padding); ``rows [b, 1, nq, nk]``: a per-query mask given whole."""

    causal: bool = False
    q_off: int = 0
    k_off: int = 0
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    @property
    def diagonal(self) -> bool:
        """Causal on the block's diagonal (top-left aligned): what a kernel's ``is_causal`` takes."""
        return self.causal and self.q_off == self.k_off

    @property
    def tiled(self) -> bool:
        """Whether the kernel needs the mask in tiles (anything beyond a diagonal causal edge)."""
        return (self.q_doc is not None or self.keys is not None or self.rows is not None
                or (self.causal and not self.diagonal))

    def keep(self, lo: int, hi: int, nk: int, device: torch.device) -> torch.Tensor | None:
        """Boolean ``[b or 1, 1, hi - lo, nk]`` of query rows ``lo:hi`` (True: attend); None when all attend."""
        keep = None
        if self.causal:
            q = torch.arange(self.q_off + lo, self.q_off + hi, device=device)
            keep = (q[:, None] >= torch.arange(self.k_off, self.k_off + nk, device=device)[None, :])[None, None]
        if self.q_doc is not None:
            same = (self.q_doc[:, lo:hi, None] == self.k_doc[:, None, :])[:, None]
            keep = same if keep is None else keep & same
        for extra in (self.keys, None if self.rows is None else self.rows[..., lo:hi, :]):
            if extra is not None:
                keep = extra if keep is None else keep & extra
        return keep


def block_kernel(q: torch.Tensor, p: float, backend: str, masked: bool = False) -> str:
    """The kernel of a block (module docstring): ``cpu``, ``cuda-flash`` or ``written``."""
    if backend in ("unfused", "local"):
        return "written"
    if q.device.type == "cpu":
        ok = p == 0 and q.dtype in _CPU_DTYPES and hasattr(torch.ops.aten, _CPU_OP)
        return "cpu" if ok else "written"
    if q.device.type == "cuda" and not masked and _cuda_flash_ok(q):
        return "cuda-flash"
    return "written"


def _cuda_flash_ok(q: torch.Tensor) -> bool:
    """Flash-attention 2's own limits (dtype, head dim, sm80+), probed without running it."""
    d = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def tile_rows(nq: int) -> int:
    return max(1, min(nq, TILE_ROWS))


def _bias(keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean keep-mask as the additive mask the kernels take (their query's dtype)."""
    if keep is None:
        return None
    return torch.where(keep, torch.zeros((), dtype=dtype, device=keep.device),
                       torch.full((), MASKED, dtype=dtype, device=keep.device))


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, a, n, m]`` -> ``[b, g, (a/g) n, m]``: a group's query rows stacked against its one key matrix."""
    b, a, n, m = x.shape
    return x.reshape(b, g, (a // g) * n, m)


def _expand(x: torch.Tensor, a: int) -> torch.Tensor:
    """Key/value groups repeated to ``a`` heads (group-major), for kernels that take no grouped heads."""
    return x if x.shape[1] == a else x.repeat_interleave(a // x.shape[1], dim=1)


def block_forward(q, k, v, mask: BlockMask, p: float, kernel: str):
    """(output fp32 ``[b, a, nq, d]``, log-sum-exp fp32 ``[b, a, nq]``, the replay state backward needs)."""
    if kernel == "cpu" and not mask.tiled:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, mask.diagonal)
        return out.float(), lse.float(), None
    if kernel == "cuda-flash":
        a = q.shape[1]
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, a), _expand(v, a), p, mask.diagonal)
        return res[0].float(), res[1].float(), res[2:8]
    b, a, nq, d = q.shape
    out = torch.empty((b, a, nq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, a, nq), dtype=torch.float32, device=q.device)
    states = []
    for lo in range(0, nq, tile_rows(nq)):
        hi = min(nq, lo + tile_rows(nq))
        keep = mask.keep(lo, hi, k.shape[2], q.device)
        if kernel == "cpu":
            o, lt = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, lo:hi], k, v, 0.0, False, attn_mask=_bias(keep, q.dtype))
        else:
            o, lt, state = _written_forward(q[:, :, lo:hi], k, v, keep, p)
            states.append(state)
        out[:, :, lo:hi], lse[:, :, lo:hi] = o, lt
        del o, lt, keep
    return out, lse, states


def block_backward(dout, q, k, v, out, lse, mask: BlockMask, p: float, kernel: str, state):
    """(dq, dk, dv) of one block, given the merged output ``out`` (q's dtype), its ``lse`` and ``dout``."""
    if kernel == "cpu" and not mask.tiled:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_lse_dtype(q)), 0.0, mask.diagonal)
    if kernel == "cuda-flash":
        a, g = q.shape[1], k.shape[1]
        cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, _expand(k, a), _expand(v, a), out, lse, cum_q, cum_k, max_q, max_k, p, mask.diagonal, seed, offset)
        if g != a:  # the repeated heads' gradients summed back onto their group
            dk, dv = (x.view(x.shape[0], g, a // g, *x.shape[2:]).sum(2) for x in (dk, dv))
        return dq, dk, dv
    nq = q.shape[2]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    tiles = iter(state or ())
    for lo in range(0, nq, tile_rows(nq)):
        hi = min(nq, lo + tile_rows(nq))
        keep = mask.keep(lo, hi, k.shape[2], q.device)
        rows = slice(lo, hi)
        if kernel == "cpu":
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows].to(_lse_dtype(q)), 0.0,
                False, attn_mask=_bias(keep, q.dtype))
        else:
            gq, gk, gv = _written_backward(dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows],
                                           keep, p, next(tiles, None))
        dq[:, :, rows] = gq
        dk += gk
        dv += gv
        del gq, gk, gv  # not alive beside the next tile's
    return dq, dk, dv


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``q k^T / sqrt(d)`` of one tile in fp32 ``[b, a, n, m]``, masked; grouped-query heads without a copy."""
    b, a, n, d = q.shape
    g, m = k.shape[1], k.shape[2]
    s = torch.matmul(q.float().reshape(b, g, (a // g) * n, d), k.float().transpose(-1, -2)).view(b, a, n, m)
    s = s.mul_(1.0 / math.sqrt(d))
    return s if keep is None else s.masked_fill_(~keep, MASKED)


def _replayed_mask(shape: torch.Size, p: float, state: RNGSnapshot, device: torch.device) -> torch.Tensor:
    """The forward's scaled dropout keep-mask of one tile, drawn again from its saved generator state
    (the generator itself left as it was)."""
    now = RNGSnapshot.capture(device, None)
    state.restore(device, None)
    try:
        return F.dropout(torch.ones(shape, device=device), p, True)
    finally:
        now.restore(device, None)


def _written_forward(q, k, v, keep, p: float):
    """One tile of the written-out core: (output fp32, log-sum-exp, the dropout draw's generator state)."""
    (b, a, n, d), g = q.shape, k.shape[1]
    s = _scores(q, k, keep)
    lse = torch.logsumexp(s, dim=-1)
    probs = s.sub_(lse[..., None]).exp_()
    state = None
    if p > 0:
        state = RNGSnapshot.capture(q.device, None)
        probs = probs * F.dropout(torch.ones_like(probs), p, True)
    return torch.matmul(_grouped(probs, g), v.float()).view(b, a, n, d), lse, state


def _written_backward(dout, q, k, v, out, lse, keep, p: float, state):
    """One tile's (dq, dk, dv) in fp32, its probabilities recomputed from the merged log-sum-exp."""
    (b, a, n, d), g = q.shape, k.shape[1]
    dout = dout.float()
    delta = (dout * out.float()).sum(-1)  # rowsum(dO * O): the softmax backward's correction
    probs = _scores(q, k, keep).sub_(lse[..., None]).exp_()
    drop = _replayed_mask(probs.shape, p, state, q.device) if p > 0 else None
    used = probs if drop is None else probs * drop
    do = _grouped(dout, g)
    dv = torch.matmul(_grouped(used, g).transpose(-1, -2), do)
    del used
    dp = torch.matmul(do, v.float().transpose(-1, -2)).view(b, a, n, k.shape[2])
    if drop is not None:
        dp.mul_(drop)
        del drop
    ds = probs.mul_(dp.sub_(delta[..., None])).mul_(1.0 / math.sqrt(d))
    del dp
    dq = torch.matmul(_grouped(ds, g), k.float()).view(b, a, n, d)
    dk = torch.matmul(_grouped(ds, g).transpose(-1, -2), _grouped(q.float(), g))
    return dq, dk, dv


class _BlockAttention(torch.autograd.Function):
    """One block as an autograd function: saves q, k, v, the output and its log-sum-exp (no mask, no scores)."""

    @staticmethod
    def forward(ctx, q, k, v, mask: BlockMask, p: float, kernel: str):
        out, lse, state = block_forward(q, k, v, mask, p, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.p, ctx.kernel, ctx.state = mask, p, kernel, state
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.to(q.dtype).contiguous(), q, k, v, out, lse, ctx.mask, ctx.p, ctx.kernel,
                                    ctx.state)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, p: float,
                    backend: str) -> torch.Tensor:
    """Attention of ``q [b, a, nq, d]`` against ``k, v [b, g, nk, d]`` under ``mask``, tiled where the mask
    needs it: what all_gather and a2a run for documents, whose whole mask would be ``[nq, nk]``."""
    return _BlockAttention.apply(q, k, v, mask, p, block_kernel(q, p, backend, masked=mask.tiled))
