"""The normalization layer of a model: LayerNorm (GPT-2, BERT) or RMSNorm (Llama), by ``--normalization``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fused import Kernels, layer_norm
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.init import constant_parameters
from ..tensor_parallel.mappings import copy_to_tp


def norm(cfg: ModelConfig, kernels: Kernels | None = None, tp: TPGroup | None = None) -> nn.Module:
    """A norm over the hidden size: the selected LayerNorm kernel, or torch's ``nn.RMSNorm``.

    RMSNorm always runs torch's implementation (``--fused-kernels`` selects LayerNorm only). Under
    sequence parallelism (``tp`` given with t > 1) each rank normalizes its sequence shard, so
    the weight's gradient is a partial sum: :class:`SequenceParallelNorm` all-reduces it. Built inside
    ``init.deferred()`` (a stage), its ones and zeros are deferred like the other parameters: made on
    the stage's device, not on the host.
    """
    values = {"weight": 1.0} if cfg.normalization == "RMSNorm" else {"weight": 1.0, "bias": 0.0}
    return constant_parameters(lambda: _norm(cfg, kernels, tp), values)


def _norm(cfg: ModelConfig, kernels: Kernels | None, tp: TPGroup | None) -> nn.Module:
    if cfg.sequence_parallel and tp is not None and tp.size > 1:
        return SequenceParallelNorm(cfg, tp)
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, kernels)


class SequenceParallelNorm(nn.Module):
    """LayerNorm or RMSNorm on a sequence shard; the weights enter through ``copy_to_tp`` so their
    gradients are summed over the tensor group in backward (Megatron reduces them once per step;
    here once per microbatch, a vector of h per norm), keeping the replicated weights equal."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.weight = nn.Parameter(torch.ones(cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.normalization == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = copy_to_tp(self.bias, self.tp) if self.bias is not None else None
        return norm_functional(self.cfg, x, copy_to_tp(self.weight, self.tp), bias)


def norm_functional(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The same norm over given weights (the generation path's functional forward)."""
    if cfg.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, cfg.layernorm_epsilon)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, cfg.layernorm_epsilon)
