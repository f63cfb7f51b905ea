"""Pipeline schedules as data: one :class:`ScheduleSpec` per schedule, the only place schedule facts live.

A spec carries what every other module needs to know about its schedule: weight versions and gradient
buffers the executor keeps, how stale the weights are, the microbatches it needs and keeps in flight,
its ideal bubble, and the generator of each stage's ordered actions for a drained segment of steps.
Generating the whole program up front lets the checker prove deadlock freedom, the in-flight bound and
the exact 2BW weight-version semantics for every (d, m) before a process runs it, and lets the executor
be a dumb loop.

Conventions (see :class:`~megatron_2bw.schedule.actions.Action`): microbatches of step ``t`` are
``t*m .. t*m+m-1``; RECV_ACT(i) sits just before FORWARD(i), SEND_ACT(i) just after it; RECV_GRAD(j)
just before BACKWARD(j), SEND_GRAD(j) just after it; stage 0 has no RECV_ACT / SEND_GRAD, stage d-1
no SEND_ACT / RECV_GRAD. A schedule that splits its backward (``split_backward``) runs BACKWARD_INPUT(j)
in BACKWARD(j)'s place, between the same transfers, and BACKWARD_WEIGHT(j) on its own later.
"""

from __future__ import annotations

from ..errors import ConfigError
from .actions import Action
from .classic import _GPipe, _Interleaved, _TwoBW
from .rounds import lower_rounds  # noqa: F401 - re-exported
from .spec import ScheduleSpec
from .zb_v import _ZBV
from .zero_bubble import _ZBH1, _ZBH2, validation_cut  # noqa: F401 - validation_cut re-exported

SCHEDULES: dict[str, ScheduleSpec] = {
    "2bw": _TwoBW("2bw", weight_versions=2, grad_buffers=2, stale_steps=1),
    "flush": ScheduleSpec("flush"),
    "gpipe": _GPipe("gpipe"),
    "interleaved-1f1b": _Interleaved("interleaved-1f1b"),
    "zb-h1": _ZBH1("zb-h1"),
    "zb-h2": _ZBH2("zb-h2"),
    "zb-v": _ZBV("zb-v"),
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)

PV_SUFFIX = "+pv"  # a schedule id's mark of optimizer post-validation (``zb-h2+pv``): what the planner prices


def schedule_id(name: str, post_validation: bool = False) -> str:
    """One string for a schedule as a run configures it (the planner's candidates, plans, reports)."""
    return name + PV_SUFFIX if post_validation else name


def parse_schedule_id(sid: str) -> tuple[str, bool]:
    """``(registry name, post-validation)`` of a schedule id."""
    return (sid[:-len(PV_SUFFIX)], True) if sid.endswith(PV_SUFFIX) else (sid, False)


def spec_of(sid: str, chunks: int | None = None) -> ScheduleSpec:
    """The spec of a schedule id (a registry name, or one with :data:`PV_SUFFIX`)."""
    name, pv = parse_schedule_id(sid)
    return get_schedule(name, chunks, pv)


# what the planner searches: the registry, and zb-h2 and zb-v with post-validation, whose steps overlap with it
# (zb-h1's do not: its last stage has nothing of the step left to run while the next one fills)
PLANNED_SCHEDULES: tuple[str, ...] = (*SCHEDULE_NAMES, schedule_id("zb-h2", True), schedule_id("zb-v", True))


def get_schedule(name: str, chunks: int | None = None, post_validation: bool = False) -> ScheduleSpec:
    """The spec of ``name`` (with ``chunks`` model chunks per rank where it takes a count: None, its own; with
    optimizer post-validation where it takes it); a one-line ``ConfigError`` naming the choices otherwise."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    return spec.with_chunks(chunks).with_post_validation(post_validation)


def validate_pipeline(schedule: str, d: int, m: int, chunks: int | None = None, post_validation: bool = False) -> None:
    """Refuse a schedule / depth / microbatch count that no stage could run, with one line."""
    check_layout(get_schedule(schedule, chunks, post_validation), d, m)


def check_layout(spec: ScheduleSpec, d: int, m: int) -> None:
    """:func:`validate_pipeline` for a resolved spec."""
    if d < 1:
        raise ConfigError(f"pipeline depth must be >= 1, got d={d}")
    if m < 1:
        raise ConfigError(f"microbatches per step must be >= 1, got m={m}")
    need = spec.min_microbatches(d)
    if spec.post_validation and m < d:
        raise ConfigError(f"--enable-optimizer-post-validation needs at least d microbatches per step (every stage's "
                          f"warm-up holds the check): m={m} < d={d}")
    if m < need:
        if need == d:
            raise ConfigError(f"{spec.name.upper()} needs at least d microbatches per step: m={m} < d={d}")
        raise ConfigError(f"{spec.name.upper()} needs at least {need} microbatches per step at d={d}: m={m} < {need}")
    spec.check_layout(d, m)


def _validate_stage(schedule: str, d: int, r: int, m: int, chunks: int | None = None,
                    post_validation: bool = False) -> ScheduleSpec:
    spec = get_schedule(schedule, chunks, post_validation)
    _check_stage(spec, d, r, m)
    return spec


def _check_stage(spec: ScheduleSpec, d: int, r: int, m: int) -> None:
    check_layout(spec, d, m)
    if not 0 <= r < d:
        raise ConfigError(f"pipeline stage must be in 0..{d - 1}, got r={r}")


def inflight_limit(schedule: str, d: int, r: int, m: int, chunks: int | None = None) -> int:
    """:meth:`ScheduleSpec.inflight`, after validating the layout."""
    return _validate_stage(schedule, d, r, m, chunks).inflight(d, r, m)


def bubble_fraction(schedule: str, d: int, m: int, chunks: int | None = None) -> float:
    """:meth:`ScheduleSpec.bubble`, after validating the layout."""
    validate_pipeline(schedule, d, m, chunks)
    return get_schedule(schedule, chunks).bubble(d, m)


# A segment can be cut short to end at step count ``u + STOP_LAG`` once APPLY_UPDATE(u) has run, for every
# schedule, stage and (d, m): the actions run so far are then a prefix of the shorter segment's, and every
# receive the transport may have posted ahead (the next two of each kind) belongs to it.
# ``tests/test_log_no_drain.py`` checks both for every layout and that a lag of 2 is not enough.
STOP_LAG = 3


def cut_segment(schedule: str, d: int, r: int, m: int, first_step: int, done: list[Action], end: int,
                chunks: int | None = None, post_validation: bool = False) -> list[Action]:
    """:func:`cut_program` of the schedule ``schedule`` names."""
    return cut_program(get_schedule(schedule, chunks, post_validation), d, r, m, first_step, done, end)


def cut_program(spec: ScheduleSpec, d: int, r: int, m: int, first_step: int, done: list[Action],
                end: int) -> list[Action]:
    """The actions still to run when a segment from ``first_step`` that has run ``done`` ends at step count ``end``.

    A RuntimeError if ``done`` is not how the segment ending at ``end`` starts (a caller's bug: cut too late).
    """
    new = program(spec, d, r, m, first_step, end - first_step)
    if new[:len(done)] != done:
        raise RuntimeError(f"cannot end the segment from step {first_step} at step {end} on stage {r}: "
                           f"{len(done)} actions already ran that it does not start with")
    return new[len(done):]


def stage_actions(schedule: str, d: int, r: int, m: int, first_step: int, num_steps: int,
                  chunks: int | None = None, post_validation: bool = False) -> list[Action]:
    """:func:`program` of the schedule ``schedule`` names (``chunks``: model chunks per rank for a schedule
    that takes a count, None: its own; ``post_validation``: speculative updates checked in the next step's
    warm-up)."""
    return program(get_schedule(schedule, chunks, post_validation), d, r, m, first_step, num_steps)


def program(spec: ScheduleSpec, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
    """Ordered actions of stage ``r`` of a depth-``d`` pipeline for a drained segment.

    The segment covers steps ``first_step .. first_step+num_steps-1`` and ends with every
    microbatch forwarded and backwarded and every update applied; a later segment starting
    at the next step continues microbatch indices and (for 2BW) weight versions exactly as
    an uninterrupted run would, so checkpoints and evaluations can sit at any step boundary.
    """
    _check_stage(spec, d, r, m)
    if first_step < 0:
        raise ConfigError(f"first step must be >= 0, got first_step={first_step}")
    if num_steps < 1:
        raise ConfigError(f"a schedule segment needs at least one step, got num_steps={num_steps}")
    return spec.actions(d, r, m, first_step, num_steps)
