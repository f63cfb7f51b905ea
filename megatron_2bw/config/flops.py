"""Model FLOPs per step and TFLOP/s per device: one formula for the
trainer's log, the planner's report, ``benchmarks/gpu.py`` and ``benchmarks/gpu_check.py``.

Megatron-LM's closed form for ``L`` layers, hidden ``h``, sequence ``s``, the *padded* vocabulary
``V`` (Megatron pads to a multiple of 128 x t and so computes the padded logits) and global batch ``B``::

    F = 72 B s L h^2 (1 + s / (6 h) + V / (12 L h))     forward + backward
    F = 96 B s L h^2 (1 + s / (6 h) + V / (16 L h))     with full activation recomputation

The first is 3 passes of ``24 B s L h^2 (1 + s/6h)`` over the layers plus ``6 B s V h`` for the
logits; the second (Narayanan et al., 2021, eq. 3) adds one forward of the layers, not of the
logits (which Megatron does not recompute), so its logit term is also ``6 B s V h``. Full
recomputation means ``--recompute-activations`` (whole stages) or ``--recompute-granularity full``;
selective recomputation re-runs only the attention core, which Megatron does not count either
(stage-level recomputation also replays the head and its logits: the hardware does a little more
than this count, which is Megatron's, so numbers compare with its logs). It
counts the matrix multiplies only, the same for GPT and BERT (BERT's small heads are left out): a
*model* FLOP estimate, not what a profiler would measure.
"""

from __future__ import annotations

from .model import ModelConfig


def flops_per_step(cfg: ModelConfig, global_batch: int, recompute: bool = False, tensor_parallel: int = 1) -> float:
    """Model FLOPs of one training step (the module docstring's formula, padded for ``tensor_parallel``;
    Llama-style models: :func:`llama_flops_per_step`)."""
    if cfg.llama_style:
        return llama_flops_per_step(cfg, global_batch, recompute, tensor_parallel)
    L, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.padded_vocab_size(tensor_parallel)
    if recompute:
        return 96.0 * global_batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72.0 * global_batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def counts_recompute(pipeline) -> bool:
    """Whether a PipelineConfig recomputes every layer's forward (stage-level or ``full`` granularity)."""
    return bool(getattr(pipeline, "recompute", False) or getattr(pipeline, "recompute_granularity", None) == "full")


def tflops_per_device(cfg: ModelConfig, global_batch: int, step_seconds: float, world_size: int,
                      recompute: bool = False, tensor_parallel: int = 1) -> float:
    """Model TFLOP/s per device for a step of ``step_seconds`` on ``world_size`` devices."""
    if step_seconds <= 0:
        return 0.0
    return flops_per_step(cfg, global_batch, recompute, tensor_parallel) / (step_seconds * world_size * 1e12)


def llama_flops_per_step(cfg: ModelConfig, global_batch: int, recompute: bool = False,
                         tensor_parallel: int = 1) -> float:
    """Megatron-LM's ``num_floating_point_operations`` with its grouped-query and SwiGLU terms::

        F = 12 B s L h^2 ((1 + g/a + s/h) * a d/h + (f/h) * (3/2 if SwiGLU) + V / (2 L h))

    (``g`` query groups of ``a`` heads of ``d`` channels, ``f`` the FFN size; 12 = 3 GEMMs per
    matrix (forward, data and weight gradient) x 2 stacked matrices x 2 FLOPs per multiply-add),
    with recomputation the layers' terms times 4/3 (one more forward; the logits are not recomputed),
    as in :func:`flops_per_step`'s 96 form; the padded vocabulary. A separate path so the GPT-2-style
    formula above stays Megatron's closed form.
    """
    L, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.padded_vocab_size(tensor_parallel)
    a, g, d, f = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.ffn_hidden_size
    gated = 1.5 if cfg.swiglu else 1.0
    layers = (1 + g / a + s / h) * (a * d / h) + (f / h) * gated
    return 12.0 * global_batch * s * L * h * h * (layers * (4 / 3 if recompute else 1.0) + V / (2 * L * h))
