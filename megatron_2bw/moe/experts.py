"""A rank's experts as grouped weights: one tensor per projection, ``[E_local, out, in]``.

``linear_fc1`` is ``[E_local, 2F, H]`` with SwiGLU (the gate block first, then up: Megatron-Core's
``linear_fc1`` and Hugging Face's fused ``gate_up_proj``) or ``[E_local, F, H]`` with GELU; ``linear_fc2`` is
``[E_local, H, F]`` (HF's ``down_proj``). No biases (as Mixtral, Qwen-MoE and DeepSeek's experts). Every
product goes through :func:`~megatron_2bw.moe.grouped_gemm.grouped_linear`. The activation is the dense MLP's
(SiLU-gated, or GELU's tanh form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .grouped_gemm import grouped_linear


def activation(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """SwiGLU on ``[gate | up]`` (the gate block first), else GELU."""
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


class GroupedExperts(nn.Module):
    """``num_local`` experts applied to tokens sorted by expert (``counts[e]`` rows each)."""

    def __init__(self, num_local: int, hidden_size: int, ffn_size: int, gated: bool, *,
                 init_std: float = 0.02, use_grouped_mm: bool = False, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gated, self.use_grouped_mm = gated, use_grouped_mm
        fc1_out = 2 * ffn_size if gated else ffn_size
        self.linear_fc1 = nn.Parameter(torch.empty(num_local, fc1_out, hidden_size, dtype=dtype))
        self.linear_fc2 = nn.Parameter(torch.empty(num_local, hidden_size, ffn_size, dtype=dtype))
        with torch.no_grad():
            self.linear_fc1.normal_(0.0, init_std)
            self.linear_fc2.normal_(0.0, init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        h = activation(grouped_linear(x, self.linear_fc1, counts, self.use_grouped_mm), self.gated)
        return grouped_linear(h, self.linear_fc2, counts, self.use_grouped_mm)
