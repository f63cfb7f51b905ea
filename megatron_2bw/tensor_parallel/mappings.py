"""The autograd mappings between tensor-parallel regions (Megatron's mappings.py, the three used).

Each is a conjugate pair: what forward does, backward does the dual (identity <-> all-reduce,
gather <-> split). All act on the last dimension; a size-1 group makes them identities.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import TPGroup


def all_reduce(x: torch.Tensor, tp: TPGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """``x`` reduced over the tensor group (in place when ``x`` is contiguous; use the result)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=tp.group)
    return x


def _split(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def _gather(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone() if ctx.tp.size > 1 else g, ctx.tp), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        # in place, as Megatron does: ``x`` is a fresh matmul or embedding output that no backward reads;
        # ``mark_dirty`` makes autograd refuse (not silently miscompute) any use that did save it
        if tp.size > 1 and x.is_contiguous():
            ctx.mark_dirty(x)
            return all_reduce(x, tp)
        return all_reduce(x, tp)  # a size-1 group's identity, or a reduced contiguous copy

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward, all-reduce backward: enters a column-parallel region."""
    return x if tp.size == 1 else _Copy.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-reduce forward, identity backward: leaves a row-parallel region."""
    return x if tp.size == 1 else _Reduce.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate all ranks' slices of the last dimension; split in backward."""
    return x if tp.size == 1 else _Gather.apply(x, tp)


# --------------------------------------------------------------------------- sequence parallelism
# Megatron's sequence-parallel mappings on our batch-first ``[b, s, h]`` activations: the sequence
# (dim 1) is sharded over the tensor group between the tensor-parallel regions.

def _all_gather_dim0(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=tp.group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x.contiguous(), group=tp.group)
    return out


def _gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``[b, s/t, ...]`` of every rank -> ``[b, s, ...]`` (rank order along the sequence)."""
    full = _all_gather_dim0(x.transpose(0, 1), tp)  # [s, b, ...]
    return full.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``[b, s, ...]`` partial sums -> this rank's ``[b, s/t, ...]`` slice of their sum."""
    return _reduce_scatter_dim0(x.transpose(0, 1), tp).transpose(0, 1).contiguous()


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(g, ctx.tp), None


def gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather the sequence forward, reduce-scatter backward: enters a column-parallel region
    under sequence parallelism (replaces :func:`copy_to_tp`)."""
    return x if tp.size == 1 else _GatherSeq.apply(x, tp)


def reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward: leaves a row-parallel region
    under sequence parallelism (replaces :func:`reduce_from_tp`)."""
    return x if tp.size == 1 else _ReduceScatterSeq.apply(x, tp)


def seq_shard(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's contiguous slice of dim 0 of a replicated tensor (e.g. the position rows of a sequence
    shard). Each rank's gradient covers its own rows only, so it is summed over the tensor group in
    backward (:func:`copy_to_tp`): a replicated parameter gets its whole gradient on every rank and stays
    equal, as Megatron's scatter of the summed embedding does (its backward gathers the sequence)."""
    return x if tp.size == 1 else copy_to_tp(x, tp).chunk(tp.size, dim=0)[tp.rank]
