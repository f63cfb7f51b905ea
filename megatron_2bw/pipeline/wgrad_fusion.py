"""A split backward's weight gradients for the common nodes, accumulated by their own kernels, without the engine.

BACKWARD_WEIGHT (:func:`.split_backward.backward_weight`) runs ``autograd.grad`` once per parameter group:
each call walks the graph below its first-use node, makes a fresh ``dW`` (and, for a GEMM, its
transpose), and the result is then added into the gradient buffer. For the nodes a transformer's
weights enter, the weight side is one known kernel over the tensors the node saved, so it runs here
and accumulates in place:
- a linear layer's GEMM (the seam's node, ``tensor_parallel/gemm.py:SEAM_NODE``): ``grad += dY^T X`` by
  the seam's ``wgrad`` in the layer's precision recipe, inside the GEMM for fp32 gradients (Megatron's
  gradient-accumulation fusion), and its bias ``db = sum dY``;
- a layer norm: ``native_layer_norm_backward`` with only its weight outputs asked for;
- RMSNorm's elementwise scale: ``dY * x_normed`` summed to the weight's shape;
- a bias added after a row-parallel reduction: ``dY`` summed to its shape.

These are the formulas the nodes' own backwards run. On one CPU core, W of two gpt-4x256 layers went from
17.4 to 16.2 ms. Any other node (a custom Function, a parameter used at several nodes, a node computing
in another dtype than its weights, a saved-tensor layout not recognised here) returns False and goes
the engine's way; so does every group where what is handled here is not exactly the group's parameters.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.autograd.graph import Node

from ..tensor_parallel import gemm

_aten = torch.ops.aten


def _param_below(fn: Node | None) -> tuple[Node | None, bool]:
    """The AccumulateGrad node at ``fn`` (directly or under one transpose), and whether transposed."""
    if fn is None:
        return None, False
    name = type(fn).__name__
    if name == "AccumulateGrad":
        return fn, False
    if name == "TBackward0":
        below = fn.next_functions[0][0]
        if below is not None and type(below).__name__ == "AccumulateGrad":
            return below, True
    return None, False


def _add(target: torch.Tensor, dw: torch.Tensor) -> None:
    target.add_(dw.view_as(target) if dw.shape != target.shape else dw)


def _linear(node: Node, dy: torch.Tensor, params: set[Node], target: dict[Node, torch.Tensor]) -> bool:
    """A linear layer's GEMM through the seam (``gemm.linear``: inputs x, weight, bias, recipe): dW = dY^T X
    into the target by ``gemm.wgrad``, db = sum dY."""
    nf = node.next_functions
    weight, transposed = _param_below(nf[1][0])
    bias = _param_below(nf[2][0])[0] if node.has_bias else None
    if weight is None or transposed or {weight, bias} - {None} != params:
        return False
    x = node.saved_tensors[0]
    if x is None or target[weight].shape != (dy.shape[-1], x.shape[-1]) or x.shape[:-1] != dy.shape[:-1]:
        return False
    if bias is not None and target[bias].numel() != dy.shape[-1]:
        return False
    gemm.wgrad(dy, x, target[weight], node.recipe)
    if bias is not None:
        _add(target[bias], dy.reshape(-1, dy.shape[-1]).sum(0))
    return True


def _layer_norm(node: Node, dy: torch.Tensor, params: set[Node], target: dict[Node, torch.Tensor]) -> bool:
    """LayerNorm's weight and bias gradients from aten's own backward, the input gradient skipped."""
    nf = node.next_functions
    weight, bias = _param_below(nf[1][0]), _param_below(nf[2][0])
    if weight[1] or bias[1] or {weight[0], bias[0]} - {None} != params:
        return False
    _, dw, db = _aten.native_layer_norm_backward(
        dy, node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
        node._saved_weight, node._saved_bias, [False, weight[0] is not None, bias[0] is not None])
    for acc, grad in ((weight[0], dw), (bias[0], db)):
        if acc is not None:
            _add(target[acc], grad)
    return True


def _scale(node: Node, dy: torch.Tensor, params: set[Node], target: dict[Node, torch.Tensor]) -> bool:
    """An elementwise scale (RMSNorm's weight): dW = dY * the other operand, summed."""
    nf = node.next_functions
    a, b = _param_below(nf[0][0]), _param_below(nf[1][0])
    if a[1] or b[1] or (a[0] is None) == (b[0] is None):
        return False
    acc = a[0] if a[0] is not None else b[0]
    try:
        other = node._saved_other if a[0] is not None else node._saved_self
    except RuntimeError:  # not saved (the operand needs no gradient) or freed
        return False
    shape = target[acc].shape if {acc} == params else None
    if shape is None or not isinstance(other, torch.Tensor) or other.dtype != dy.dtype \
            or tuple(shape) != tuple(dy.shape[dy.dim() - len(shape):]):
        return False
    _add(target[acc], (dy * other).sum_to_size(shape))
    return True


def _bias(node: Node, dy: torch.Tensor, params: set[Node], target: dict[Node, torch.Tensor]) -> bool:
    """A bias added on its own: db = dY summed to the bias's shape."""
    nf = node.next_functions
    bias, transposed = _param_below(nf[1][0])
    if bias is None or transposed or {bias} != params or node._saved_alpha != 1 \
            or _param_below(nf[0][0])[0] is not None:
        return False
    shape = target[bias].shape
    if len(shape) > dy.dim() or tuple(shape) != tuple(dy.shape[dy.dim() - len(shape):]):
        return False
    _add(target[bias], dy.sum_to_size(shape))
    return True


# what each first-use node type's weight gradient is computed by (other nodes: autograd)
_FUSED = {gemm.SEAM_NODE: _linear, "NativeLayerNormBackward0": _layer_norm,
          "MulBackward0": _scale, "AddBackward0": _bias}


# (first-use node type, whether handled here) -> groups seen: which nodes took the fused path on this device
# (CUDA's node types differ from the CPU's; ``benchmarks/gpu_probe.py`` reports it)
TALLY: Counter[tuple[str, bool]] = Counter()


@torch.no_grad()
def fused_weight_grad(node: Node, caught: tuple[torch.Tensor | None, ...] | None, params: set[Node],
                      target: dict[Node, torch.Tensor]) -> bool:
    """Accumulate the weight gradients of the one first-use ``node`` of a group whose parameters (by
    accumulator) are ``params`` into ``target[acc]`` (their ``.grad`` or ``.main_grad``); False, with
    nothing written, where this node or group is not one handled here."""
    done = _fused_weight_grad(node, caught, params, target)
    TALLY[(type(node).__name__, done)] += 1
    return done


def _fused_weight_grad(node: Node, caught: tuple[torch.Tensor | None, ...] | None, params: set[Node],
                       target: dict[Node, torch.Tensor]) -> bool:
    if not caught or caught[0] is None or len(caught) != 1:
        return False
    dy, handler = caught[0], _FUSED.get(type(node).__name__)
    # autograd rounds a weight's gradient to the weight's dtype before accumulating it: where the node
    # computed in another (an fp32 norm over fp16 weights), leave it to autograd
    if handler is None or any(getattr(acc, "variable", None) is None or acc.variable.dtype != dy.dtype
                              for acc in params):
        return False
    return handler(node, dy, params, target)
