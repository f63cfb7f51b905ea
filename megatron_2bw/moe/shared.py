"""Shared experts: the MLP every token goes through beside its routed experts (DeepSeek, Qwen2-MoE), optionally
scaled per token by ``sigmoid(x . gate)`` (Qwen2-MoE's ``shared_expert_gate``; ``--moe-shared-expert-gate``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .experts import activation


class SharedExperts(nn.Module):
    """The always-on experts (one MLP of their summed width), optionally scaled by ``sigmoid(x . gate)``
    (Qwen2-MoE's shared-expert gate). Not sharded here: tensor parallelism is the integrator's."""

    def __init__(self, hidden_size: int, ffn_size: int, gated: bool, use_gate: bool, *, init_std: float = 0.02,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gated = gated
        fc1_out = 2 * ffn_size if gated else ffn_size
        self.linear_fc1 = nn.Linear(hidden_size, fc1_out, bias=False, dtype=dtype)
        self.linear_fc2 = nn.Linear(ffn_size, hidden_size, bias=False, dtype=dtype)
        self.gate_weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype)) if use_gate else None
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(*self.first(x))

    def first(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first linear and the activation, and the gate's score (None without a gate): what runs beside
        the dispatch all-to-all under ``--moe-shared-expert-overlap``."""
        gate = torch.sigmoid(F.linear(x, self.gate_weight)) if self.gate_weight is not None else None
        return activation(self.linear_fc1(x), self.gated), gate

    def second(self, hidden: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The second linear, scaled by the gate's score: what runs beside the combine all-to-all."""
        out = self.linear_fc2(hidden)
        return out if gate is None else gate * out
