"""Mixture of experts: the MoE MLP (``MoELayer``: ``forward(x [s, b, h]) -> y [s, b, h]``), its router, balancing
losses, token dispatchers over the expert-parallel group and grouped experts. One concept a module:
``routing`` (top-k as Megatron-Core), ``losses`` (aux, sequence aux, z-loss, their per-call injection),
``capacity`` (dropping), ``router``, ``permute``, ``comm`` (uneven collectives), ``dispatcher``,
``grouped_gemm`` (the one expert GEMM), ``experts``, ``shared``, ``layer``. Imports ``config/`` and
``tensor_parallel/recompute`` (``--moe-layer-recompute``) only."""

from .layer import MoELayer, MoEStats, set_aux_loss_scale
from .router import Router, Routing, updated_expert_bias

__all__ = ["MoELayer", "MoEStats", "Router", "Routing", "set_aux_loss_scale", "updated_expert_bias"]
