"""A pre-LayerNorm transformer layer (causal or bidirectional) built from tensor-parallel layers.

The layer is made of blocks (attention, MLP, norm) that it takes from a :class:`LayerSpec` (the family table's,
``families.py``; Megatron-Core's ``ModuleSpec`` without its dynamic imports). Each :class:`Block` pairs a
builder with its arithmetic (``config/blocks.py``: the parameter list with shapes and split, FLOPs and the
activation stash), which ``config/arith.py``, the planner's costs and ``checkpoint/names.py`` read; another
MLP (mixture of experts) is one more ``MLPS`` entry, chosen by ``ModelConfig.mlp_block``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..config import blocks as arith
from ..config.moe_arith import MOE_MLP
from ..config.precision import Precision
from ..context_parallel.cores import context_core
from ..context_parallel.group import CPGroup
from ..fused import Kernels
from ..schedule.recompute_policy import RecomputePolicy
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel
from ..tensor_parallel.random import RNGTracker
from ..tensor_parallel.recompute import checkpointed
from .attention_core import attention
from .groups import ModelGroups
from .moe_block import MoEGroups, MoEMLP, is_moe_layer
from .norms import norm
from .rope import RotaryEmbedding, apply_rotary


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, prefix: str, causal: bool, rng: RNGTracker | None,
                 backend: str = "auto", cp: CPGroup | None = None, recipe: Precision | None = None):
        super().__init__()
        cfg.check_tensor_parallel(tp.size)
        self.cp = cp if cp is not None and cp.size > 1 else None  # context parallelism (context_parallel/)
        self.causal, self.rng, self.dropout = causal, rng, cfg.attention_dropout
        self.backend = backend  # --attention-backend (attention_core.py)
        self.selective = False  # re-run core() in backward (RecomputePolicy selective)
        self.heads = cfg.num_attention_heads // tp.size
        self.groups = cfg.query_groups // tp.size  # key/value heads on this rank
        self.per_group = cfg.num_attention_heads // cfg.query_groups
        self.head_dim = cfg.head_dim
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rotary_base) if cfg.rotary_dim else None
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        qkv_out = arith.qkv_outputs(cfg)  # the block arithmetic's statement of the QKV rows
        sp = cfg.sequence_parallel
        # QKV rows grouped per query group: the group's query heads, its key, its value (without
        # grouped-query attention a group is one head: q, k, v of head 0, then head 1, ...; with it,
        # [groups, heads/groups + 2, head_dim], Megatron-Core's ``linear_qkv`` order), so t contiguous
        # row blocks give each tensor rank whole groups
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, qkv_out, tp, seed=seed, name=f"{prefix}.qkv", std=cfg.init_method_std,
            bias=cfg.add_bias_linear, sequence_parallel=sp, recipe=recipe,
        )
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp, seed=seed, name=f"{prefix}.proj",
                                      std=out_std, bias=cfg.add_bias_linear, sequence_parallel=sp, recipe=recipe)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(QK^T) with dropout, times V: what selective recomputation re-runs.

        A given ``mask`` is complete (GPT's --reset-attention-mask is already causal)."""
        p = self.dropout if self.training else 0.0
        if p > 0 and self.rng is not None:
            with self.rng.fork():  # this rank's heads draw their own dropout masks
                return self._core(q, k, v, mask, p)
        return self._core(q, k, v, mask, p)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              p: float) -> torch.Tensor:
        dense = partial(attention, self.backend)  # --reset-attention-mask: a given mask holds causality too
        return context_core(self.cp).run(self.cp, self.backend, dense, q, k, v, mask, p, self.causal)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[b, s, rows]`` -> q ``[b, heads, s, hd]``, k and v ``[b, groups, s, hd]`` (this rank's)."""
        b, s, _ = qkv.shape
        if self.per_group == 1:
            qkv = qkv.view(b, s, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
            return qkv[0], qkv[1], qkv[2]
        qkv = qkv.view(b, s, self.groups, self.per_group + 2, self.head_dim)
        q = qkv[:, :, :, :self.per_group].reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
        return q, qkv[:, :, :, self.per_group].transpose(1, 2), qkv[:, :, :, self.per_group + 1].transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # the whole sequence (all-gathered under sequence parallelism)
        b, s, _ = qkv.shape
        q, k, v = self.split_qkv(qkv)
        if self.rotary is not None:
            cos, sin = self.rotary.tables(s, x.device, x.dtype, cp=self.cp)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            v = v.contiguous()  # else the stash keeps the whole QKV output alive through this view of it
        if self.selective:
            out = checkpointed(self.core, q, k, v, mask, tracker=self.rng)
        else:
            out = self.core(q, k, v, mask)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    """fc2(gelu(fc1(x))), or with SwiGLU fc2(silu(gate(x)) * up(x)): gate and up a column-parallel pair."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, prefix: str, recipe: Precision | None = None):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        h, f, bias, std = cfg.hidden_size, cfg.ffn_hidden_size, cfg.add_bias_linear, cfg.init_method_std
        sp = cfg.sequence_parallel
        self.swiglu = cfg.swiglu
        if self.swiglu:
            self.gate = ColumnParallelLinear(h, f, tp, seed=seed, name=f"{prefix}.gate", std=std, bias=bias,
                                             sequence_parallel=sp, recipe=recipe)
            self.up = ColumnParallelLinear(h, f, tp, seed=seed, name=f"{prefix}.up", std=std, bias=bias,
                                           sequence_parallel=sp, recipe=recipe)
        else:
            self.fc1 = ColumnParallelLinear(h, f, tp, seed=seed, name=f"{prefix}.fc1", std=std, bias=bias,
                                            sequence_parallel=sp, recipe=recipe)
        self.fc2 = RowParallelLinear(f, h, tp, seed=seed, name=f"{prefix}.fc2", std=out_std, bias=bias,
                                     sequence_parallel=sp, recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = column_parallel(x, self.gate.tp, [self.gate.weight, self.up.weight],
                                       [self.gate.bias, self.up.bias], self.gate.sequence_parallel, self.gate.recipe)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


@dataclass(frozen=True)
class BlockContext:
    """What every block builder of a layer is given besides the config: the groups, seeds and kernels."""

    groups: ModelGroups  # tensor, context and expert groups (groups.py)
    seed: int
    causal: bool
    rng: RNGTracker | None = None
    kernels: Kernels | None = None
    recipe: Precision | None = None  # the GEMM recipe (config/precision.py); None: the operands' dtype

    @property
    def tp(self) -> TPGroup:
        return self.groups.tp


@dataclass(frozen=True)
class Block:
    """A block builder, ``build(cfg, ctx, prefix)``, and its arithmetic (``config/blocks.py``)."""

    build: Callable[[ModelConfig, BlockContext, str], nn.Module]
    arith: arith.BlockArith


def _attention(cfg: ModelConfig, ctx: BlockContext, prefix: str) -> ParallelAttention:
    backend = ctx.kernels.attention if ctx.kernels is not None else "auto"
    return ParallelAttention(cfg, ctx.tp, ctx.seed, prefix, ctx.causal, ctx.rng, backend, ctx.groups.cp,
                             recipe=ctx.recipe)


def _dense_mlp(cfg: ModelConfig, ctx: BlockContext, prefix: str) -> ParallelMLP:
    return ParallelMLP(cfg, ctx.tp, ctx.seed, prefix, recipe=ctx.recipe)


def _norm(cfg: ModelConfig, ctx: BlockContext, prefix: str) -> nn.Module:
    return norm(cfg, ctx.kernels, ctx.tp)


SELF_ATTENTION = Block(_attention, arith.SELF_ATTENTION)
NORM = Block(_norm, arith.NORM)
def _moe_mlp(cfg: ModelConfig, ctx: BlockContext, prefix: str) -> nn.Module:
    """The MoE MLP in the layers ``--moe-layer-freq`` picks, the dense one in the others."""
    if not is_moe_layer(cfg, prefix):
        return _dense_mlp(cfg, ctx, prefix)
    return MoEMLP(cfg, ctx.tp, ctx.seed, prefix, ctx.groups.moe or MoEGroups())


# by ModelConfig.mlp_block; "moe" by ``layer_spec`` for a model with experts (its arithmetic: config/moe_arith.py)
MLPS: dict[str, Block] = {"dense": Block(_dense_mlp, arith.DENSE_MLP), "moe": Block(_moe_mlp, MOE_MLP)}


@dataclass(frozen=True)
class LayerSpec:
    """The blocks of a transformer layer, by kind (``arith.LAYER_SLOTS`` places them: ln1, attn, ln2, mlp)."""

    attention: Block = SELF_ATTENTION
    mlp: Block = MLPS["dense"]
    norm: Block = NORM

    def slots(self) -> dict[str, Block]:
        """The layer's module path of each block -> the block, in the layer's order (what
        ``arith.layer_blocks`` states torch-free)."""
        return {slot: getattr(self, kind) for slot, kind, _ in arith.LAYER_SLOTS}


def layer_spec(cfg: ModelConfig) -> LayerSpec:
    """The blocks ``cfg`` selects (the family table's ``layer``)."""
    return LayerSpec(mlp=MLPS["moe" if cfg.moe is not None else cfg.mlp_block])


class TransformerLayer(nn.Module):
    """x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))). Pipeline signature: forward(x, batch)."""

    ln1: nn.Module  # the blocks, built from the layer spec's builders in this order
    attn: nn.Module
    ln2: nn.Module
    mlp: nn.Module

    def __init__(
        self, cfg: ModelConfig, groups: ModelGroups, seed: int, index: int, *, causal: bool,
        rng: RNGTracker | None = None, kernels: Kernels | None = None, recipe: Precision | None = None,
        spec: LayerSpec | None = None,
    ):
        super().__init__()
        prefix = f"layers.{index}"
        tp = groups.tp
        ctx = BlockContext(groups, seed, causal, rng, kernels, recipe)
        for slot, block in (spec or layer_spec(cfg)).slots().items():  # ln1, attn, ln2, mlp
            setattr(self, slot, block.build(cfg, ctx, f"{prefix}.{slot}"))
        self.hidden_dropout = cfg.hidden_dropout
        self.rng = rng
        # sequence parallelism: each rank holds other positions, so hidden dropout draws per rank
        self.sharded_dropout = cfg.sequence_parallel and tp.size > 1 and rng is not None
        # Full recomputation: a chunk's first layer runs the chunk's later layers itself, under one
        # checkpoint; those then pass their input through (the pipeline calls layers one by one).
        self.chunk: tuple[TransformerLayer, ...] = ()
        self.absorbed = False

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        if self.absorbed:
            return x
        if not self.chunk:
            return self.body(x, batch)
        return checkpointed(lambda h: self._run_chunk(h, batch), x, tracker=self.rng)

    def _run_chunk(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        for layer in self.chunk:
            x = layer.body(x, batch)
        return x

    def body(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        mask = batch.get("attention_mask")
        x = x + self._dropout(self.attn(self.ln1(x), mask))
        return x + self._dropout(self.mlp(self.ln2(x)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.sharded_dropout and self.training and self.hidden_dropout > 0:
            with self.rng.fork():
                return F.dropout(x, self.hidden_dropout, True)
        return F.dropout(x, self.hidden_dropout, self.training)


def apply_recompute(layers: list[nn.Module], policy: RecomputePolicy | None) -> None:
    """Mark a stage's transformer layers (consecutive in ``layers``) for ``policy``."""
    blocks = [m for m in layers if isinstance(m, TransformerLayer)]
    if policy is None or not policy.active:
        return
    for layer in blocks:
        layer.attn.selective = policy.granularity == "selective"
    for first, count, recomputed in policy.segments(len(blocks)):
        if recomputed:
            group = blocks[first:first + count]
            group[0].chunk = tuple(group)
            for layer in group[1:]:
                layer.absorbed = True
