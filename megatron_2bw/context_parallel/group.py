"""The context-parallel group and the load-balanced order of a sequence over it.

A sequence of ``s`` tokens is cut into ``2c`` chunks of ``L = s / 2c``; rank ``r`` holds chunks ``r`` and
``2c - 1 - r`` (Megatron's order), so under causal attention every rank has the same work: an early chunk
sees few keys, its late partner many. Every rank reads the whole microbatch and keeps its two chunks
(:func:`shard_batch`); masks keep their rows for the local queries and all their columns (the keys of
every rank, in sequence order), so any mask works with every communication type. Documents
(``--reset-attention-mask``) travel as their ids ``[b, s]`` (:func:`is_document_ids`), kept whole: each
core builds only the mask rows and columns it needs from them, tile by tile (``blocks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.context import P2P

SEQ_KEYS = ("tokens", "labels", "loss_mask", "token_types", "position_ids")  # [b, s] tensors cut along s


@dataclass(frozen=True)
class CPGroup:
    """Context-parallel process group, this rank's index in it, its size, ``--cp-comm-type``, and the
    group's global ranks in context order (the ring's neighbours). Group None when size 1."""

    group: object | None = None
    rank: int = 0
    size: int = 1
    comm_type: str = P2P
    ranks: tuple[int, ...] = (0,)

    def __deepcopy__(self, memo) -> CPGroup:
        return self  # a handle to a process group: copies of a model share it

    @classmethod
    def from_state(cls, state, comm_type: str = P2P) -> CPGroup:
        return cls(state.groups.cp, state.cp_rank, state.c, comm_type, tuple(state.cp_ranks))

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two global chunk numbers (of ``2c``) that ``rank`` holds, early one first."""
        return rank, 2 * self.size - 1 - rank

    @property
    def chunks(self) -> tuple[int, int]:
        return self.chunks_of(self.rank)

    def positions(self, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of this rank's ``2L`` tokens of a length-``s`` sequence, in local order."""
        return positions_of(s, self.size, self.rank, device)

    @property
    def prev(self) -> int:
        """Global rank of the ring's previous member (this rank receives from it)."""
        return self.ranks[(self.rank - 1) % self.size]

    @property
    def next(self) -> int:
        """Global rank of the ring's next member (this rank sends to it)."""
        return self.ranks[(self.rank + 1) % self.size]


def positions_of(s: int, c: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of rank ``rank``'s two chunks of a length-``s`` sequence split over ``c`` ranks."""
    if s % (2 * c):
        raise ValueError(f"sequence length {s} is not divisible by 2 x context-parallel size {c}")
    n = s // (2 * c)
    a, b = rank, 2 * c - 1 - rank
    return torch.cat([torch.arange(a * n, (a + 1) * n, device=device), torch.arange(b * n, (b + 1) * n, device=device)])


def mask_rows(mask: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Query rows ``lo:hi`` of a sharded mask: a per-query mask ``[b, 1, 2L, s]``'s rows, a key-only mask
    ``[b, 1, 1, s]`` (it applies to every row) as it is; its key columns stay whole, in sequence order."""
    return mask if mask is None or mask.shape[-2] == 1 else mask[..., lo:hi, :]


def is_document_ids(mask: torch.Tensor | None) -> bool:
    """Whether an attention mask is documents' ids ``[b, s]`` (a query sees the keys of its own document at
    or before it) rather than a boolean mask ``[b, 1, rows, s]``."""
    return mask is not None and mask.dim() == 2


def rank_order(c: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global position of each token of every rank's two chunks (``n`` tokens each) concatenated in rank
    order; indexing a sequence-ordered tensor with it gives the rank order."""
    return torch.cat([positions_of(2 * c * n, c, r, device) for r in range(c)])


def sequence_order(c: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Indices taking every rank's two chunks, gathered in rank order, into sequence order."""
    return rank_order(c, n, device).argsort()


def shard_batch(batch: dict, cp: CPGroup) -> dict:
    """This rank's part of a whole microbatch: the ``[b, s]`` fields cut to its two chunks, masks'
    query rows likewise (their key columns kept whole), and ``position_ids`` (the global positions) added
    when absent, so learned position embeddings take the right rows."""
    if cp.size == 1:
        return batch
    s = batch["tokens"].shape[1]
    idx = cp.positions(s, batch["tokens"].device)
    out = dict(batch)
    for key in SEQ_KEYS:
        if key in batch:
            out[key] = batch[key].index_select(1, idx)
    if "position_ids" not in batch:
        out["position_ids"] = idx.expand(batch["tokens"].shape[0], -1)
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 4 and mask.shape[-2] == s:  # [b, 1, s, s]: rows are queries
        out["attention_mask"] = mask.index_select(-2, idx)
    return out
