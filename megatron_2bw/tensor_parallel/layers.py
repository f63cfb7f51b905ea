"""Megatron's tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Weights are made by an ``init.Init`` (the full tensor and this rank's slice of it): with the CPU
path a layer at t = 4 holds exactly the rows/columns of the dense layer that its rank owns; built
inside ``init.deferred()`` the weights stay on the meta device until the stage's flat buffers are
filled (``pipeline/weights.py``, per partition or from the CPU path). Parameters that are sharded carry
``tensor_parallel = True``; the rest are replicated across the tensor group (gradient norms count
them once). The linear layers' weights also carry Megatron's ``partition_dim`` (0: split by rows,
1: by columns), which marks them as the hidden matrices ``--optimizer muon`` orthogonalizes. Every GEMM
goes through ``gemm.py`` in the precision recipe the layer was handed; a linear layer keeps its recipe
state (``gemm.GemmState``, empty today) beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.precision import Precision
from . import gemm
from .backward_phase import phase
from .group import TPGroup
from .init import Init, parameter
from .mappings import _gather_seq, _reduce_scatter_seq, copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_seq


def _mark(p: nn.Parameter, sharded: bool) -> nn.Parameter:
    p.tensor_parallel = sharded
    return p


class _SequenceParallelColumns(torch.autograd.Function):
    """Column-parallel GEMMs on the all-gathered sequence that keep only this rank's shard of the
    input for backward and gather it again there (Megatron's sequence-parallel linear), so the stash
    holds ``x / t``, not ``x``. Several weights may share one input (SwiGLU's gate and up)."""

    @staticmethod
    def forward(ctx, tp, recipe, n, x, *params):
        full = _gather_seq(x, tp)
        weights, biases = params[:n], params[n:]
        ctx.tp, ctx.recipe, ctx.has_bias = tp, recipe, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(gemm.forward_gemm(full, w, b, recipe) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        half = phase()  # a split backward (zero-bubble schedules) asks for one half only
        want_x, want_w = half != "weight", half != "input"
        full = _gather_seq(x, ctx.tp) if want_w else None
        gx, gws, gbs = None, [], []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias):
            if g is None or not want_w:
                gws.append(None)
                gbs.append(None)
            else:
                gws.append(gemm.wgrad(g, full, None, ctx.recipe))
                gbs.append(g.reshape(-1, g.shape[-1]).sum(0) if has_bias else None)
            if g is not None and want_x:
                gi = gemm.dgrad(g, w, ctx.recipe)
                gx = gi if gx is None else gx + gi
        return (None, None, None, None if gx is None else _reduce_scatter_seq(gx, ctx.tp), *gws, *gbs)


def column_parallel(x: torch.Tensor, tp: TPGroup, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                    sequence_parallel: bool = False, recipe: Precision | None = None) -> list[torch.Tensor]:
    """This rank's outputs of column-parallel linears sharing input ``x``: one backward all-reduce
    (or, under sequence parallelism, one gather and one reduce-scatter) for all of them."""
    if sequence_parallel and tp.size > 1:
        return list(_SequenceParallelColumns.apply(tp, recipe, len(weights), x, *weights, *biases))
    x = copy_to_tp(x, tp)
    return [gemm.linear(x, w, b, recipe) for w, b in zip(weights, biases)]


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows across ranks; Y stays split unless gathered."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPGroup, *, seed: int, name: str, std: float,
        bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
        recipe: Precision | None = None,
    ) -> None:
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"{name}: {out_features} outputs not divisible by tensor size {tp.size}")
        self.tp, self.gather_output, self.sequence_parallel = tp, gather_output, sequence_parallel
        self.recipe, self.gemm_state = recipe, gemm.GemmState(recipe)
        self.weight = _mark(parameter(Init(name, seed, (out_features, in_features), std, 0, tp.rank, tp.size)),
                            tp.size > 1)
        self.weight.partition_dim = 0
        self.bias = _mark(parameter(Init(f"{name}.bias", seed, (out_features,), None, 0, tp.rank, tp.size)),
                          tp.size > 1) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel(x, self.tp, [self.weight], [self.bias], self.sequence_parallel, self.recipe)[0]
        return gather_from_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns; partial sums all-reduced, bias added once."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPGroup, *, seed: int, name: str, std: float, bias: bool = True,
        sequence_parallel: bool = False, recipe: Precision | None = None,
    ) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{name}: {in_features} inputs not divisible by tensor size {tp.size}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.recipe, self.gemm_state = recipe, gemm.GemmState(recipe)
        self.weight = _mark(parameter(Init(name, seed, (out_features, in_features), std, 1, tp.rank, tp.size)),
                            tp.size > 1)
        self.weight.partition_dim = 1
        self.bias = _mark(parameter(Init(f"{name}.bias", seed, (out_features,))), False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # reduce-scatter along the sequence; the bias sees a shard: sum its grad
            y = reduce_scatter_seq(gemm.linear(x, self.weight, None, self.recipe), self.tp)
            return y + copy_to_tp(self.bias, self.tp) if self.bias is not None else y
        y = reduce_from_tp(gemm.linear(x, self.weight, None, self.recipe), self.tp)
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(nn.Module):
    """Y = X A^T + b held whole on every tensor rank (BERT's LM transform, pooler and binary head): the
    parameters ``nn.Linear`` would have, its GEMM through the seam."""

    def __init__(self, in_features: int, out_features: int, *, seed: int, name: str, std: float,
                 recipe: Precision | None = None) -> None:
        super().__init__()
        self.weight = parameter(Init(name, seed, (out_features, in_features), std))
        self.bias = parameter(Init(f"{name}.bias", seed, (out_features,)))
        self.recipe, self.gemm_state = recipe, gemm.GemmState(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.bias, self.recipe)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary rows are split across ranks; lookups are all-reduced.

    ``padded_vocab`` is a multiple of 128 * t; rows past the real vocabulary are zero and never
    looked up (and are masked out of the softmax by the vocab-parallel cross-entropy).
    """

    def __init__(
        self, vocab_size: int, padded_vocab: int, dim: int, tp: TPGroup, *, seed: int, name: str, std: float,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if padded_vocab % tp.size:
            raise ValueError(f"{name}: padded vocabulary {padded_vocab} not divisible by tensor size {tp.size}")
        self.tp, self.vocab_size, self.padded_vocab = tp, vocab_size, padded_vocab
        self.per_rank = padded_vocab // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = _mark(parameter(Init(name, seed, (padded_vocab, dim), std, 0, tp.rank, tp.size, rows=vocab_size)),
                            tp.size > 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.tp) if self.sequence_parallel else reduce_from_tp(out, self.tp)
