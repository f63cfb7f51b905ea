"""The forward-only program of an evaluation: every microbatch through every chunk of the model, lowered
with the same ``rounds`` pass as the training programs, so an evaluation's transfers are grouped, ordered
and proved like a training step's (the checker's ``check_grouped_actions`` runs on it in the tests)."""

from __future__ import annotations

import functools

from .actions import Action, Op
from .placement import Placement
from .rounds import lower_rounds


@functools.lru_cache(maxsize=64)
def _programs(place: Placement, n: int) -> tuple[tuple[tuple[Op, int, int], ...], ...]:
    # microbatch by microbatch through each rank's chunks in turn: on the ring of chunks (rank d-1 feeds
    # rank 0) each rank's transfers then come in the order its peers issue theirs
    rounds = tuple(tuple(((Op.FORWARD, c, i),) for i in range(n) for c in range(place.chunks)) for _ in range(place.d))
    return lower_rounds(place, rounds)


def evaluation_program(place: Placement, r: int, n: int) -> list[Action]:
    """Rank ``r``'s actions for a forward-only pass of ``n`` microbatches (FORWARD, RECV_ACT, SEND_ACT)."""
    return [Action(op, mb, chunk=c) for op, c, mb in _programs(place, n)[r]]
