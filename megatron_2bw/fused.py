"""Which kernel implementation runs: apex's fused kernels when apex imports and runs on CUDA, else torch's.

The choice is made once per process (``select_kernels``), logged once, and can be forced with
``--fused-kernels {auto,apex,torch}``. No try/except import silently changes behaviour: the
chosen path is always reported. Attention runs ``F.scaled_dot_product_attention`` (``--attention-backend``
auto, or flash/fused: only its fused kernels) or the written-out unfused core (unfused/local) and
the optimizer picks torch's fused AdamW itself when the build has it (``optimizer.flat``), so
neither is a choice made here.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
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
    """Why apex's kernels cannot run here (None: they can): CUDA, a real import of each kernel used, and one
    tiny forward and backward of the fused LayerNorm on this process's GPU."""
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
    return _apex_kernel_problem(importlib.import_module(_APEX_NEEDS[0][0]).FusedLayerNorm, _probe_device())


def _probe_device() -> torch.device:
    """This process's GPU (``LOCAL_RANK``'s, else ``SLURM_LOCALID``'s under ``srun``, as the trainer will pick it):
    the probe must not make a CUDA context on GPU 0 from every local rank before ``set_device``."""
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    return torch.device("cuda", int(local) % max(torch.cuda.device_count(), 1))


def _apex_kernel_problem(fused_layer_norm: type, device: torch.device) -> str | None:
    """One tiny fused LayerNorm forward and backward against torch's: an apex built without this GPU's
    architecture imports fine and fails only at its first kernel ("no kernel image is available")."""
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            x = torch.linspace(-2.0, 3.0, 2 * 8, device=device).view(2, 8).requires_grad_(True)
            y = fused_layer_norm(8, eps=1e-5).to(device)(x)
            y.square().sum().backward()
            want = torch.nn.functional.layer_norm(x.detach(), (8,), eps=1e-5)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            bad = y.shape != want.shape or not torch.allclose(y.detach().float(), want, atol=1e-4) \
                or x.grad is None or not bool(torch.isfinite(x.grad).all())
    except Exception as e:  # noqa: BLE001 - any failure of the kernel on this device means the path is unusable
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"apex's fused layer norm fails on this GPU ({type(e).__name__}: {first})"
    return "apex's fused layer norm gives other values than torch's on this GPU" if bad else None


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
