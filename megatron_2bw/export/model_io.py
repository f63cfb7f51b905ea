"""Our model as one process holds it (t = 1, one stage), read and written by global names."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.names import full_names
from ..checkpoint.reshard import is_vocab, pad_vocab, whole_model_config
from ..config import ModelConfig
from ..errors import ConfigError
from ..models.groups import ModelGroups
from ..models.spec import ModelSpec


def build_full_model(cfg: ModelConfig, seed: int = 1234) -> nn.ModuleList:
    """The whole model [embedding, layers, head] at t = 1 in one module list (head tied to the embedding)."""
    return nn.ModuleList(ModelSpec(whole_model_config(cfg), ModelGroups(), seed).build(0, cfg.num_layers + 2))


def global_state_dict(model: nn.ModuleList) -> dict[str, torch.Tensor]:
    """Every parameter by global name (``named_parameters`` drops the head's tied copy)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_full(model: nn.ModuleList, cfg: ModelConfig, full: dict[str, torch.Tensor]) -> nn.ModuleList:
    """Copy a full state dict into ``model`` (vocabulary rows cut/padded to the model's)."""
    params = dict(model.named_parameters())
    expected = set(full_names(cfg))
    if set(full) != expected or set(params) != expected:
        missing, extra = sorted(expected - set(full)), sorted(set(full) - expected)
        raise ConfigError(f"state dict does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            value = pad_vocab(full[name], p.shape[0]) if is_vocab(cfg, name) else full[name]
            if value.shape != p.shape:
                raise ConfigError(f"{name} has shape {tuple(value.shape)} but the model's is {tuple(p.shape)}")
            p.copy_(value)
    return model
