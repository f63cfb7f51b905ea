"""Every schedule's footprint (stashes held, deferred weight gradients, the (F..I, I..W) pairs a memory peak
can sit at) is counted on its generated order (``ScheduleSpec.footprint``); the closed forms each schedule
used to state are kept here as the oracles, and the counts on ``REPLAY_MICROBATCHES * d`` microbatches equal
the counts on the full order."""

import pytest

from megatron_2bw.schedule.actions import Op
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, get_schedule
from megatron_2bw.schedule.spec import REPLAY_MICROBATCHES, _footprint


def _closed_inflight(name: str, d: int, r: int, m: int, chunks: int) -> int | None:
    """The closed forms (None where a schedule never had one: ZB-V was counted on its order)."""
    if name in ("flush", "2bw"):
        return min(d - r, m)
    if name == "gpipe":
        return m
    if name == "interleaved-1f1b":  # Megatron's num_warmup_microbatches, plus the first steady forward
        return min(min((chunks - 1) * d + 2 * (d - 1 - r), chunks * m) + 1, chunks * m)
    if name == "zb-h1":
        return min(d, m)
    if name == "zb-h2":
        return min(2 * d - 1, m)
    return None


def _cases():
    for name in SCHEDULE_NAMES:
        for chunks in ((2, 3) if name == "interleaved-1f1b" else (None,)):
            spec = get_schedule(name, chunks)
            for d in range(1, 7):
                for m in sorted({spec.min_microbatches(d), d, d + 1, 2 * d + 1, 3 * d}):
                    try:
                        spec.check_layout(d, m)
                    except Exception:
                        continue
                    yield name, spec, d, m


def test_inflight_equals_the_closed_forms():
    checked = 0
    for name, spec, d, m in _cases():
        for r in range(d):
            want = _closed_inflight(name, d, r, m, spec.chunks)
            if want is not None:
                assert spec.inflight(d, r, m) == want, (name, spec.chunks, d, r, m)
                checked += 1
    assert checked > 300


def test_without_a_split_backward_nothing_is_deferred():
    for _name, spec, d, m in _cases():
        if not spec.split_backward:
            for r in range(d):
                assert spec.deferred_weight_grads(d, r, m) == 0
                assert spec.held_pairs(d, r, m) == ((spec.inflight(d, r, m), 0),)


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if get_schedule(n).steady_state])
def test_the_truncated_count_equals_the_full_order(name):
    """Past ``REPLAY_MICROBATCHES * d`` microbatches the steady state only repeats (GPipe's does not, and it is
    counted whole); and the compute order's count is the generated program's (two steps of it, so 2BW's
    stream across the step boundary is in it)."""
    spec = get_schedule(name)
    for d in range(max(1, spec.min_microbatches(2) - 2), 6):
        for r in range(d):
            for m in (REPLAY_MICROBATCHES * d + 1, 6 * d + 1):
                program = _footprint(a.op for a in spec.actions(d, r, m, 0, 2))
                assert spec.footprint(d, r, m) == program, (name, d, r, m)


def test_the_footprint_counter():
    F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    assert _footprint([F, F, B, B]) == (2, 0, ((2, 0),))
    assert _footprint([F, F, I, F, I, W, I, W, W]) == (3, 2, ((1, 2), (2, 1)))
