"""Schedules as data: exact programs for small cases, the exhaustive checker sweep, and proof
that the checker itself fails on broken schedules."""

from __future__ import annotations

import pytest

from megatron_2bw.errors import ConfigError
from megatron_2bw.schedule.actions import Action, Op, format_actions, parse_actions
from megatron_2bw.schedule.checker import ScheduleError, check_actions, check_schedule
from megatron_2bw.schedule.schedules import bubble_fraction, get_schedule, inflight_limit, stage_actions

NUM_STEPS = 3


def _programs(schedule: str, d: int, m: int, first_step: int, num_steps: int) -> list[list[Action]]:
    return [stage_actions(schedule, d, r, m, first_step, num_steps) for r in range(d)]


def _line(schedule: str, d: int, r: int, m: int, first_step: int, num_steps: int) -> str:
    return format_actions(stage_actions(schedule, d, r, m, first_step, num_steps))


# ---------------------------------------------------------------- exhaustive sweep


@pytest.mark.parametrize("first_step", [0, 2])
@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe", "zb-h1", "zb-h2"])
def test_every_small_pipeline_is_correct(schedule: str, first_step: int) -> None:
    spec = get_schedule(schedule)
    for d in range(1, 17):
        # every m through 3d + 3 (where warm-up, steady state and cool-down meet), then two long pipelines
        lo = d if schedule == "2bw" else 1
        for m in sorted(set(range(lo, 3 * d + 4)) | {48, 64}):
            report = check_schedule(schedule, d, m, first_step, NUM_STEPS)
            assert report.max_inflight == tuple(inflight_limit(schedule, d, r, m) for r in range(d)), (d, m)
            if schedule == "2bw":  # one fill and one drain for the whole segment
                assert report.time_slots == 2 * NUM_STEPS * m + 2 * (d - 1), (d, m)
            elif spec.split_backward:  # the checker's unit clock: F one slot, I and W half a slot each
                assert report.time_slots == pytest.approx(NUM_STEPS * (2 * m + spec.bubble_time(d, m, 1, 0.5, 0.5)))
            else:  # a fill and a drain every step
                assert report.time_slots == NUM_STEPS * 2 * (m + d - 1), (d, m)


# ---------------------------------------------------------------- exact programs


def test_2bw_d2_m2_exact() -> None:
    assert _line("2bw", 2, 0, 2, 0, 3) == (
        "F0v0 SA0 F1v0 SA1 RG0 B0v0 F2v0 SA2 RG1 B1v0 R0 F3v0 SA3 RG2 B2v0 "
        "U0 F4v1 SA4 RG3 B3v0 R1 F5v1 SA5 RG4 B4v1 RG5 B5v1 U1 R2 U2"
    )
    assert _line("2bw", 2, 1, 2, 0, 3) == (
        "RA0 F0v0 B0v0 SG0 RA1 F1v0 B1v0 SG1 R0 RA2 F2v0 B2v0 SG2 RA3 F3v0 B3v0 SG3 U0 "
        "R1 RA4 F4v1 B4v1 SG4 RA5 F5v1 B5v1 SG5 U1 R2 U2"
    )


def test_2bw_d2_m4_exact() -> None:
    assert _line("2bw", 2, 0, 4, 0, 2) == (
        "F0v0 SA0 F1v0 SA1 RG0 B0v0 F2v0 SA2 RG1 B1v0 F3v0 SA3 RG2 B2v0 F4v0 SA4 RG3 B3v0 R0 "
        "F5v0 SA5 RG4 B4v0 F6v0 SA6 RG5 B5v0 U0 F7v0 SA7 RG6 B6v0 RG7 B7v0 R1 U1"
    )
    assert _line("2bw", 2, 1, 4, 0, 2) == (
        "RA0 F0v0 B0v0 SG0 RA1 F1v0 B1v0 SG1 RA2 F2v0 B2v0 SG2 RA3 F3v0 B3v0 SG3 R0 "
        "RA4 F4v0 B4v0 SG4 RA5 F5v0 B5v0 SG5 RA6 F6v0 B6v0 SG6 U0 RA7 F7v0 B7v0 SG7 R1 U1"
    )


def test_2bw_segment_after_drain_exact() -> None:
    # Steps 2-3 after a drain: step 2 still runs on W(1); U0, U1 ran at the end of the last segment.
    assert _line("2bw", 2, 0, 2, 2, 2) == (
        "F4v1 SA4 F5v1 SA5 RG4 B4v1 F6v2 SA6 RG5 B5v1 R2 F7v2 SA7 RG6 B6v2 RG7 B7v2 U2 R3 U3"
    )


def test_2bw_single_stage_keeps_delay_one() -> None:
    assert _line("2bw", 1, 0, 2, 0, 3) == (
        "F0v0 B0v0 F1v0 B1v0 R0 F2v0 B2v0 U0 F3v0 B3v0 R1 F4v1 B4v1 U1 F5v1 B5v1 R2 U2"
    )


def test_flush_d2_m3_exact() -> None:
    assert _line("flush", 2, 0, 3, 0, 2) == (
        "F0v0 SA0 F1v0 SA1 RG0 B0v0 F2v0 SA2 RG1 B1v0 RG2 B2v0 R0 U0 "
        "F3v1 SA3 F4v1 SA4 RG3 B3v1 F5v1 SA5 RG4 B4v1 RG5 B5v1 R1 U1"
    )
    assert _line("flush", 2, 1, 3, 0, 2) == (
        "RA0 F0v0 B0v0 SG0 RA1 F1v0 B1v0 SG1 RA2 F2v0 B2v0 SG2 R0 U0 "
        "RA3 F3v1 B3v1 SG3 RA4 F4v1 B4v1 SG4 RA5 F5v1 B5v1 SG5 R1 U1"
    )


def test_flush_accepts_fewer_microbatches_than_stages() -> None:
    # d=3, m=1: stage 0 wants 2 warm-up forwards but only has one microbatch.
    assert _line("flush", 3, 0, 1, 0, 1) == "F0v0 SA0 RG0 B0v0 R0 U0"
    assert _line("flush", 3, 1, 1, 0, 1) == "RA0 F0v0 SA0 RG0 B0v0 SG0 R0 U0"
    assert _line("flush", 3, 2, 1, 0, 1) == "RA0 F0v0 B0v0 SG0 R0 U0"


def test_gpipe_d2_m2_exact() -> None:
    assert _line("gpipe", 2, 0, 2, 0, 1) == "F0v0 SA0 F1v0 SA1 RG0 B0v0 RG1 B1v0 R0 U0"
    assert _line("gpipe", 2, 1, 2, 0, 1) == "RA0 F0v0 RA1 F1v0 B0v0 SG0 B1v0 SG1 R0 U0"


def test_format_parse_round_trip() -> None:
    for r in range(3):
        acts = stage_actions("2bw", 3, r, 4, 1, 3)
        assert parse_actions(format_actions(acts), 4) == acts
    assert str(Action(Op.FORWARD, 12, 3, 2)) == "F12v2"
    assert str(Action(Op.APPLY_UPDATE, step=3)) == "U3"
    with pytest.raises(ConfigError):
        parse_actions("F3", 2)


# ---------------------------------------------------------------- semantics


def test_2bw_version_formula_up_to_k_200() -> None:
    for m, d in [(1, 1), (2, 2), (3, 2), (4, 4), (7, 3), (16, 8)]:
        steps = 200 // m + 1
        for r in range(d):
            for a in stage_actions("2bw", d, r, m, 0, steps):
                if a.op in (Op.FORWARD, Op.BACKWARD):
                    k = a.mb + 1
                    assert a.version == max((k - 1) // m - 1, 0), (m, d, r, a)
                    assert a.step == a.mb // m


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
@pytest.mark.parametrize(("d", "m"), [(1, 1), (2, 2), (3, 5), (4, 4), (4, 7)])
def test_two_segments_equal_one_run_with_a_drain(schedule: str, d: int, m: int) -> None:
    split = [a + b for a, b in zip(_programs(schedule, d, m, 0, 2), _programs(schedule, d, m, 2, 2))]
    whole = _programs(schedule, d, m, 0, 4)
    for cut, full in zip(split, whole):
        for op in (Op.FORWARD, Op.BACKWARD):
            assert [(a.mb, a.version) for a in cut if a.op is op] == [(a.mb, a.version) for a in full if a.op is op]
        if schedule != "2bw":  # the flushing schedules drain at every step boundary anyway
            assert cut == full
    # The concatenation is itself a correct 4-step schedule (a drain in the middle).
    check_actions(schedule, d, m, 0, 4, split)


def test_refusals() -> None:
    with pytest.raises(ConfigError, match=r"^2BW needs at least d microbatches per step: m=3 < d=4$"):
        stage_actions("2bw", 4, 0, 3, 0, 1)
    with pytest.raises(ConfigError, match="m=3 < d=4"):
        check_schedule("2bw", 4, 3)
    bad_layouts = [
        ("pipedream", 2, 0, 2), ("flush", 0, 0, 2), ("flush", 2, 0, 0), ("flush", 2, 2, 2), ("gpipe", 2, -1, 2)
    ]
    for bad in bad_layouts:
        with pytest.raises(ConfigError) as info:
            stage_actions(*bad, 0, 1)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        stage_actions("flush", 2, 0, 2, -1, 1)
    with pytest.raises(ConfigError):
        stage_actions("flush", 2, 0, 2, 0, 0)
    with pytest.raises(ConfigError):
        check_schedule("flush", 2, 2, num_steps=0)


def test_planner_helpers() -> None:
    assert inflight_limit("2bw", 4, 0, 8) == 4
    assert inflight_limit("flush", 4, 3, 8) == 1
    assert inflight_limit("flush", 8, 0, 3) == 3
    assert inflight_limit("gpipe", 4, 0, 8) == 8
    assert bubble_fraction("flush", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("2bw", 4, 8) == 0.0
    with pytest.raises(ConfigError):
        bubble_fraction("2bw", 4, 2)


# ---------------------------------------------------------------- the checker can fail


def _check_lines(schedule: str, m: int, lines: list[str], num_steps: int, first_step: int = 0) -> None:
    check_actions(schedule, len(lines), m, first_step, num_steps, [parse_actions(x, m) for x in lines])


def _edited(schedule: str, d: int, m: int, num_steps: int, r: int, old: str, new: str) -> list[str]:
    lines = [_line(schedule, d, s, m, 0, num_steps) for s in range(d)]
    assert old in lines[r]
    lines[r] = " ".join(lines[r].replace(old, new).split())
    return lines


def test_checker_accepts_the_unedited_baseline() -> None:
    _check_lines("2bw", 2, _edited("2bw", 2, 2, 3, 0, "F0v0", "F0v0"), 3)


def test_checker_catches_deadlock() -> None:
    lines = _edited("2bw", 2, 2, 3, 0, "F0v0 SA0 F1v0 SA1 RG0", "F0v0 RG0 SA0 F1v0 SA1")
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 at #1 RG0, stage 1 at #0 RA0"):
        _check_lines("2bw", 2, lines, 3)


def test_checker_catches_mismatched_receive_order() -> None:
    lines = _edited("gpipe", 2, 2, 1, 1, "RA0 F0v0 RA1 F1v0", "RA1 F1v0 RA0 F0v0")
    with pytest.raises(ScheduleError, match="mismatched order"):
        _check_lines("gpipe", 2, lines, 1)


def test_checker_catches_wrong_version() -> None:
    lines = _edited("2bw", 2, 2, 3, 1, "F4v1 B4v1", "F4v0 B4v0")
    with pytest.raises(ScheduleError, match=r"k=5 must use W\(1\)"):
        _check_lines("2bw", 2, lines, 3)
    lines = _edited("2bw", 2, 2, 3, 1, "B4v1", "B4v0")
    with pytest.raises(ScheduleError, match=r"forward ran on W\(1\)"):
        _check_lines("2bw", 2, lines, 3)
    # Flush must not be stale: step 1 runs on W(1).
    lines = _edited("flush", 1, 2, 2, 0, "F2v1 B2v1", "F2v0 B2v0")
    with pytest.raises(ScheduleError, match=r"must use W\(1\)"):
        _check_lines("flush", 2, lines, 2)


def test_checker_catches_forward_before_its_update() -> None:
    lines = _edited("2bw", 1, 2, 3, 0, "U0 F3v0 B3v0 R1 F4v1", "F3v0 B3v0 R1 F4v1 U0")
    with pytest.raises(ScheduleError, match=r"before APPLY_UPDATE\(0\)"):
        _check_lines("2bw", 2, lines, 3)


def test_checker_catches_update_before_backwards() -> None:
    lines = _edited("flush", 1, 2, 1, 0, "B1v0 R0 U0", "R0 U0 B1v0")
    with pytest.raises(ScheduleError, match="only 1 of the 2 backwards of step 0"):
        _check_lines("flush", 2, lines, 1)


def test_checker_catches_missing_backward() -> None:
    lines = _edited("2bw", 1, 2, 3, 0, "B5v1 ", "")
    with pytest.raises(ScheduleError, match="backwards of step 2"):
        _check_lines("2bw", 2, lines, 3)
    # A program that simply stops early is caught by the end-of-segment check.
    with pytest.raises(ScheduleError, match=r"not forwarded and backwarded: \[1\]"):
        _check_lines("2bw", 2, ["F0v0 B0v0 F1v0"], 1)


def test_checker_catches_backwards_out_of_order() -> None:
    lines = _edited("gpipe", 1, 2, 1, 0, "B0v0 B1v0", "B1v0 B0v0")
    with pytest.raises(ScheduleError, match="out of microbatch order"):
        _check_lines("gpipe", 2, lines, 1)


def test_checker_catches_flush_exceeding_inflight_bound() -> None:
    gpipe_order = [format_actions(p) for p in _programs("gpipe", 2, 4, 0, 1)]
    with pytest.raises(ScheduleError, match="stage 0 .* 3 microbatches in flight, limit is 2"):
        _check_lines("flush", 4, gpipe_order, 1)


def test_checker_catches_update_without_reduction() -> None:
    lines = _edited("flush", 2, 2, 1, 1, "R0 U0", "U0")
    with pytest.raises(ScheduleError, match="update before REDUCE_GRADS"):
        _check_lines("flush", 2, lines, 1)


def test_checker_blocks_updates_on_the_cross_stage_reduction() -> None:
    # Stage 1 updates before sending its last gradient; stage 0 can never reduce: deadlock.
    lines = _edited("flush", 2, 2, 1, 1, "SG1 R0 U0", "R0 U0 SG1")
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 at #\d+ RG1, stage 1 at #\d+ U0"):
        _check_lines("flush", 2, lines, 1)


def test_checker_catches_communication_with_a_missing_stage() -> None:
    lines = _edited("flush", 2, 2, 1, 0, "F0v0", "RA0 F0v0")
    with pytest.raises(ScheduleError, match="stage 0 has no previous stage"):
        _check_lines("flush", 2, lines, 1)
    lines = _edited("flush", 2, 2, 1, 1, "F0v0", "F0v0 SA0")
    with pytest.raises(ScheduleError, match="the last stage has no next stage"):
        _check_lines("flush", 2, lines, 1)


def test_checker_catches_undrained_segment() -> None:
    lines = _edited("2bw", 2, 2, 2, 0, " U1", "")
    lines[1] = lines[1].replace(" U1", "")
    with pytest.raises(ScheduleError, match="not drained"):
        _check_lines("2bw", 2, lines, 2)
