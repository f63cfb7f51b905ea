"""The schedule spec: what every other module asks a schedule, with the defaults of the flushing 1F1B
(PipeDream-Flush), and the glue lowering (``_fragment``) that adds a compute's transfers around it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

from ..errors import ConfigError
from .actions import Action, Op
from .placement import Placement

Order = list[tuple[bool, int]]  # (is_forward, microbatch) in the order a stage runs them
# per stage: past this many microbatches per rank of depth the order's steady state only repeats, so its
# footprint (and the planner's replayed bubble) is taken there (``tests/test_schedule_footprint.py``)
REPLAY_MICROBATCHES = 4


def _footprint(ops) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """(most microbatches forwarded and not yet through their weight gradient (W, or a whole B), most between
    their input gradient (I) and their W, the Pareto front of the (F..I, I..W) counts) over a stage's ops."""
    a = b = most_a = most_b = 0
    seen = {(0, 0)}
    for op in ops:
        if op is Op.FORWARD:
            a += 1
        elif op is Op.BACKWARD:
            a -= 1
        elif op is Op.BACKWARD_INPUT:
            a, b = a - 1, b + 1
        elif op is Op.BACKWARD_WEIGHT:
            b -= 1
        else:
            continue
        most_a, most_b = max(most_a, a + b), max(most_b, b)
        seen.add((a, b))
    front, most = [], -1  # a point is on the front iff its b beats every point of a larger (or equal, larger b) a
    for p in sorted(seen, reverse=True):
        if p[1] > most:
            front.append(p)
            most = p[1]
    return most_a, most_b, tuple(sorted(front))


@functools.lru_cache(maxsize=1 << 16)
def _fragment(forward: bool, mb: int, step: int, version: int, has_prev: bool, has_next: bool,
              chunk: int = 0) -> tuple[Action, ...]:
    """One compute action with the point-to-point communication wrapped around it.

    Interned: every stage (and every (d, m) with the same m) shares these immutable
    objects, which keeps generating all schedules for the exhaustive checker cheap.
    ``has_prev``/``has_next``: whether the chunk's virtual stage has a stage before / after it.
    """
    c = chunk
    if forward:
        recv = (Action(Op.RECV_ACT, mb, step, chunk=c),) if has_prev else ()
        send = (Action(Op.SEND_ACT, mb, step, chunk=c),) if has_next else ()
        return (*recv, Action(Op.FORWARD, mb, step, version, c), *send)
    recv = (Action(Op.RECV_GRAD, mb, step, chunk=c),) if has_next else ()
    send = (Action(Op.SEND_GRAD, mb, step, chunk=c),) if has_prev else ()
    return (*recv, Action(Op.BACKWARD, mb, step, version, c), *send)


def _one_f_one_b(lo: int, count: int, warmup: int) -> Order:
    """Order of 1F1B over microbatches lo..lo+count-1 with ``warmup`` forwards first."""
    warmup = min(warmup, count)
    order = [(True, lo + i) for i in range(warmup)]
    for i in range(count - warmup):
        order.append((True, lo + warmup + i))
        order.append((False, lo + i))
    order.extend((False, i) for i in range(lo + count - warmup, lo + count))
    return order


@dataclass(frozen=True)
class ScheduleSpec:
    """A flushing 1F1B schedule (PipeDream-Flush); subclasses change what differs.

    ``grad_buffers``: gradient buffers the executor keeps (2 lets step t+1's backwards accumulate
    while step t's reduction runs); ``stale_steps``: how many updates behind the newest weights a
    step's microbatches run.
    """

    name: str
    weight_versions: int = 1
    grad_buffers: int = 1
    stale_steps: int = 0
    chunks: int = 1  # model chunks (virtual stages) per rank: 2 for interleaved and V layouts
    split_backward: bool = False  # backwards run as BACKWARD_INPUT then BACKWARD_WEIGHT (zero-bubble)
    # optimizer post-validation (--enable-optimizer-post-validation, :meth:`with_post_validation`): each update
    # but a segment's last is speculative, checked against the global norm in the next step's warm-up
    post_validation: bool = False

    def min_microbatches(self, d: int) -> int:
        """Fewest microbatches per step the schedule runs at depth ``d``."""
        return 1

    # whether the order's footprint stops growing past ``REPLAY_MICROBATCHES * d`` microbatches (GPipe's
    # does not: it forwards every microbatch of the step before any backward)
    steady_state: ClassVar[bool] = True

    @functools.lru_cache(maxsize=1 << 14)  # noqa: B019 - specs are frozen module-level singletons
    def footprint(self, d: int, r: int, m: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """:func:`_footprint` of stage ``r``'s compute order, on at most ``REPLAY_MICROBATCHES * d``
        microbatches where the steady state repeats (2BW's stream across steps holds what one step's
        1F1B holds)."""
        n = min(m, REPLAY_MICROBATCHES * d) if self.steady_state else m
        return _footprint(op for op, _, _ in self.compute_order(d, r, n))

    def compute_order(self, d: int, r: int, m: int) -> tuple[tuple[Op, int, int], ...]:
        """Stage ``r``'s computes of one step of ``m`` microbatches, in order: the one shape every schedule
        gives, ``(op, chunk, microbatch)`` (FORWARD, BACKWARD or its halves I and W)."""
        return tuple((Op.FORWARD if fwd else Op.BACKWARD, 0, mb) for fwd, mb in self.order(d, r, 0, m))

    def inflight(self, d: int, r: int, m: int) -> int:
        """Most microbatches stage ``r`` holds forwarded and not yet through their weight gradient (a whole
        backward, or W of a split one): counted on the generated order, per FORWARD action, so with
        ``chunks`` > 1 in chunk-microbatches (each ``1/chunks`` of the rank's stash; the planner converts)."""
        return self.footprint(d, r, m)[0]

    def bubble(self, d: int, m: int) -> float:
        """Ideal idle fraction per step with equal-cost microbatches: a fill and a drain every step."""
        return (d - 1) / (m + d - 1)

    def bubble_slots(self, d: int) -> float:
        """Extra microbatch slots per step: the fill and the drain."""
        return d - 1

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """Ideal idle time per step of a stage whose forward, input-gradient half and weight-gradient
        half of one microbatch (all of the rank's chunks together) take ``f``, ``b`` and ``w`` seconds
        (a whole backward is ``b + w``): what the planner prices. Schedules that split the backward or
        interleave chunks override it (ZB-H1: ``(d - 1) * (f + b - w)``)."""
        return self.bubble_slots(d) * (f + b + w)

    def deferred_weight_grads(self, d: int, r: int, m: int) -> int:
        """Most microbatches stage ``r`` holds input-gradient-done but weight-gradient-pending (their
        layer inputs and output gradients stay alive until W), counted on the order: 0 unless the backward
        is split."""
        return self.footprint(d, r, m)[1]

    def held_pairs(self, d: int, r: int, m: int) -> tuple[tuple[int, int], ...]:
        """The (forwarded, not input-gradiented; input-gradiented, not weight-gradiented) counts stage ``r``
        holds at the moments that can be its memory peak (the Pareto front over its order): a microbatch
        keeps its whole stash until its I and only what its W reads after it, so the peak is the largest
        ``a * stash + b * deferred`` over these pairs. Without a split backward: one pair, ``(inflight, 0)``."""
        return self.footprint(d, r, m)[2]

    def placement(self, d: int) -> Placement:
        """Which rank holds which virtual stage at depth ``d`` (one chunk: stage ``r`` on rank ``r``)."""
        return Placement(d, self.chunks)

    def with_chunks(self, chunks: int | None) -> ScheduleSpec:
        """This schedule with ``chunks`` model chunks per rank (None: its own); only schedules built for
        virtual stages take another count."""
        if chunks is None or chunks == self.chunks:
            return self
        raise ConfigError(f"pipeline schedule {self.name} runs {self.chunks} model chunk(s) per rank, not {chunks} "
                          "(--virtual-pipeline-model-parallel-size needs --pipeline-schedule interleaved-1f1b)")

    def with_post_validation(self, on: bool) -> ScheduleSpec:
        """This schedule with optimizer post-validation ``on``: only the zero-bubble schedules take it, whose step
        starts with forwards of the first chunk on every stage (what a speculative update overlaps; see
        :func:`_post_validated`), with one chunk or in a V (its first chunk's stages are the ranks in order)."""
        if on == self.post_validation:
            return self
        if on and not (self.split_backward and (self.chunks == 1 or self.placement(2).shape == "v")):
            raise ConfigError(f"--enable-optimizer-post-validation applies to the zero-bubble schedules "
                              f"(zb-h1, zb-h2, zb-v), not {self.name}")
        return replace(self, post_validation=on)

    def check_layout(self, d: int, m: int) -> None:
        """Refuse (one line) a depth / microbatch count the schedule's own rules exclude (beyond
        :meth:`min_microbatches`): nothing by default."""

    def version(self, step: int) -> int:
        """The weight version W(v) every microbatch of ``step`` runs on (forward and backward)."""
        return max(step - self.stale_steps, 0)

    def order(self, d: int, r: int, lo: int, count: int) -> Order:
        """Forward/backward order of stage ``r`` over ``count`` microbatches from ``lo``."""
        return _one_f_one_b(lo, count, d - r - 1)

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        """Stage ``r``'s ordered actions for a drained segment (unvalidated: see :func:`stage_actions`).

        A flushing schedule fills, drains, reduces and applies each step on its own."""
        out: list[Action] = []
        for t in range(first_step, first_step + num_steps):
            v = self.version(t)
            for forward, mb in self.order(d, r, t * m, m):
                out.extend(_fragment(forward, mb, t, v, r > 0, r < d - 1))
            out.append(Action(Op.REDUCE_GRADS, step=t))
            out.append(Action(Op.APPLY_UPDATE, step=t))
        return out
