"""Pipeline schedules as data: the ordered actions of one stage for a drained segment of steps.

Generating the whole program up front (instead of interleaving decisions with execution)
lets the checker prove deadlock freedom, the in-flight bound and the exact 2BW weight-version
semantics for every (d, m) before a single GPU runs it, and lets the executor be a dumb loop.

Conventions (see docs of :class:`~megatron_2bw.pipeline.actions.Action`): microbatches of
step ``t`` are ``t*m .. t*m+m-1``; RECV_ACT(i) sits just before FORWARD(i), SEND_ACT(i) just
after it; RECV_GRAD(j) just before BACKWARD(j), SEND_GRAD(j) just after it; stage 0 has no
RECV_ACT / SEND_GRAD, stage d-1 no SEND_ACT / RECV_GRAD.
"""

from __future__ import annotations

import functools

from ..errors import ConfigError
from .actions import Action, Op

SCHEDULES: tuple[str, ...] = ("2bw", "flush", "gpipe")


def validate_pipeline(schedule: str, d: int, m: int) -> None:
    """Refuse a schedule / depth / microbatch count that no stage could run, with one line."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if d < 1:
        raise ConfigError(f"pipeline depth must be >= 1, got d={d}")
    if m < 1:
        raise ConfigError(f"microbatches per step must be >= 1, got m={m}")
    if schedule == "2bw" and m < d:
        raise ConfigError(f"2BW needs at least d microbatches per step: m={m} < d={d}")


def _validate_stage(schedule: str, d: int, r: int, m: int) -> None:
    validate_pipeline(schedule, d, m)
    if not 0 <= r < d:
        raise ConfigError(f"pipeline stage must be in 0..{d - 1}, got r={r}")


def weight_version(schedule: str, step: int) -> int:
    """Weight version W(v) every microbatch of ``step`` runs on (forward and backward).

    2BW delays the gradient by one step (batch t runs on W(max(t-1, 0))); the flushing
    schedules have vanilla semantics (batch t runs on W(t)).
    """
    return max(step - 1, 0) if schedule == "2bw" else step


def inflight_limit(schedule: str, d: int, r: int, m: int) -> int:
    """Most microbatches stage ``r`` holds forwarded-but-not-backwarded (activation stashes)."""
    _validate_stage(schedule, d, r, m)
    return m if schedule == "gpipe" else min(d - r, m)


def bubble_fraction(schedule: str, d: int, m: int) -> float:
    """Ideal idle fraction per step with equal-cost microbatches, for the planner.

    The flushing schedules pay a fill and a drain every step; 2BW only at the very start
    (and at a drain before a checkpoint), so its steady-state bubble is zero.
    """
    validate_pipeline(schedule, d, m)
    return 0.0 if schedule == "2bw" else (d - 1) / (m + d - 1)


@functools.lru_cache(maxsize=1 << 16)
def _fragment(forward: bool, mb: int, step: int, version: int, has_prev: bool, has_next: bool) -> tuple[Action, ...]:
    """One compute action with the point-to-point communication wrapped around it.

    Interned: every stage (and every (d, m) with the same m) shares these immutable
    objects, which keeps generating all schedules for the exhaustive checker cheap.
    """
    if forward:
        recv = (Action(Op.RECV_ACT, mb, step),) if has_prev else ()
        send = (Action(Op.SEND_ACT, mb, step),) if has_next else ()
        return (*recv, Action(Op.FORWARD, mb, step, version), *send)
    recv = (Action(Op.RECV_GRAD, mb, step),) if has_next else ()
    send = (Action(Op.SEND_GRAD, mb, step),) if has_prev else ()
    return (*recv, Action(Op.BACKWARD, mb, step, version), *send)


def _one_f_one_b(lo: int, count: int, warmup: int) -> list[tuple[bool, int]]:
    """(is_forward, mb) order of 1F1B over microbatches lo..lo+count-1 with ``warmup`` forwards."""
    warmup = min(warmup, count)
    order = [(True, lo + i) for i in range(warmup)]
    for i in range(count - warmup):
        order.append((True, lo + warmup + i))
        order.append((False, lo + i))
    order.extend((False, i) for i in range(lo + count - warmup, lo + count))
    return order


def _all_forward_all_backward(lo: int, count: int) -> list[tuple[bool, int]]:
    """GPipe order: every forward, then every backward, both in microbatch order."""
    return [(True, lo + i) for i in range(count)] + [(False, lo + i) for i in range(count)]


def _flushing_actions(schedule: str, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
    """GPipe / PipeDream-Flush: each step is filled, drained, reduced and applied on its own."""
    out: list[Action] = []
    for t in range(first_step, first_step + num_steps):
        lo = t * m
        if schedule == "gpipe":
            order = _all_forward_all_backward(lo, m)
        else:
            order = _one_f_one_b(lo, m, d - r - 1)
        for forward, mb in order:
            out.extend(_fragment(forward, mb, t, t, r > 0, r < d - 1))
        out.append(Action(Op.REDUCE_GRADS, step=t))
        out.append(Action(Op.APPLY_UPDATE, step=t))
    return out


def _two_bw_actions(d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
    """PipeDream-2BW: one 1F1B stream across step boundaries with delay-1 weight versions.

    REDUCE_GRADS(t) follows the last backward of step t, so the executor can start the
    asynchronous reductions at once; APPLY_UPDATE(t) (which makes W(t+1)) waits until just
    before the first forward that needs W(t+1), i.e. the first of step t+2 (before its
    RECV_ACT, which stays glued to the forward), so the reductions are hidden behind a whole
    step of compute. Updates still pending at the end of the segment are applied in step
    order after the last action, leaving the pipeline drained.
    """
    lo, end_step = first_step * m, first_step + num_steps
    out: list[Action] = []
    has_prev, has_next = r > 0, r < d - 1
    next_update = first_step  # APPLY_UPDATE(first_step - 1) ran at the end of the previous segment
    for forward, mb in _one_f_one_b(lo, num_steps * m, d - r - 1):
        t, i = divmod(mb, m)
        if forward and i == 0 and t - 2 >= next_update:
            out.append(Action(Op.APPLY_UPDATE, step=t - 2))
            next_update = t - 1
        out.extend(_fragment(forward, mb, t, max(t - 1, 0), has_prev, has_next))
        if not forward and i == m - 1:
            out.append(Action(Op.REDUCE_GRADS, step=t))
    out.extend(Action(Op.APPLY_UPDATE, step=t) for t in range(next_update, end_step))
    return out


def stage_actions(schedule: str, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
    """Ordered actions of stage ``r`` of a depth-``d`` pipeline for a drained segment.

    The segment covers steps ``first_step .. first_step+num_steps-1`` and ends with every
    microbatch forwarded and backwarded and every update applied; a later segment starting
    at the next step continues microbatch indices and (for 2BW) weight versions exactly as
    an uninterrupted run would, so checkpoints and evaluations can sit at any step boundary.
    """
    _validate_stage(schedule, d, r, m)
    if first_step < 0:
        raise ConfigError(f"first step must be >= 0, got first_step={first_step}")
    if num_steps < 1:
        raise ConfigError(f"a schedule segment needs at least one step, got num_steps={num_steps}")
    if schedule == "2bw":
        return _two_bw_actions(d, r, m, first_step, num_steps)
    return _flushing_actions(schedule, d, r, m, first_step, num_steps)
