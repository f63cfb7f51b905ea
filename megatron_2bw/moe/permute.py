"""Sorting tokens by expert and back: the local half of every dispatcher.

``permute`` lists each (token, expert) assignment of a routing map in expert-major order (tokens ascending
within an expert); ``unpermute`` weighs each expert output by its routing probability and adds it back to its
token's row (index_add in that same order: the EP = 1 and EP > 1 sums add in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Permutation:
    token_idx: torch.Tensor  # [N] the token of each sorted row
    probs: torch.Tensor  # [N] its routing probability
    counts: torch.Tensor  # [E] rows per expert
    num_tokens: int


def permute(hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
            ) -> tuple[torch.Tensor, Permutation]:
    """(rows of ``hidden`` sorted by expert ``[N, H]``, how to undo it)."""
    pairs = routing_map.t().nonzero()  # (expert, token), expert-major
    expert_idx, token_idx = pairs[:, 0], pairs[:, 1]
    perm = Permutation(token_idx, probs[token_idx, expert_idx], routing_map.sum(dim=0), hidden.shape[0])
    return hidden.index_select(0, token_idx), perm


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """``[T, H]``: each token's expert outputs weighted by their probabilities, summed."""
    weighted = rows * perm.probs.unsqueeze(-1).to(rows.dtype)
    out = rows.new_zeros((perm.num_tokens, rows.shape[-1]))
    return out.index_add(0, perm.token_idx, weighted)


def sort_chunks(x: torch.Tensor, sizes: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` in ``rows x cols`` chunks (row-major, ``sizes`` ``[rows, cols]``) re-ordered column-major."""
    parts = torch.split(x, sizes.flatten().tolist(), dim=0)
    return torch.cat([parts[r * cols + c] for c in range(cols) for r in range(rows)], dim=0)
