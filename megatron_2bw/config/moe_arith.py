"""The arithmetic of the mixture-of-experts MLP block (``models/moe_block.py``), as ``blocks.py`` states the
dense blocks': its parameters (full shapes, none split over the tensor group: expert tensor parallelism is 1),
the active multiply-adds per token (the router, k routed experts, the shared experts), what its forward keeps
for the backward (the planner's activation memory), and the per-layer mean MLP width the model's FLOPs count.
It enters ``blocks.MLP_BLOCKS`` as ``"moe"`` (the models' ``MLPS`` key), but
``ModelConfig.mlp_block`` stays ``"dense"``: the model's parameter count is the dense layer's, and
``moe_presets.parameter_counts`` adds the experts (total and active). Torch-free.
"""

from __future__ import annotations

import math
from typing import Any

from .blocks import MLP_BLOCKS, BlockArith, Param, Terms

Model = Any  # a ModelConfig with ``moe`` set


class MoEMLPArith(BlockArith):
    """``MoEMLP``: ``moe.router.weight [E, h]``, ``moe.experts.linear_fc1 [E, 2F|F, h]`` and ``linear_fc2
    [E, h, F]``, the shared experts' two linears and their gate."""

    def params(self, model: Model) -> list[Param]:
        moe, h = model.moe, model.hidden_size
        e, f = moe.num_experts, moe.moe_ffn_hidden_size
        fc1 = 2 * f if model.swiglu else f
        out = [Param("moe.router.weight", (e, h), None, "mlp.router"),
               Param("moe.experts.linear_fc1", (e, fc1, h), None, "mlp.experts.linear_fc1"),
               Param("moe.experts.linear_fc2", (e, h, f), None, "mlp.experts.linear_fc2")]
        s = moe.moe_shared_expert_intermediate_size
        if s:
            out += [Param("moe.shared_experts.linear_fc1.weight", ((2 if model.swiglu else 1) * s, h), None,
                          "mlp.shared_experts.linear_fc1"),
                    Param("moe.shared_experts.linear_fc2.weight", (h, s), None, "mlp.shared_experts.linear_fc2")]
            out += [Param("moe.shared_experts.gate_weight", (1, h), None, "mlp.shared_experts.gate_weight")] \
                if moe.moe_shared_expert_gate else []
        return out

    def macs(self, model: Model) -> int:
        moe, h = model.moe, model.hidden_size
        return moe.num_experts * h + active_width(model, moe_layer=True) * h * (3 if model.swiglu else 2)


    def shared_macs(self, model: Model) -> tuple[int, int]:
        """Per token, the shared experts' two halves (:meth:`params`' shapes): the first linear and the gate (what
        runs beside the dispatch under ``--moe-shared-expert-overlap``), the second (beside the combine)."""
        shared = [p for p in self.params(model) if ".shared_experts." in p.name]
        second = sum(math.prod(p.shape) for p in shared if ".linear_fc2." in p.name)
        return sum(math.prod(p.shape) for p in shared) - second, second

    def routed_macs(self, model: Model) -> int:
        """The k routed experts' share of :meth:`macs` (what an uneven expert load stretches)."""
        moe = model.moe
        return moe.moe_router_topk * moe.moe_ffn_hidden_size * model.hidden_size * (3 if model.swiglu else 2)

    def expert_params(self, model: Model) -> int:
        """The routed experts' parameters (all ``E``, full shapes): what ``e`` expert ranks share out."""
        return sum(math.prod(p.shape) for p in self.params(model) if ".experts." in p.name)

    def stash(self, model: Model) -> Terms:
        """Per token, every tensor rank's whole (experts are not split over the tensor group; under sequence
        parallelism the block gathers its input): the block's input (router, shared experts, dispatch); per
        routed row (k per token) the permuted row, the row the experts read, their activations (SwiGLU: both
        halves, silu and product, ``4F``; GeLU ``2F``) and the output row the combine weights by the routing
        probability; the shared experts' activations. The router's fp32 scores and the rows' indices are
        :func:`router_stash_bytes`. ``tests/test_planner_moe.py`` checks this against what autograd keeps."""
        moe, h, act = model.moe, model.hidden_size, 4 if model.swiglu else 2
        k, s = moe.moe_router_topk, moe.moe_shared_expert_intermediate_size or 0
        return Terms(full=h + k * (3 * h + act * moe.moe_ffn_hidden_size) + act * s)

    def wgrad_stash(self, model: Model) -> Terms:
        """The output gradients of the experts' two GEMMs (``k (2F|F + h)``), the shared experts' and the
        router's, caught for a deferred weight gradient."""
        moe, h, first = model.moe, model.hidden_size, 2 if model.swiglu else 1
        k, s = moe.moe_router_topk, moe.moe_shared_expert_intermediate_size or 0
        return Terms(full=k * (first * moe.moe_ffn_hidden_size + h) + (first * s + h if s else 0) + moe.num_experts)

    def wgrad_input(self, model: Model) -> Terms:
        """What the weight gradients read: the block's input (router, shared experts' first GEMM), the k rows
        and the k second-GEMM inputs of the experts, the shared experts' second-GEMM input."""
        moe, h = model.moe, model.hidden_size
        k, s = moe.moe_router_topk, moe.moe_shared_expert_intermediate_size or 0
        return Terms(full=h + k * (h + moe.moe_ffn_hidden_size) + s)


def router_stash_bytes(model: Model) -> int:
    """Per token: the router's fp32 scores over the ``E`` experts and its routing map (one byte each), and per
    routed row two int64 indices (the permutation and its inverse) and its fp32 probability."""
    return model.moe.num_experts * (4 + 1) + model.moe.moe_router_topk * (2 * 8 + 4)


def active_width(model: Model, moe_layer: bool) -> int:
    """The MLP hidden width a token goes through in one layer: k routed experts plus the shared ones in an MoE
    layer (Megatron's FLOPs count), the dense ``ffn_hidden_size`` elsewhere."""
    moe = model.moe
    if moe is None or not moe_layer:
        return model.ffn_hidden_size
    return moe.moe_router_topk * moe.moe_ffn_hidden_size + (moe.moe_shared_expert_intermediate_size or 0)


def mean_mlp_width(model: Model) -> float:
    """:func:`active_width` averaged over the layers (``--moe-layer-freq`` leaves some dense)."""
    if getattr(model, "moe", None) is None:
        return model.ffn_hidden_size
    layers = model.moe.moe_layers(model.num_layers)
    return sum(active_width(model, m) for m in layers) / model.num_layers


MOE_MLP = MoEMLPArith()
MLP_BLOCKS["moe"] = MOE_MLP  # the table of MLP blocks (blocks.py), which the models' MLPS mirrors
