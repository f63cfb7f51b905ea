"""Schedule facts the planner's memory and cost models ask for tens of thousands of times per search,
looked up once.

``spec_of`` of an id with post-validation builds a new spec each call, and a split backward's
``held_pairs`` walks the stage's whole order; both depend only on the registry's entry and their
arguments, so they are cached here, keyed by that entry (a schedule a test registers under a name gets
its own entries).
"""

from __future__ import annotations

import functools

from ..schedule.schedules import SCHEDULES, ScheduleSpec, parse_schedule_id
from ..schedule.schedules import spec_of as registry_spec_of

_SPECS: dict[str, tuple[ScheduleSpec | None, ScheduleSpec]] = {}  # id -> (the registry's entry, its spec)


def spec_of(sid: str) -> ScheduleSpec:
    """``schedule.schedules.spec_of(sid)``, once per registry entry."""
    entry = SCHEDULES.get(parse_schedule_id(sid)[0])
    hit = _SPECS.get(sid)
    if hit is None or hit[0] is not entry:
        hit = _SPECS[sid] = (entry, registry_spec_of(sid))
    return hit[1]


@functools.lru_cache(maxsize=1 << 15)
def held_pairs(spec: ScheduleSpec, d: int, stage: int, m: int) -> tuple[tuple[int, int], ...]:
    """``spec.held_pairs(d, stage, m)``, once."""
    return spec.held_pairs(d, stage, m)
