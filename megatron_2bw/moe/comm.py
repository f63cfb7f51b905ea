"""Differentiable collectives over the expert group, with uneven sizes (what token dispatch needs).

- ``all_to_all``: rows ``in_splits[r]`` go to rank r, ``out_splits[r]`` come from it; backward is the
  all-to-all with the splits swapped (gloo's ``all_to_all_single`` takes uneven splits).
- ``gather_rows``: every rank's rows concatenated in rank order (rank r has ``sizes[r]``); backward sums the
  gradient of a rank's rows over the ranks (a reduce-scatter, done as all-reduce + slice: gloo has no
  reduce-scatter of uneven parts).
- ``reduce_scatter_rows``: the reverse of ``gather_rows`` (forward sums, backward gathers).
- ``start_all_to_all`` / ``wait_all_to_all``: ``all_to_all`` with other work run while it is in flight, both
  ways (``--moe-shared-expert-overlap``): :func:`start_all_to_all` issues it and returns at once, the work runs,
  :func:`wait_all_to_all` waits. In backward the order reverses by itself: autograd runs the later-made
  ``wait``'s backward first (it issues the gradient's all-to-all), then the work's backward (made between the
  two), then the ``start``'s (it waits), the engine taking ready nodes latest-made first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:r]):...]`` to rank r; what each rank sends here, in rank order."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _InFlight:
    """One all-to-all issued and not yet waited for, in forward and then in backward: its work, the tensors it
    reads and writes (kept alive until it completes), the splits and the group."""

    def __init__(self, out_splits: list[int], in_splits: list[int], group) -> None:
        self.splits, self.group = (out_splits, in_splits), group
        self.work = self.sent = self.received = None

    def issue(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        self.sent = x.contiguous()
        self.received = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.work = dist.all_to_all_single(self.received, self.sent, out_splits, in_splits, group=self.group,
                                           async_op=True)
        return self.received

    def wait(self) -> torch.Tensor:
        self.work.wait()
        out, self.work, self.sent, self.received = self.received, None, None, None
        return out


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):  # type: ignore[override]
        ctx.flight = flight
        return flight.issue(x, *flight.splits)

    @staticmethod
    def backward(ctx, _placeholder):  # type: ignore[override]
        return ctx.flight.wait(), None  # the gradient's all-to-all, issued by _Wait's backward


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, flight):  # type: ignore[override]
        ctx.flight = flight
        flight.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.flight.splits
        ctx.flight.issue(grad, in_splits, out_splits)
        return grad, None  # a placeholder: _Start's backward returns the real gradient once it arrives


def start_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group
                     ) -> tuple[torch.Tensor, _InFlight]:
    """``all_to_all`` issued, not waited for: (its output, not to be read before :func:`wait_all_to_all`,
    and the handle to wait on)."""
    flight = _InFlight(out_splits, in_splits, group)
    return _Start.apply(x, flight), flight


def wait_all_to_all(out: torch.Tensor, flight: _InFlight) -> torch.Tensor:
    """The output of :func:`start_all_to_all`, once it has arrived."""
    return _Wait.apply(out, flight)


def _gather(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rank-ordered concatenation of uneven rows: pad to the largest, all-gather, strip the padding."""
    most = max(sizes)
    padded = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]) if x.shape[0] < most else x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _sum_own_rows(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _sum_own_rows(grad, ctx.sizes, dist.get_rank(ctx.group), ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _sum_own_rows(x, sizes, dist.get_rank(group), group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather(grad, ctx.sizes, ctx.group), None, None


def gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    return _GatherRows.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    return _ReduceScatterRows.apply(x, sizes, group)


def gather_sizes(n: int, group, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's row count (one small all-gather)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(v) for v in out]
