"""The load-balancing losses (Switch aux loss, DeepSeek's sequence aux loss, ST-MoE's z-loss) and the
autograd function that injects their gradient into the activations of the call that made them.

Injecting per call (Megatron-Core's ``MoEAuxLossAutoScaler``) makes the losses schedule-agnostic: whatever
order a pipeline schedule runs forwards and backwards in, a microbatch's backward carries its own routing
losses' gradient, scaled by what the caller sets (``1 / microbatches`` and the loss scale, as the main loss).
"""

from __future__ import annotations

import torch


def switch_aux_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int,
                    num_experts: int, coeff: float) -> torch.Tensor:
    """``coeff * E / (k T^2) * sum_e (sum_t p_te) * count_e`` (= coeff * E * sum_e f_e P_e; balanced: coeff)."""
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens))


def sequence_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, seq_length: int, batch: int, topk: int,
                      num_experts: int, coeff: float, group_size: int = 1,
                      counts: torch.Tensor | None = None) -> torch.Tensor:
    """The aux loss of each sequence, averaged over the ``batch`` sequences (tokens ordered ``[s, b]``).

    Megatron-Core's construction: the batch axis is folded into the expert axis (``[s, b * E]``), so one Switch
    loss over it sums the sequences' losses. ``counts``: the tokens per (sequence, expert) summed over the
    ranks that hold parts of each sequence (``group_size`` of them; None: this rank's own).
    """
    scores = scores.reshape(seq_length, -1)
    if counts is None:
        counts = routing_map.reshape(seq_length, -1).sum(dim=0)
    total = seq_length * group_size
    return switch_aux_loss(scores, counts, total, topk, num_experts, coeff) / batch


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t(logsumexp(logits_t)^2)``: keeps the router's logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


class InjectLoss(torch.autograd.Function):
    """Identity on ``x``; in backward, ``loss`` receives the gradient ``scale`` (its value never enters ``x``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def inject_loss(x: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x`` whose backward also back-propagates ``scale * loss`` (a no-op when nothing needs a gradient)."""
    if not (loss.requires_grad and torch.is_grad_enabled()):
        return x
    return InjectLoss.apply(x, loss, scale)
