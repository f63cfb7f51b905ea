"""Which kernel implementation runs: apex's fused kernels when apex imports on CUDA, else torch's.

The choice is made once per process (``select_kernels``), logged once, and can be forced with
``--fused-kernels {auto,apex,torch}``. No try/except import silently changes behaviour: the
chosen path is always reported. Attention runs ``F.scaled_dot_product_attention`` (``--attention-backend``
auto, or flash/fused: only its fused kernels) or the written-out unfused core (unfused/local) and
the optimizer picks torch's fused AdamW itself when the build has it (``optimizer.flat``), so
neither is a choice made here.
"""

from __future__ import annotations

import importlib
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
    attention: str = "auto"  # --attention-backend (config.ATTENTION_BACKENDS; models/attention_core.py)

    def describe(self) -> str:
        return f"layer_norm={self.layer_norm}" + (f" attention={self.attention}" if self.attention != "auto" else "")


# What the apex path uses: the module and class the model builds, and the CUDA extension it calls
# (an apex built without --cuda_ext, or the unrelated PyPI "apex", lacks them).
_APEX_NEEDS = (("apex.normalization.fused_layer_norm", "FusedLayerNorm"), ("fused_layer_norm_cuda", None))


def apex_unusable_reason() -> str | None:
    """Why apex's kernels cannot run here (None: they can): CUDA and a real import of each kernel used."""
    if not torch.cuda.is_available():
        return "no CUDA"
    if importlib.util.find_spec("apex") is None:
        return "apex is not installed"
    for module, attr in _APEX_NEEDS:
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import means the path is unusable
            return f"apex is installed but {module} does not import ({type(e).__name__}: {e})".splitlines()[0]
        if attr is not None and not hasattr(mod, attr):
            return f"apex is installed but {module} has no {attr}"
    return None


def apex_available() -> bool:
    """apex's kernels import and CUDA is usable (apex's kernels are CUDA-only)."""
    return apex_unusable_reason() is None


def select_kernels(mode: str = "auto", device_type: str = "cpu", attention: str = "auto") -> Kernels:
    """Pick kernels for ``mode`` in {auto, apex, torch} on ``device_type``; ``attention``: --attention-backend."""
    if mode not in ("auto", "apex", "torch"):
        raise ConfigError(f"--fused-kernels must be auto, apex or torch, got {mode!r}")
    why_not = apex_unusable_reason() if mode != "torch" and device_type == "cuda" else None
    if mode == "apex" and (device_type != "cuda" or why_not is not None):
        raise ConfigError("--fused-kernels apex needs CUDA and an importable apex"
                          f"{f' ({why_not})' if why_not else ''}; neither path was forced silently")
    use_apex = mode == "apex" or (mode == "auto" and device_type == "cuda" and why_not is None)
    k = Kernels(layer_norm="apex" if use_apex else "torch", attention=attention)
    if mode == "auto" and device_type == "cuda" and why_not is not None:
        log.info("fused kernels: %s (apex not used: %s)", k.describe(), why_not)
    else:
        log.info("fused kernels: %s", k.describe())
    return k


def layer_norm(dim: int, eps: float, kernels: Kernels | None = None) -> nn.Module:
    """A LayerNorm module of the selected implementation."""
    if kernels is not None and kernels.layer_norm == "apex":
        from apex.normalization import FusedLayerNorm  # noqa: PLC0415 - optional dependency

        return FusedLayerNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps)
