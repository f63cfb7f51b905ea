"""Muon for the hidden weight matrices, AdamW for the rest, over one flat buffer (``--optimizer muon``).

Muon (Jordan et al. 2024; torch.optim.Muon's rule, which the tests compare against) for each
matrix W of a tensor-parallel linear layer (parameters carrying ``partition_dim``: attention qkv
and output, MLP fc1 and fc2), with gradient G, momentum mu, learning rate lr and weight decay wd::

    B  <- B.lerp(G, 1 - mu)                      (B = mu * B + (1 - mu) * G)
    U  <- G.lerp(B, mu) if nesterov else B
    O  <- NS_k(U)                                 k = --muon-ns-steps Newton-Schulz steps
                                                  (bf16; fp32 on CPUs without bf16)
    W  <- W * (1 - lr * wd) - lr * s(A, B) * O

``NS_k`` is the quintic iteration with the standard coefficients (3.4445, -4.7750, 2.0315) on
U / max(|U|_F, 1e-7), transposed when it has more rows than columns, in bfloat16 exactly as torch
computes it (in fp32 on CPUs without bf16 matrix instructions, where bf16 is slow: :func:`ns_dtype`); ``s`` is
torch's shape scale of the *whole* matrix of A rows and B columns:
``sqrt(max(1, A / B))`` ("original", torch's default) or ``0.2 * sqrt(max(A, B))``
("match_rms_adamw", Moonshot's, under which AdamW's learning rate carries over). The matrices'
learning rate is ``--muon-lr`` (default ``--lr``), following ``--lr``'s schedule in proportion.
Everything else (word, position and token-type embeddings, the tied output layer, norms, biases,
and 2-D weights outside the tensor-parallel layers such as BERT's pooler) gets AdamW with the
``--adam-*`` flags and ``--lr``, decay on 2-D tensors only as with ``--optimizer adam``.

Whole matrices only. A matrix split over the t tensor-parallel ranks (``partition_dim`` 0:
column-parallel rows, 1: row-parallel columns) is orthogonalized as the whole matrix: the ranks
all-gather the split directions U of all such matrices in one collective, each assembles every
whole U, runs NS on it and keeps its own slice, so the update is bitwise the unsplit one (the
same bf16 arithmetic on the same matrix). A distributed Newton-Schulz (all-reducing the t partial
Gram matrices of a column split each iteration) would move 5 k x k matrices instead of one copy
of U and split the flops; benchmarks/muon_throughput.py measures both (docs/training.md).

With the distributed optimizer (a ``shard``: this rank owns ``[lo, hi)`` of the stage's flat
buffer, equal ranges that ignore matrix boundaries) the momentum is sharded like the rest of the
state, and U, computed elementwise on the shard, is exchanged over the data-parallel group
(``gather``, one all-to-all) so that every matrix overlapping the shard can be orthogonalized
whole: each rank receives the direction of exactly those matrices (its shard plus at most the
parts of one matrix on either side that neighbouring ranks hold) and runs NS only for them. The
transient is that range in fp32, not the stage's (gpu-review-2 N9: an all-gather of the whole
stage's U on every rank defeated the sharding); sharding on matrix boundaries instead would make
the shards unequal and break the in-place all-gather and reduce-scatter the distributed optimizer
is built on (:mod:`..pipeline.zero`).

State: ``exp_avg`` over the whole flat buffer (Adam's first moment; Muon's momentum B on the
matrices) and Adam's second moment on the AdamW elements only (kept compact: 4 bytes per Muon
element fewer than AdamW; ``state_spans`` places its views in the flat layout, zeros on the matrices
in a whole tensor, so checkpoints split it by parameter name like every other state tensor, and the
torch_dist format reads straight into those views). Transients per step: one
fp32 buffer of the (shard's) size for U, plus the gathered copies when matrices are split.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .state import FlatState, Span, fused_adamw_available

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
# The Newton-Schulz precision: None picks per device (:func:`ns_dtype`): bf16 on CUDA, torch.optim.Muon's
# precision, and on the CPU bf16 only where it has bf16 matrix instructions (AVX512-BF16, AMX), else fp32: an
# AVX2 CPU emulates bf16 matmuls 7.5x slower than fp32 ones, which made Muon's step 10x AdamW's (issue 45),
# while an AVX512-BF16 one runs them 3-4x faster than fp32. A dtype here overrides the choice. bf16 rounding of U
# makes NS amplify last-bit differences of the gradient (another summation order) into ~1e-3 weight
# differences within a few steps (measured on the tiny GPT), so tests that compare across code paths set
# fp32 on both sides, and the test against torch.optim.Muon sets bf16.
NS_DTYPE: torch.dtype | None = None


def ns_dtype(device: torch.device | str) -> torch.dtype:
    """The Newton-Schulz dtype on ``device``: ``NS_DTYPE``, else bf16 on CUDA and on CPUs with bf16 matrix
    instructions, fp32 on other CPUs (the same on every rank of a machine: replicas stay equal)."""
    if NS_DTYPE is not None:
        return NS_DTYPE
    if torch.device(device).type == "cuda" or cpu_has_bf16_matmul():
        return torch.bfloat16
    return torch.float32


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (the ``avx512_bf16`` or ``amx_bf16`` flag; Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
ADJUST_LR_FNS = ("original", "match_rms_adamw")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class MuonMatrix:
    """One Muon matrix of a stage's flat buffer: where it is, its local shape, the split dimension."""

    offset: int
    shape: tuple[int, int]  # this rank's (local) shape
    split_dim: int | None = None  # dimension split over the tensor-parallel group; None: whole here

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def full_shape(self, t: int) -> tuple[int, int]:
        if self.split_dim is None:
            return self.shape
        a, b = self.shape
        return (a * t, b) if self.split_dim == 0 else (a, b * t)


def zeropower_via_newtonschulz(g: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS,
                               dtype: torch.dtype | None = None):
    """The approximate orthogonalization of ``g``, operation for operation torch.optim.Muon's (``dtype``: its
    precision, default :func:`ns_dtype` of ``g``'s device: bf16 as torch.optim.Muon, fp32 on a CPU without bf16)."""
    a, b, c = coefficients
    x = g.to(dtype or ns_dtype(g.device), copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, fn: str, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's ``_adjust_lr`` of the whole matrix's shape."""
    a, b = shape
    return lr * (math.sqrt(max(1.0, a / b)) if fn == "original" else 0.2 * math.sqrt(max(a, b)))


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged ``[lo, hi)`` spans (adjacent ones joined)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class FlatMuon(FlatState):
    """Muon + AdamW over a flat buffer (or this rank's ``[lo, hi)`` shard of it); see the module docstring.

    ``numel``: elements this optimizer updates (the shard's padded size when sharded); ``total``:
    the stage's flat buffer; ``n_decay``: the stage's decayed prefix (2-D tensors), in stage
    coordinates like ``matrices``. ``tp``: (group, rank, size) of the tensor-parallel group;
    ``gather`` and ``bounds`` (the distributed optimizer): every data-parallel rank's ``[lo, hi)``, and
    ``gather(pieces, send, recv)``, an all-to-all over the data-parallel group (``pieces``: this rank's
    ``send[r]`` elements for rank r, concatenated; returns the ``sum(recv)`` elements the others sent,
    in rank order). Each rank receives only the direction of the matrices overlapping its range
    (:meth:`_exchange_plan`), not the whole stage's (gpu-review-2 N9).
    """

    def __init__(self, numel: int, n_decay: int, matrices: list[MuonMatrix], *, total: int | None = None,
                 lo: int = 0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str = "original", lr_ratio: float = 1.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, device="cpu", fused: bool | None = None,
                 tp: tuple[object, int, int] = (None, 0, 1),
                 gather: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor] | None = None,
                 bounds: list[tuple[int, int]] | None = None) -> None:
        self.numel, self.total, self.lo = numel, numel if total is None else total, lo
        self.hi = min(lo + numel, self.total)
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.adjust_lr_fn, self.lr_ratio = adjust_lr_fn, lr_ratio
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.tp_group, self.tp_rank, self.tp_size = tp
        self.gather = gather
        self.fused = fused_adamw_available() if fused is None else fused
        self.matrices = sorted(matrices, key=lambda m: m.offset)
        # the matrices this rank updates (overlapping its range), and the Muon runs inside its range
        self.mine = [m for m in self.matrices if m.offset < self.hi and m.offset + m.numel > lo]
        self.muon_runs = [(max(a, lo) - lo, min(b, self.hi) - lo)
                          for a, b in _runs([(m.offset, m.offset + m.numel) for m in self.mine])]
        # AdamW elements of this rank's range, split at the decay boundary, in local coordinates
        gaps, prev = [], 0
        for a, b in self.muon_runs:
            gaps.append((prev, a))
            prev = b
        gaps.append((prev, self.hi - lo))
        d = min(max(n_decay - lo, 0), self.hi - lo)
        self.adam_decay = _runs([(a, min(b, d)) for a, b in gaps])
        self.adam_rest = _runs([(max(a, d), b) for a, b in gaps])
        self.n_adam = sum(b - a for a, b in self.adam_decay + self.adam_rest)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self._direction: torch.Tensor | None = None  # Muon's direction, allocated at the first step and reused
        self._sq = torch.zeros(self.n_adam, dtype=torch.float32, device=device)  # compact second moment
        self._sq_views: dict[tuple[int, int], torch.Tensor] = {}
        o = 0
        for a, b in sorted(self.adam_decay + self.adam_rest):
            self._sq_views[(a, b)] = self._sq[o:o + b - a]
            o += b - a
        self._step_t = torch.zeros((), dtype=torch.float32, device=device)
        self.steps = 0
        self._plan = self._exchange_plan(bounds) if gather is not None else None

    def _needed(self, lo: int, hi: int) -> tuple[int, int]:
        """The flat range of the whole matrices overlapping ``[lo, hi)`` (empty: ``(lo, lo)``)."""
        ms = [m for m in self.matrices if m.offset < hi and m.offset + m.numel > lo]
        return (ms[0].offset, max(m.offset + m.numel for m in ms)) if ms else (lo, lo)

    def _exchange_plan(self, bounds: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int], int]:
        """(the local slices of this rank's direction each rank needs, the elements each rank sends here,
        the flat index of the first received element): what :meth:`_muon` exchanges with ``gather``."""
        need = [self._needed(lo, hi) for lo, hi in bounds]
        send = [(max(self.lo, a) - self.lo, max(min(self.hi, b), max(self.lo, a)) - self.lo) for a, b in need]
        a, b = self._needed(self.lo, self.hi)
        recv = [max(0, min(hi, b) - max(lo, a)) for lo, hi in bounds]
        return send, recv, a

    # ------------------------------------------------------------------ update
    def update(self, src: torch.Tensor, dst: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        """dst = the update of src with ``grad`` (fp32, unscaled and clipped); dst may be src."""
        self.steps += 1
        self._muon(src, dst, grad, lr * self.lr_ratio)
        for spans, wd in ((self.adam_decay, self.weight_decay), (self.adam_rest, 0.0)):
            if spans:
                self._adamw(src, dst, grad, spans, lr, wd)

    def _muon(self, src, dst, grad, lr: float) -> None:
        if not self.mine and self._plan is None:  # with a gather every rank joins the exchange
            return
        mu = self.momentum
        if self._direction is None:  # one buffer for every step: only the Muon runs are written, the rest stays 0
            self._direction = torch.zeros_like(self.exp_avg)
        u = self._direction  # the direction on this rank's Muon elements
        for a, b in self.muon_runs:
            buf = self.exp_avg[a:b]
            buf.lerp_(grad[a:b], 1 - mu)
            u[a:b] = grad[a:b].lerp(buf, mu) if self.nesterov else buf
        stage_u, base = (u, self.lo) if self._plan is None else self._exchange(u)
        split = [m for m in self.mine if m.split_dim is not None and self.tp_size > 1]
        pieces = self._tp_gather(stage_u, base, split) if split else {}
        for m in self.mine:
            whole = pieces.get(m.offset)
            if whole is None:
                whole = stage_u[m.offset - base:m.offset - base + m.numel].view(m.shape)
            o = zeropower_via_newtonschulz(whole, self.ns_steps)
            if m.offset in pieces:  # keep this rank's slice of the whole update
                o = o.chunk(self.tp_size, dim=m.split_dim)[self.tp_rank]
            o = o.reshape(-1)
            a, b = max(m.offset, self.lo), min(m.offset + m.numel, self.hi)
            s = slice(a - self.lo, b - self.lo)
            step_lr = adjusted_lr(lr, self.adjust_lr_fn, m.full_shape(self.tp_size))
            torch.add(src[s] * (1 - lr * self.weight_decay), o[a - m.offset:b - m.offset], alpha=-step_lr, out=dst[s])

    def _exchange(self, u: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The direction of every matrix overlapping this rank's range (from the ranks that hold it), and
        the flat index of its first element: one all-to-all of about a shard plus a matrix per rank."""
        send, recv, base = self._plan
        pieces = torch.cat([u[a:b] for a, b in send]) if any(b > a for a, b in send) else u[:0]
        return self.gather(pieces, [b - a for a, b in send], recv), base

    def _tp_gather(self, stage_u: torch.Tensor, base: int, split: list[MuonMatrix]) -> dict[int, torch.Tensor]:
        """Each split matrix's whole direction: one all-gather of every split matrix's local direction."""
        packed = torch.cat([stage_u[m.offset - base:m.offset - base + m.numel] for m in split])
        out = packed.new_empty(self.tp_size * packed.numel())
        _all_gather(out, packed, group=self.tp_group)
        ranks = out.view(self.tp_size, -1)
        whole, o = {}, 0
        for m in split:
            parts = [ranks[r, o:o + m.numel].view(m.shape) for r in range(self.tp_size)]
            whole[m.offset] = torch.cat(parts, dim=m.split_dim)
            o += m.numel
        return whole

    def _adamw(self, src, dst, grad, spans, lr: float, wd: float) -> None:
        """torch's AdamW on the given spans (the fused kernel when available, else FlatAdam's formula)."""
        b1, b2 = self.betas
        dsts = [dst[a:b] for a, b in spans]
        grads = [grad[a:b] for a, b in spans]
        ms = [self.exp_avg[a:b] for a, b in spans]
        vs = [self._sq_views[(a, b)] for a, b in spans]
        if dst.data_ptr() != src.data_ptr():
            for (a, b), d in zip(spans, dsts):
                d.copy_(src[a:b])
        if self.fused:
            self._step_t.fill_(self.steps)
            torch._fused_adamw_(dsts, grads, ms, vs, [], [self._step_t] * len(spans), lr=lr, beta1=b1, beta2=b2,
                                weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False)
            return
        bc1, bc2 = 1 - b1**self.steps, 1 - b2**self.steps
        for d, g, m, v in zip(dsts, grads, ms, vs):
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            step = v.sqrt().div_(math.sqrt(bc2)).add_(self.eps).reciprocal_().mul_(m)
            if wd:
                d.mul_(1 - lr * wd)
            d.add_(step, alpha=-lr / bc1)

    # ------------------------------------------------------------------ state
    def state_spans(self) -> dict[str, list[Span]]:
        """The momentum over the whole range; Adam's second moment on the AdamW elements only (its views of
        the compact buffer, placed where those elements sit: the matrices' part is zero in a whole tensor)."""
        return {"exp_avg": [(0, self.exp_avg)], "exp_avg_sq": [(a, v) for (a, _), v in sorted(self._sq_views.items())]}
