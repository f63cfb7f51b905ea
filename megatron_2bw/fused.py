"""Which kernel implementation runs: apex's fused kernels when apex imports on CUDA, else torch's.

The choice is made once per process (``select_kernels``), logged once, and can be forced with
``--fused-kernels {auto,apex,torch}``. No try/except import silently changes behaviour: the
chosen path is always reported. Attention always runs ``F.scaled_dot_product_attention`` and
the optimizer picks torch's fused AdamW itself when the build has it (``optimizer.flat``), so
neither is a choice made here.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn

from .errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """The implementations in use; passed to the model builders."""

    layer_norm: str = "torch"  # "apex" (FusedLayerNorm) or "torch" (nn.LayerNorm)

    def describe(self) -> str:
        return f"layer_norm={self.layer_norm}"


def apex_available() -> bool:
    """apex is installed and CUDA is usable (apex's kernels are CUDA-only)."""
    return importlib.util.find_spec("apex") is not None and torch.cuda.is_available()


def select_kernels(mode: str = "auto", device_type: str = "cpu") -> Kernels:
    """Pick kernels for ``mode`` in {auto, apex, torch} on ``device_type``."""
    if mode not in ("auto", "apex", "torch"):
        raise ConfigError(f"--fused-kernels must be auto, apex or torch, got {mode!r}")
    use_apex = mode == "apex" or (mode == "auto" and device_type == "cuda" and apex_available())
    if mode == "apex" and not (device_type == "cuda" and apex_available()):
        raise ConfigError("--fused-kernels apex needs CUDA and an importable apex; neither path was forced silently")
    k = Kernels(layer_norm="apex" if use_apex else "torch")
    log.info("fused kernels: %s", k.describe())
    return k


def layer_norm(dim: int, eps: float, kernels: Kernels | None = None) -> nn.Module:
    """A LayerNorm module of the selected implementation."""
    if kernels is not None and kernels.layer_norm == "apex":
        from apex.normalization import FusedLayerNorm  # noqa: PLC0415 - optional dependency

        return FusedLayerNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps)
