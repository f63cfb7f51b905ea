"""MoE router state in a torch_dist checkpoint: the aux-loss-free expert bias of each MoE layer, in the two
versions a resume needs (``B(step)`` for the newest weights, ``B(step - 1)`` for the version 2BW's next step
runs on), as ``router_state/<global layer>.expert_bias`` of shape ``[2, experts]``, keyed by the layer's index in
the full model so that a resume at another pipeline split or expert layout finds it.

The trainer hands the state over on the stage (``stage.moe_router_state``: global layer -> ``[2, E]`` tensor,
set before a save by ``training/moe_hooks.py``) and finds the loaded one there after a restore. The tensor is
the same on every rank of a stage; the stage's first data and tensor rank writes it.
"""

from __future__ import annotations

import torch

from .shard_map import Chunk

ROUTER = "router_state"


def _fqn(layer: int) -> str:
    return f"{ROUTER}/{layer}.expert_bias"


def _layer(name: str) -> int:
    """The layer of a name in the family (``<layer>.expert_bias``)."""
    return int(name.split(".")[0])


def newest_bias(families: dict[str, dict[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Layer -> the expert bias of the newest weights (row 0) from a whole checkpoint's families (empty: none)."""
    return {_layer(name): t[0] for name, t in families.get(ROUTER, {}).items()}


def save_router_chunks(stage) -> list[Chunk]:
    """What this rank writes of the router state (nothing without MoE, or off the stage's first rank)."""
    state = getattr(stage, "moe_router_state", None)
    if not state or stage.state.dp_rank != 0 or stage.state.tp_rank != 0:
        return []
    return [Chunk(_fqn(i), (0, 0), tuple(t.shape), t) for i, t in sorted(state.items())]


def load_router_chunks(keys, experts: int) -> tuple[list[Chunk], dict[int, torch.Tensor]]:
    """Chunks to read every layer's router state the checkpoint holds (``keys``: its names; ``experts``: its
    model's count, the same as this run's), and the tensors they fill (global layer -> ``[2, E]``): a few
    floats per layer, read on every rank whatever its stage."""
    prefix = f"{ROUTER}/"
    tensors = {_layer(k[len(prefix):]): torch.zeros(2, experts, dtype=torch.float32)
               for k in keys if k.startswith(prefix)}
    return [Chunk(_fqn(i), (0, 0), tuple(t.shape), t) for i, t in tensors.items()], tensors
