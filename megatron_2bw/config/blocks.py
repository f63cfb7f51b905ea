"""The arithmetic of each block of a transformer layer, stated once: what its builder in ``models/transformer.py``
makes (the parameter list: names, full shapes, the dimension split over the tensor group, Megatron-LM's module
name), its forward GEMMs and what its forward keeps for the backward. ``arith.py`` (parameters, FLOPs),
the planner's layer costs (``planner/layer_costs.py``) and ``checkpoint/names.py`` read these; a block the
models add (a mixture-of-experts MLP) states its own here and enters ``MLP_BLOCKS``.

Counts are per token and grouped by how a ``t``-way tensor group divides them (:class:`Terms`), so the
layer-level formulas keep their one rounding each. Torch-free: this module sits below ``config/model.py``,
and takes a ``ModelConfig`` duck-typed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

Model = Any  # a ModelConfig

# What the attention core keeps, by kernel: ``fused`` (flash / memory-efficient: a log-sum-exp per row),
# ``unfused`` (Megatron's softmax and dropout: the s^2 probabilities, mask and dropped probabilities),
# ``math`` (torch's SDPA fallback on the CPU, in fp32: three fp32 s^2 tensors).
ATTENTION_KERNELS = ("fused", "unfused", "math")
MATH_BYTES = 4  # torch's CPU math path computes the scores, softmax and dropout in fp32


@dataclass(frozen=True)
class Param:
    """One parameter of a block."""

    name: str  # its path inside the block ("qkv.weight")
    shape: tuple[int, ...]  # the full (unsplit) tensor's
    split: int | None  # the dimension split over the tensor group (Megatron's partition_dim); None: replicated
    megatron: str  # Megatron-LM v2's module inside ParallelTransformerLayer ("self_attention.dense")


@dataclass(frozen=True)
class Terms:
    """Per-token counts of one block by how a ``t``-way tensor group divides them: ``full`` never, ``seq``
    only under sequence parallelism (sharded along the sequence), ``split`` always (sharded weights' side)."""

    full: int = 0
    seq: int = 0
    split: int = 0

    def __add__(self, other: Terms) -> Terms:
        return Terms(self.full + other.full, self.seq + other.seq, self.split + other.split)


class BlockArith:
    """What a block builder states beside its code. Subclasses fill in the four counts."""

    def params(self, model: Model) -> list[Param]:
        raise NotImplementedError

    def param_terms(self, model: Model) -> Terms:
        """Parameters on a tensor group: the split ones and the replicated ones (``full``)."""
        split = sum(math.prod(p.shape) for p in self.params(model) if p.split is not None)
        return Terms(full=sum(math.prod(p.shape) for p in self.params(model) if p.split is None), split=split)

    def macs(self, model: Model) -> int:
        """Multiply-adds of the block's weight GEMMs per token, forward, whole (divided by ``t`` on a rank)."""
        return 0

    def stash(self, model: Model) -> Terms:
        """Activation elements the forward keeps for the backward per token (``e`` bytes each), the
        attention core's kernel-dependent tensors left out (:meth:`SelfAttentionArith.core_stash_bytes`)."""
        return Terms()

    def wgrad_stash(self, model: Model) -> Terms:
        """Output-gradient elements a split backward's I catches per token for the block's deferred W."""
        return Terms()

    def wgrad_input(self, model: Model) -> Terms:
        """Stash elements the block's W reads per token (its weight GEMMs' and norms' inputs)."""
        return Terms()

    def stats_bytes(self, model: Model) -> int:
        """fp32 bytes per token W reads beside :meth:`wgrad_input` (a LayerNorm's mean and deviation)."""
        return 0


def qkv_outputs(model: Model) -> int:
    """QKV's output rows: ``(a + 2g) * head_dim`` (``3h`` without grouped-query attention)."""
    return (model.num_attention_heads + 2 * model.query_groups) * model.head_dim


class SelfAttentionArith(BlockArith):
    """``ParallelAttention``: QKV (column-parallel), the core, the projection (row-parallel, bias replicated)."""

    def params(self, model: Model) -> list[Param]:
        h, qkv, bias = model.hidden_size, qkv_outputs(model), model.add_bias_linear
        out = [Param("qkv.weight", (qkv, h), 0, "self_attention.query_key_value")]
        out += [Param("qkv.bias", (qkv,), 0, "self_attention.query_key_value")] if bias else []
        out += [Param("proj.weight", (h, h), 1, "self_attention.dense")]
        return out + ([Param("proj.bias", (h,), None, "self_attention.dense")] if bias else [])

    def macs(self, model: Model) -> int:
        h = model.hidden_size
        return h * qkv_outputs(model) + h * h

    def stash(self, model: Model) -> Terms:
        # its input (QKV's), and Q and the projection input (2h) plus K and V (2 g head_dim)
        kv = 2 * model.query_groups * model.head_dim
        return Terms(seq=model.hidden_size, split=2 * model.hidden_size + kv)

    def wgrad_stash(self, model: Model) -> Terms:
        # QKV's output gradient (split), the projection's (the whole sum: replicated)
        return Terms(full=model.hidden_size, split=qkv_outputs(model))

    def wgrad_input(self, model: Model) -> Terms:
        return Terms(seq=model.hidden_size, split=model.hidden_size)  # QKV's input, the projection's

    def core_flops(self, model: Model, b: int, t: int) -> float:
        """The core's two batched GEMMs (QK^T and times V) on one GPU."""
        return 4 * b * model.seq_length ** 2 * model.hidden_size / t

    def core_stash_bytes(self, model: Model, b: int, t: int, e: int, kernel: str, mask_bytes: int = 1) -> int:
        """What the core keeps beyond Q, K, V, split by ``t``. ``unfused``: the softmax output and, with attention
        dropout, its mask (``mask_bytes``) and output: ``ab s^2 e (+ ab s^2 (mask_bytes + e))``. ``fused`` keeps
        only its fp32 log-sum-exp per row: ``4abs``. ``math``: the unfused tensors in fp32 (``MATH_BYTES`` each,
        the mask too), and Q, K and V promoted to fp32 with K and V repeated for every query head (they replace
        the ``e``-byte Q, K, V the layer counts: ``(4 * 3h - e(h + 2g head_dim)) bs``)."""
        s, a = model.seq_length, model.num_attention_heads
        if kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"unknown attention kernel {kernel!r}; one of {', '.join(ATTENTION_KERNELS)}")
        if kernel == "fused":
            return 4 * a * b * s // t
        promoted = 0
        if kernel == "math":
            h, kv = model.hidden_size, 2 * model.query_groups * model.head_dim
            promoted = max(0, MATH_BYTES * 3 * h - e * (h + kv)) * b * s
            e = mask_bytes = max(e, MATH_BYTES)
        n = a * b * s * s * e + (a * b * s * s * (mask_bytes + e) if model.attention_dropout > 0 else 0)
        return (n + promoted) // t


class DenseMLPArith(BlockArith):
    """``ParallelMLP``: fc1 (or SwiGLU's gate and up, which Megatron fuses in ``dense_h_to_4h``) column-parallel,
    fc2 row-parallel (bias replicated)."""

    fused_pair = ("gate", "up")  # SwiGLU's halves of Megatron's one ``dense_h_to_4h`` tensor, in its order

    def first(self, model: Model) -> tuple[str, ...]:
        return self.fused_pair if model.swiglu else ("fc1",)

    def params(self, model: Model) -> list[Param]:
        h, f, bias = model.hidden_size, model.ffn_hidden_size, model.add_bias_linear
        out: list[Param] = []
        for m in self.first(model):
            out += [Param(f"{m}.weight", (f, h), 0, "mlp.dense_h_to_4h")]
            out += [Param(f"{m}.bias", (f,), 0, "mlp.dense_h_to_4h")] if bias else []
        out += [Param("fc2.weight", (h, f), 1, "mlp.dense_4h_to_h")]
        return out + ([Param("fc2.bias", (h,), None, "mlp.dense_4h_to_h")] if bias else [])

    def macs(self, model: Model) -> int:
        h, f = model.hidden_size, model.ffn_hidden_size
        return h * f * len(self.first(model)) + f * h

    def stash(self, model: Model) -> Terms:
        # its input; GeLU's input and output (2f), or SwiGLU's gate, silu(gate), up and their product (4f)
        return Terms(seq=model.hidden_size, split=(4 if model.swiglu else 2) * model.ffn_hidden_size)

    def wgrad_stash(self, model: Model) -> Terms:
        return Terms(full=model.hidden_size, split=model.ffn_hidden_size * len(self.first(model)))

    def wgrad_input(self, model: Model) -> Terms:
        return Terms(seq=model.hidden_size, split=model.ffn_hidden_size)  # the first GEMMs' input, fc2's


class NormArith(BlockArith):
    """``models/norms.py``: LayerNorm (weight, bias) or RMSNorm (weight), replicated. Its Megatron module is
    named by the layer's slot (``LAYER_SLOTS``)."""

    def params(self, model: Model) -> list[Param]:
        h = model.hidden_size
        out = [Param("weight", (h,), None, "")]
        return out + ([Param("bias", (h,), None, "")] if model.normalization == "LayerNorm" else [])

    def stash(self, model: Model) -> Terms:
        return Terms(seq=model.hidden_size)  # its input

    def wgrad_stash(self, model: Model) -> Terms:
        return Terms(seq=model.hidden_size)  # its output gradient (a sequence shard under SP)

    def wgrad_input(self, model: Model) -> Terms:
        return Terms(seq=model.hidden_size)

    def stats_bytes(self, model: Model) -> int:
        return 2 * 4 if model.normalization == "LayerNorm" else 0


SELF_ATTENTION = SelfAttentionArith()
DENSE_MLP = DenseMLPArith()
NORM = NormArith()
MLP_BLOCKS: dict[str, BlockArith] = {"dense": DENSE_MLP}  # by ModelConfig.mlp_block (models' transformer.MLPS)

# A transformer layer's blocks in order: (module path in the layer, kind of block, Megatron's name of a norm)
LAYER_SLOTS = (("ln1", "norm", "input_layernorm"), ("attn", "attention", ""),
               ("ln2", "norm", "post_attention_layernorm"), ("mlp", "mlp", ""))


def layer_blocks(model: Model) -> dict[str, BlockArith]:
    """The layer's module path of each block -> its arithmetic, for ``model``'s options."""
    kinds = {"norm": NORM, "attention": SELF_ATTENTION, "mlp": MLP_BLOCKS[model.mlp_block]}
    return {slot: kinds[kind] for slot, kind, _ in LAYER_SLOTS}


def layer_params(model: Model) -> list[Param]:
    """Every parameter of one transformer layer, named by its path in the layer (``attn.qkv.weight``), with
    its Megatron module (a norm's from its slot)."""
    blocks = layer_blocks(model)
    return [Param(f"{slot}.{p.name}", p.shape, p.split, p.megatron or megatron)
            for slot, _, megatron in LAYER_SLOTS for p in blocks[slot].params(model)]


def layer_terms(model: Model, what: str) -> Terms:
    """The sum over the layer's blocks of one count (``param_terms``, ``stash``, ``wgrad_stash``, ``wgrad_input``)."""
    total = Terms()
    for block in layer_blocks(model).values():
        total = total + getattr(block, what)(model)
    return total


def layer_macs(model: Model) -> int:
    return sum(block.macs(model) for block in layer_blocks(model).values())


def layer_stats_bytes(model: Model) -> int:
    return sum(block.stats_bytes(model) for block in layer_blocks(model).values())
