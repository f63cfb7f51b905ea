"""Expert capacity and token dropping (only with ``--moe-expert-capacity-factor``; dropless otherwise).

Megatron-Core's rule, on a rank's own tokens: capacity ``C = ceil(T * k / E * factor)``; an expert over it
keeps the C tokens with the highest routing probability (``probs``) or the first C in token order
(``position``); ``--moe-pad-expert-input-to-capacity`` then fills every expert up to exactly C with tokens of
weight 0, so each expert's input has a fixed shape.
"""

from __future__ import annotations

import math

import torch


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Tokens one expert takes: ``ceil(T * k / E * factor)``."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_tokens(routing_probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float,
                policy: str = "probs", pad_to_capacity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, map) ``[T, E]`` with each expert's tokens cut to its capacity (and padded to it if asked)."""
    t, e = routing_probs.shape
    cap = expert_capacity(t, e, topk, factor)
    if cap > t:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        chosen = torch.topk(routing_probs, k=cap, dim=0, sorted=False)[1]
        keep = torch.zeros_like(routing_map).scatter(0, chosen, True)
    else:
        keep = _first_in_order(routing_map, cap)
    final_map = keep if pad_to_capacity else routing_map & keep
    return routing_probs * final_map, final_map


def _first_in_order(routing_map: torch.Tensor, cap: int) -> torch.Tensor:
    """Per expert, its first ``cap`` routed tokens in token order, then (for padding) the first unrouted ones
    up to ``cap`` in all."""
    routed = torch.cumsum(routing_map.int(), dim=0)
    kept = routed[-1:].clamp(max=cap)
    unrouted = torch.cumsum((~routing_map).int(), dim=0) + kept
    return torch.where(routing_map, routed <= cap, unrouted <= cap)
