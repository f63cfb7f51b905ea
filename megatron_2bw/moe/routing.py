"""Top-k routing as Megatron-Core states it: which experts each token goes to and with what weight.

Pure functions of the router's logits (and, for the aux-loss-free balancing, an explicit expert bias), so that
a caller that versions router state (2BW keeps two weight versions) passes the bias of the version it runs:

- softmax (default): top-k on the logits, then softmax over the k chosen (= softmax, top-k, renormalise);
- pre-softmax: softmax over all experts, then top-k, not renormalised;
- sigmoid: choose on ``sigmoid(logits) + expert_bias``, weigh by the unbiased sigmoid, renormalised when k > 1;
- group-limited: experts in ``num_groups`` equal groups; a token picks the ``group_topk`` groups whose best
  ``topk / group_topk`` scores sum highest, then its k experts inside them;
- a scaling factor multiplies the weights last.
"""

from __future__ import annotations

import torch


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the top-k over the experts of each token's best ``group_topk`` groups."""
    t, e = scores.shape
    group_scores = scores.view(t, num_groups, e // num_groups).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


def _topk(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, k=topk, dim=1)


def topk_routing(logits: torch.Tensor, topk: int, *, score_function: str = "softmax", pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs ``[T, k]``, expert indices ``[T, k]``) of ``logits`` ``[T, E]`` (same dtype as the logits)."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, idx = _topk(scores, topk, num_groups, group_topk)
        else:
            scores, idx = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = _topk(scores + expert_bias, topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=idx).type_as(logits)
        else:
            scores, idx = _topk(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"unknown score function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    return probs, idx


def dense_routing(probs: torch.Tensor, idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing probs ``[T, E]``, routing map ``[T, E]`` bool) of the top-k ``probs``/``idx``."""
    routing_probs = torch.zeros(probs.shape[0], num_experts, dtype=probs.dtype, device=probs.device)
    routing_probs = routing_probs.scatter(1, idx, probs)
    routing_map = torch.zeros(probs.shape[0], num_experts, dtype=torch.bool, device=probs.device)
    return routing_probs, routing_map.scatter(1, idx, True)


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map ``[T, E]``, scores ``[T, E]``) the load-balancing losses see: softmax over all experts (or
    the sigmoid normalised per token) and its plain top-k, whatever bias or groups the routing itself used."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, idx = torch.topk(scores, k=topk, dim=1)
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True), scores
