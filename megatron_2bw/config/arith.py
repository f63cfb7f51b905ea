"""The arithmetic of a model, stated once: parameters and FLOPs of each block (a transformer layer, the
embedding, the head) on one GPU of a ``t``-way tensor group, the whole model's parameter count, and
Megatron-LM's model FLOPs per training step. The config's count, the planner's costs and the log's
TFLOP/s all read this module.

Megatron-LM's closed form for ``L`` layers, hidden ``h``, sequence ``s``, the *padded* vocabulary
``V`` (Megatron pads to a multiple of 128 x t and so computes the padded logits), global batch ``B``,
``a`` query heads of ``d`` channels in ``g`` groups and FFN size ``f`` (``num_floating_point_operations``)::

    F = 12 B s L h^2 ((1 + g/a + s/h) * a d/h + (f/h) * (3/2 with SwiGLU) + V / (2 L h))

(12 = 3 GEMMs per matrix (forward, data and weight gradient) x 2 stacked matrices x 2 FLOPs per
multiply-add). For GPT-2's shapes (``g = a``, ``a d = h``, ``f = 4h``) it is the familiar
``72 B s L h^2 (1 + s/6h + V/12Lh)``. Full activation recomputation (``--recompute-activations`` or
``--recompute-granularity full``) adds one forward of the layers, not of the logits (Narayanan et al.,
2021, eq. 3: ``96 B s L h^2 (1 + s/6h + V/16Lh)``); selective recomputation re-runs only the attention
core, which Megatron does not count either. It counts the matrix multiplies only, the same for GPT and
BERT (BERT's small heads are left out): a *model* FLOP estimate, not what a profiler would measure.

The functions take a ``ModelConfig`` (duck-typed: this module sits below ``config/model.py``, whose
``num_parameters`` reads :func:`num_parameters`). The per-block terms are the blocks' own (``blocks.py``), the
family's head beyond the norm and the output layer its own (``families.py``).
"""

from __future__ import annotations

from typing import Any

from . import blocks
from .moe_arith import mean_mlp_width

Model = Any  # a ModelConfig


def layer_params(model: Model, t: int) -> int:
    """Parameters of one transformer layer on one GPU (Megatron split; row-parallel biases replicated): the
    sum over its blocks' parameter lists (``blocks.py``).

    GPT-2 style: ``(4h^2 + 3h + 2hf + f) / t + 2h + 4h``. The Llama options change the terms: QKV
    has ``(a + 2g) * head_dim`` outputs with ``g`` query groups, SwiGLU doubles the first MLP GEMM
    (gate and up), --disable-bias-linear drops the biases and RMSNorm has no bias.
    """
    terms = blocks.layer_terms(model, "param_terms")
    return terms.split // t + terms.full


def tied_params(model: Model, t: int) -> int:
    """The vocab-parallel word embedding on one GPU (padded vocabulary) when the head shares it; 0 untied."""
    return word_params(model, t) if model.tied_output else 0


def word_params(model: Model, t: int) -> int:
    """One vocab-parallel ``[padded vocab / t, h]`` matrix: the word embedding or the untied output layer."""
    return model.padded_vocab_size(t) * model.hidden_size // t


def embedding_params(model: Model, t: int) -> int:
    h = model.hidden_size
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    return word_params(model, t) + positions + model.num_tokentypes * h


def head_params(model: Model, t: int) -> int:
    """Final norm, the output layer (the tied embedding's copy or its own), and the family's head beyond them
    (BERT's LM transform, bias, pooler, NSP head: ``families.py``)."""
    extra = model.family.head.extra_params(model, model.padded_vocab_size(t), t)
    return blocks.NORM.param_terms(model).full + word_params(model, t) + extra


def layer_forward_flops(model: Model, b: int, t: int) -> float:
    """``2bs(h * qkv + h^2 + h * mlp_in + f h) + 4bs^2h`` over ``t``: QKV (``(a + 2g) head_dim`` outputs with
    grouped-query attention), projection, the MLP GEMMs (three with SwiGLU) and the attention core (its
    query heads are all ``a``, so GQA leaves it unchanged). GPT-2 style: ``2bs(4h^2 + 2hf) + 4bs^2h``.
    The blocks' GEMMs (``blocks.layer_macs``) and the core (``SelfAttentionArith.core_flops``)."""
    s, h = model.seq_length, model.hidden_size
    return (2 * b * s * blocks.layer_macs(model) + 4 * b * s * s * h) / t


def head_forward_flops(model: Model, b: int, t: int) -> float:
    s, h = model.seq_length, model.hidden_size
    flops = 2 * b * s * h * model.padded_vocab_size(t) / t
    extra = model.family.head.extra_macs(model)  # replicated (BERT's LM transform)
    return flops + 2 * b * s * extra if extra else flops


def core_forward_flops(model: Model, b: int, t: int) -> float:
    """The attention core's two batched GEMMs (QK^T and times V) on one GPU."""
    return blocks.SELF_ATTENTION.core_flops(model, b, t)


def linear_forward_flops(model: Model, b: int, t: int) -> float:
    """The weight GEMMs of one layer forward (QKV, projection, the MLP's): the layer's FLOPs without the
    attention core. A weight gradient is one GEMM of the same size per weight GEMM."""
    return layer_forward_flops(model, b, t) - core_forward_flops(model, b, t)


def num_parameters(model: Model) -> int:
    """Parameters of the whole model (unpadded vocabulary, a tied embedding counted once)."""
    h, V = model.hidden_size, model.vocab_size
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    emb = V * h + positions + model.num_tokentypes * h
    head = blocks.NORM.param_terms(model).full + (0 if model.tied_output else V * h)
    head += model.family.head.extra_params(model, V, 1)  # BERT: LM transform, output bias, pooler, SOP head
    return model.num_layers * layer_params(model, 1) + emb + head


def flops_per_step(model: Model, global_batch: int, recompute: bool = False, tensor_parallel: int = 1) -> float:
    """Model FLOPs of one training step: the module docstring's closed form, padded for ``tensor_parallel``;
    with experts the MLP width is the active one (``moe_arith.mean_mlp_width``), the router left out."""
    L, h, s, V = model.num_layers, model.hidden_size, model.seq_length, model.padded_vocab_size(tensor_parallel)
    a, g, d, f = model.num_attention_heads, model.query_groups, model.head_dim, mean_mlp_width(model)
    gated = 1.5 if model.swiglu else 1.0
    layers = (1 + g / a + s / h) * (a * d / h) + (f / h) * gated
    return 12.0 * global_batch * s * L * h * h * (layers * (4 / 3 if recompute else 1.0) + V / (2 * L * h))


def counts_recompute(pipeline) -> bool:
    """Whether a PipelineConfig recomputes every layer's forward (stage-level or ``full`` granularity)."""
    return bool(getattr(pipeline, "recompute", False) or getattr(pipeline, "recompute_granularity", None) == "full")


def tflops_per_device(model: Model, global_batch: int, step_seconds: float, world_size: int,
                      recompute: bool = False, tensor_parallel: int = 1) -> float:
    """Model TFLOP/s per device for a step of ``step_seconds`` on ``world_size`` devices."""
    if step_seconds <= 0:
        return 0.0
    return flops_per_step(model, global_batch, recompute, tensor_parallel) / (step_seconds * world_size * 1e12)
