"""Loss reductions over the context-parallel group: every rank ends with the microbatch's whole loss.

The forward sums each rank's part over the group; the backward is the identity, so each rank back-propagates
the whole loss's gradient with respect to its own tokens' terms only, and the gradients summed over the group
(the reducer's replica group contains it) are the whole microbatch's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import CPGroup


class _SumForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=cp.group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def cp_sum(x: torch.Tensor, cp: CPGroup | None) -> torch.Tensor:
    """``x`` summed over the context group (forward); identity backward."""
    return x if cp is None or cp.size == 1 else _SumForward.apply(x, cp)


def masked_mean(losses: torch.Tensor, mask: torch.Tensor, cp: CPGroup | None) -> torch.Tensor:
    """Mean of ``losses`` over the tokens ``mask`` selects, over the whole sequence of the context group
    (one all-reduce of two numbers per microbatch)."""
    num, den = (losses * mask).sum(), mask.sum().to(losses.dtype)
    if cp is None or cp.size == 1:
        return num / den.clamp(min=1)
    both = cp_sum(torch.stack([num, den]), cp)
    return both[0] / both[1].clamp(min=1)


def first_token_only(x: torch.Tensor, cp: CPGroup | None) -> torch.Tensor:
    """A loss term computed on the sequence's first token (BERT's sentence order from its [CLS]): that
    token lives on context rank 0, whose term every rank then holds; the others contribute zero."""
    if cp is None or cp.size == 1:
        return x
    return cp_sum(x * (1.0 if cp.rank == 0 else 0.0), cp)
