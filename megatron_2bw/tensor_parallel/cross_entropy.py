"""Vocab-parallel cross-entropy: the loss over a vocabulary split across ranks, never gathering logits.

Each rank holds logits for its slice of the padded vocabulary. Three all-reduces over the
tensor group (max, target logit, sum of exponentials) give the exact softmax cross-entropy.
Padded vocabulary entries are masked to -inf, so the loss does not depend on t (Megatron-LM
lets them into the softmax).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import TPGroup
from .mappings import all_reduce


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: TPGroup):
        per_rank = logits.shape[-1]
        start = tp.rank * per_rank
        # one fp32 buffer of its own, worked on in place from here on (the softmax it ends as is saved)
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        n_real = vocab_size - start  # real columns on this rank (may be <= 0 or > per_rank)
        if n_real < per_rank:
            logits[..., max(n_real, 0):] = float("-inf")
        local_max = logits.max(dim=-1).values
        local_max = all_reduce(local_max, tp, dist.ReduceOp.MAX)
        logits.sub_(local_max.unsqueeze(-1))
        local_t = target - start
        outside = (local_t < 0) | (local_t >= per_rank)
        local_t = local_t.masked_fill(outside, 0)
        predicted = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        predicted = all_reduce(predicted, tp)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        sum_exp = all_reduce(sum_exp, tp)
        loss = torch.log(sum_exp) - predicted
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax  # in place, as Megatron does: the loss's graph is run backward once (no retain_graph)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: TPGroup
) -> torch.Tensor:
    """Per-token loss (fp32) from this rank's logits ``[..., padded_vocab / t]`` and full targets.

    ``vocab_size`` is the real (unpadded) vocabulary size; columns at or past it are masked out.
    """
    return _VocabParallelCE.apply(logits, target, vocab_size, tp)
