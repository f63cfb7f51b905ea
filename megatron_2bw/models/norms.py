"""The normalization layer of a model: LayerNorm (GPT-2, BERT) or RMSNorm (Llama), by ``--normalization``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fused import Kernels, layer_norm


def norm(cfg: ModelConfig, kernels: Kernels | None = None) -> nn.Module:
    """A norm over the hidden size: the selected LayerNorm kernel, or torch's ``nn.RMSNorm``.

    RMSNorm always runs torch's implementation (``--fused-kernels`` selects LayerNorm only).
    """
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, kernels)


def norm_functional(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same norm over given weights (the generation path's functional forward)."""
    if cfg.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, cfg.layernorm_epsilon)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, cfg.layernorm_epsilon)
