"""The one GEMM seam: every forward, data-gradient and weight-gradient GEMM of the model's linear layers.

``linear(x, w, b, recipe)`` is the forward (an autograd Function, :class:`GemmLinear`, whose backward calls
:func:`dgrad` and :func:`wgrad`); hand-written backwards (the sequence-parallel column GEMMs) call
:func:`dgrad`/:func:`wgrad` themselves, and a split backward's fused W (``pipeline/wgrad_fusion.py``)
recognises the seam's node (:data:`SEAM_NODE`) and calls :func:`wgrad` into the gradient buffer. So a
precision recipe (``config/precision.py``, resolved once from the run's precision and handed to each layer)
enters in one place: today's recipes (fp32, bf16, fp16, ``gemm="native"``) run torch's GEMM in the
operands' dtype, so the functions do not branch on it yet; a scaled recipe's kernels branch here.

The products follow Megatron's linear: ``dX = dY W`` and ``dW = dY^T X`` (the same kernel as the fused
W's, so a whole backward and a split one give the same weight gradients).

A scaled (FP8) recipe's per-layer state lives in :class:`GemmState`, outside the flat weight buffers;
:func:`gemm_state_dict` / :func:`load_gemm_state` are what a checkpoint format saves and restores (empty for
the native recipes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.precision import Precision
from .backward_phase import phase


def forward_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: Precision | None) -> torch.Tensor:
    """``x W^T + b`` without autograd: the kernel :func:`linear` runs (and what custom Functions call)."""
    return F.linear(x, w, b)


def dgrad(dy: torch.Tensor, w: torch.Tensor, recipe: Precision | None) -> torch.Tensor:
    """The data gradient ``dY W`` (``dy`` of any leading shape)."""
    return dy @ w


def wgrad(dy: torch.Tensor, x: torch.Tensor, target: torch.Tensor | None, recipe: Precision | None) -> torch.Tensor:
    """The weight gradient ``dY^T X`` over every leading position; with ``target``, added into it (returned):
    inside the GEMM for fp32 gradients (Megatron's gradient-accumulation fusion); for gradients in the model's
    16-bit dtype (or wider main grads) the product is rounded first and then added, as autograd's path rounds
    it, so a split backward's gradients match a whole backward's (an fp16 step's overflow check sees the same)."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    if target is None:
        return dy2.t().mm(x2)
    if target.dtype == dy2.dtype == x2.dtype == torch.float32 and target.is_contiguous():
        torch.addmm(target, dy2.t(), x2, out=target)  # addmm_ itself, as the aten.addmm FLOP counters see it
    else:
        target.add_(dy2.t().mm(x2))
    return target


class GemmLinear(torch.autograd.Function):
    """``x W^T + b`` whose backward runs the seam's GEMMs; under a split backward (``backward_phase``) only
    the half asked for: I the data gradient, W the weight's and the bias's."""

    @staticmethod
    def forward(ctx, x, w, b, recipe):
        ctx.recipe, ctx.has_bias = recipe, b is not None
        ctx.save_for_backward(x, w)
        return forward_gemm(x, w, b, recipe)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        half = phase()
        want_x, want_w = ctx.needs_input_grad[0] and half != "weight", half != "input"
        dx = dgrad(dy, w, ctx.recipe) if want_x else None
        dw = wgrad(dy, x, None, ctx.recipe) if want_w and ctx.needs_input_grad[1] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if want_w and ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


SEAM_NODE = GemmLinear.__name__ + "Backward"  # the autograd node type of :func:`linear`


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: Precision | None) -> torch.Tensor:
    """The forward GEMM of a linear layer, ``x W^T + b``, in ``recipe`` (None: the operands' dtype)."""
    return GemmLinear.apply(x, w, b, recipe)


class GemmState:
    """A linear layer's recipe state (an FP8 recipe's scales and amax history): named tensors kept beside the
    layer, outside the flat weight buffers, saved and restored by the checkpoint formats. Empty for the
    native recipes."""

    def __init__(self, recipe: Precision | None) -> None:
        self.recipe = recipe
        self.tensors: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.tensors):
            raise ValueError(f"GEMM state keys {sorted(state)} do not match this recipe's {sorted(self.tensors)}")
        for k, v in state.items():
            self.tensors[k].copy_(v)


def _states(model: nn.Module) -> dict[str, GemmState]:
    return {name: m.gemm_state for name, m in model.named_modules() if isinstance(getattr(m, "gemm_state", None),
                                                                                   GemmState)}


def gemm_state_dict(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every layer's non-empty recipe state by module path: what a checkpoint format saves beside the weights
    (``{}`` under the native recipes)."""
    return {name: s.state_dict() for name, s in _states(model).items() if s.tensors}


def load_gemm_state(model: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Restore :func:`gemm_state_dict`'s output into ``model`` (the same module paths and keys)."""
    states = _states(model)
    have = {name for name, s in states.items() if s.tensors}
    if set(state) != have:
        raise ValueError(f"GEMM state for {sorted(set(state) ^ have)} does not match the model's layers")
    for name, tensors in state.items():
        states[name].load_state_dict(tensors)
