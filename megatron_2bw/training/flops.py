"""Model FLOPs per step and TFLOP/s per device, with Megatron's formula.

Per iteration (Narayanan et al., 2021, eq. 3), for ``L`` layers, hidden ``h``, sequence ``s``,
vocabulary ``V`` and global batch ``B``::

    F = 24 * c * B * s * L * h^2 * (1 + s / (6 h) + V / (16 L h))

with ``c = 3`` (forward + backward = 3 forwards) or ``c = 4`` with activation recomputation
(one more forward). It counts the matrix multiplies only, the same for GPT and BERT (BERT's
small heads are left out), so it is a *model* FLOP estimate: what the hardware did, minus
overheads, not what a profiler would measure.
"""

from __future__ import annotations

from ..config import ModelConfig


def flops_per_step(cfg: ModelConfig, global_batch: int, recompute: bool = False) -> float:
    """Model FLOPs of one training step (the module docstring's formula; Llama-style models:
    :func:`llama_flops_per_step`)."""
    if cfg.llama_style:
        return llama_flops_per_step(cfg, global_batch, recompute)
    L, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.vocab_size
    c = 4 if recompute else 3
    return 24.0 * c * global_batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def tflops_per_device(cfg: ModelConfig, global_batch: int, step_seconds: float, world_size: int,
                      recompute: bool = False) -> float:
    """Model TFLOP/s per device for a step of ``step_seconds`` on ``world_size`` devices."""
    if step_seconds <= 0:
        return 0.0
    return flops_per_step(cfg, global_batch, recompute) / (step_seconds * world_size * 1e12)


def llama_flops_per_step(cfg: ModelConfig, global_batch: int, recompute: bool = False) -> float:
    """Megatron-LM's ``num_floating_point_operations`` with its grouped-query and SwiGLU terms::

        F = 12 B s L h^2 ((1 + g/a + s/h) * a d/h + (f/h) * (3/2 if SwiGLU) + V / (2 L h))

    (``g`` query groups of ``a`` heads of ``d`` channels, ``f`` the FFN size; 12 = 3 GEMMs per
    matrix (forward, data and weight gradient) x 2 stacked matrices x 2 FLOPs per multiply-add),
    times 4/3 with recomputation (one more forward), as :func:`flops_per_step`. A separate path so
    the GPT-2-style formula above stays the paper's.
    """
    L, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.padded_vocab_size(1)
    a, g, d, f = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.ffn_hidden_size
    gated = 1.5 if cfg.swiglu else 1.0
    terms = (1 + g / a + s / h) * (a * d / h) + (f / h) * gated + V / (2 * L * h)
    return 12.0 * global_batch * s * L * h * h * terms * (4 / 3 if recompute else 1.0)
