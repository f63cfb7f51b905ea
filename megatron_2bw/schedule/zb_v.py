"""ZB-V: two chunks per rank in a V placement, zero bubble with split backward."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import ConfigError
from .actions import Action, Op
from .placement import Placement
from .rounds import _flushed_steps, lower_rounds
from .zero_bubble import SplitOrder, _ZeroBubble, validation_cut


@dataclass(frozen=True)
class _ZBV(_ZeroBubble):
    """ZB-V (Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble`` order): two chunks per rank in a V,
    chunk 0 of rank r is virtual stage r, chunk 1 is 2d - 1 - r, so rank d-1 hands its chunk 0's output to its
    chunk 1 itself and rank 0 holds both the embedding and the head (the tied embedding is local there);
    split backward, W deferred into the bubbles, one weight version, a flush per step. Needs m >= 2d - 1
    (rank 0 runs 2d - 1 warm-up forwards). Units: :meth:`inflight` and :meth:`deferred_weight_grads` count
    one chunk's stashes (half a rank's layers), as for interleaved-1f1b."""

    chunks: int = 2

    def placement(self, d: int) -> Placement:
        return Placement(d, 2, "v")

    def min_microbatches(self, d: int) -> int:
        return 2 * d - 1

    def check_layout(self, d: int, m: int) -> None:
        if d < 2:
            raise ConfigError("zb-v needs --pipeline-model-parallel-size >= 2 (its V turns on the last rank)")

    def compute_order(self, d: int, r: int, m: int) -> tuple[tuple[Op, int, int], ...]:
        return tuple(self.chunk_order(d, r, m))

    def chunk_order(self, d: int, r: int, m: int) -> list[tuple[Op, int, int]]:
        """(F, I or W; chunk; microbatch) of rank ``r`` over one step: torch's ZBV order."""
        return list(_zbv_order(d, r, m))

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        raise NotImplementedError("zb-v orders (op, chunk, microbatch): see chunk_order")

    @functools.lru_cache(maxsize=1 << 14)  # noqa: B019 - specs are frozen module-level singletons
    def bubble_slots(self, d: int) -> float:  # type: ignore[override]
        return _ZeroBubble.bubble_slots(self, d) / 2

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """One step of the generated programs replayed with each chunk's share (half) of these times (on
        the same shortcuts as :meth:`_ZeroBubble.bubble_time`)."""
        return _ZeroBubble.bubble_time(self, d, m, f / 2, b / 2, w / 2)

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        cut = validation_cut(d, r) if self.post_validation else None
        return _flushed_steps(self, _zbv_lowered(self.placement(d), d, m)[r], m, first_step, num_steps, cut)


@functools.lru_cache(maxsize=1 << 10)
def _zbv_lowered(place: Placement, d: int, m: int) -> tuple[tuple[tuple[Op, int, int], ...], ...]:
    """Every rank's lowered program of one step, made once per layout: the planner's replays ask for it per rank
    and per candidate, and building the rounds to look :func:`lower_rounds` up cost as much as a replay."""
    return lower_rounds(place, tuple(tuple((x,) for x in _zbv_order(d, q, m)) for q in range(d)))


@functools.lru_cache(maxsize=1 << 12)
def _zbv_order(d: int, r: int, m: int) -> tuple[tuple[Op, int, int], ...]:
    """torch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (m >= 2d - 1): chunk 0 warms up with
    2(d - r) - 1 forwards, then F1/F0 pairs, then F1 I1 W1 triples, a steady F0 I0 W0 F1 I1 W1, and a
    cool-down whose deferred Ws fill the drain."""
    F, I, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    out: list[tuple[Op, int, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (d - r) - 1):
        out.append((F, 0, f0))
        f0 += 1
    for _ in range(r):
        out += [(F, 1, f1), (F, 0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(d - r):
        out += [(F, 1, f1), (I, 1, b1), (W, 1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < m:
        if f0 < m:
            out.append((F, 0, f0))
            f0 += 1
        out += [(I, 0, b0), (W, 0, b0), (F, 1, f1), (I, 1, b1), (W, 1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [(I, 0, b0), (I, 1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(d - r):
        out += [(I, 0, b0), (W, 0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [(W, 1, j) for j in range(w1, b1)] + [(W, 0, j) for j in range(w0, b0)]
    return tuple(out)
