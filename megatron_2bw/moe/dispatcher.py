"""Token dispatchers over the expert-parallel group: tokens to the ranks holding their experts and back.

Rank r of an EP group of size p holds experts ``[r * E/p, (r + 1) * E/p)``. Both dispatchers hand the experts
their tokens sorted by local expert, with the count per local expert, and take the outputs back to the tokens'
rows (weighted by the routing probabilities on the way back):

- ``alltoall``: each rank sorts its assignments by expert, exchanges the counts (one small all-to-all), then
  the rows (one all-to-all with uneven splits), and re-orders the received rank-major chunks expert-major;
- ``allgather``: every rank gathers all the group's tokens and routing, computes its own experts' share of
  every token, and the shares are summed back onto the owning ranks (a reduce-scatter).

``dispatch(..., beside=f)`` and ``combine(..., beside=g)`` run ``f()`` and ``g()`` (the shared experts' two
halves) and keep their results in the handle (``during_dispatch``, ``during_combine``): with the all-to-all
dispatcher over more than one rank, while the rows are in flight, forward and backward
(``--moe-shared-expert-overlap``); otherwise after the exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_to_all, gather_rows, gather_sizes, reduce_scatter_rows, start_all_to_all, wait_all_to_all
from .permute import Permutation, permute, sort_chunks, unpermute


@dataclass
class _Handle:
    perm: Permutation
    splits: tuple[list[int], list[int]] = ([], [])  # all-to-all: (rows received per rank, sent per rank)
    chunks: torch.Tensor | None = None  # received rows per (source rank, local expert)
    sizes: list[int] | None = None  # all-gather: tokens per rank
    during_dispatch: object = None  # what ``dispatch``'s ``beside`` returned
    during_combine: object = None  # what ``combine``'s ``beside`` returned


class _Dispatcher:
    def __deepcopy__(self, memo) -> "_Dispatcher":
        return self  # stateless but for a process group: the copies of a model (2BW's versions) share it

    def __init__(self, num_experts: int, group=None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.num_local = num_experts // self.size
        self.first = self.rank * self.num_local


Beside = Callable[[], object] | None


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group, beside: Beside
              ) -> tuple[torch.Tensor, object]:
    """The rows' all-to-all, with ``beside()`` run while they travel (and its backward while their gradient
    travels back: ``comm.start_all_to_all``); ``beside``'s result (None without it)."""
    if beside is None:
        return all_to_all(rows, out_splits, in_splits, group), None
    rows, flight = start_all_to_all(rows, out_splits, in_splits, group)
    done = beside()
    return wait_all_to_all(rows, flight), done


def _after(beside: Beside) -> object:
    """``beside()`` where nothing travels to run it beside (one rank, the all-gather dispatcher); None without it."""
    return None if beside is None else beside()


class AllToAllDispatcher(_Dispatcher):
    def dispatch(self, hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, beside: Beside = None
                 ) -> tuple[torch.Tensor, list[int], _Handle]:
        rows, perm = permute(hidden, routing_map, probs)
        if self.size == 1:
            return rows, perm.counts.tolist(), _Handle(perm, during_dispatch=_after(beside))
        p, e = self.size, self.num_local
        counts = perm.counts.to(torch.int64)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [p * e]: from rank r for my expert i
        chunks = received.view(p, e)
        send = counts.view(p, e).sum(dim=1).tolist()
        recv = chunks.sum(dim=1).tolist()
        rows, done = _exchange(rows, recv, send, self.group, beside)
        rows = sort_chunks(rows, chunks, p, e)
        return rows, chunks.sum(dim=0).tolist(), _Handle(perm, (recv, send), chunks, during_dispatch=done)

    def combine(self, rows: torch.Tensor, h: _Handle, beside: Beside = None) -> torch.Tensor:
        if self.size > 1:
            p, e = self.size, self.num_local
            rows = sort_chunks(rows, h.chunks.t(), e, p)  # expert-major back to rank-major
            recv, send = h.splits
            rows, h.during_combine = _exchange(rows, send, recv, self.group, beside)
        else:
            h.during_combine = _after(beside)
        return unpermute(rows, h.perm)


class AllGatherDispatcher(_Dispatcher):
    def dispatch(self, hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, beside: Beside = None
                 ) -> tuple[torch.Tensor, list[int], _Handle]:
        sizes = None
        if self.size > 1:
            sizes = gather_sizes(hidden.shape[0], self.group, hidden.device)
            hidden = gather_rows(hidden, sizes, self.group)
            probs = gather_rows(probs, sizes, self.group)
            routing_map = gather_rows(routing_map.to(torch.uint8), sizes, self.group).bool()
        mine = slice(self.first, self.first + self.num_local)
        rows, perm = permute(hidden, routing_map[:, mine], probs[:, mine])
        return rows, perm.counts.tolist(), _Handle(perm, sizes=sizes, during_dispatch=_after(beside))

    def combine(self, rows: torch.Tensor, h: _Handle, beside: Beside = None) -> torch.Tensor:
        out = unpermute(rows, h.perm)
        h.during_combine = _after(beside)
        return out if self.size == 1 else reduce_scatter_rows(out, h.sizes, self.group)


def make_dispatcher(kind: str, num_experts: int, group=None) -> AllToAllDispatcher | AllGatherDispatcher:
    """``--moe-token-dispatcher-type`` -> its dispatcher over ``group`` (None: EP = 1)."""
    return {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}[kind](num_experts, group)
