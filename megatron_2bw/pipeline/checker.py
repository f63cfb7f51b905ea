"""Executable proof that a set of stage programs is a correct pipeline schedule.

All stages are simulated together with the executor's semantics: sends never block and
append to a FIFO channel per (src, dst, kind); receives block until the head message of their
channel exists and must name the expected microbatch; APPLY_UPDATE(t) blocks until every stage
has run REDUCE_GRADS(t) (those reductions are collectives across stages). The simulation is
event-driven: each stage is a generator that runs until it blocks and is resumed only when
the message or collective it waits for exists, so checking every (d <= 16, m <= 64) stays fast.

Beyond deadlock freedom it proves: every microbatch of the segment is forwarded once and
backwarded once on every stage (forward first, backwards in microbatch order); the in-flight
count never exceeds :func:`inflight_limit`; every microbatch runs forward and backward on the
exact paper version; a version is used only after the update that makes it; an update uses
only finished backwards; at most two weight versions are live on a stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from .actions import Action, Op
from .schedules import inflight_limit, stage_actions, validate_pipeline

_RA, _F, _SA, _RG, _B, _SG, _R, _U = (
    Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT, Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD, Op.REDUCE_GRADS, Op.APPLY_UPDATE,
)


class ScheduleError(AssertionError):
    """A schedule violates deadlock freedom, the in-flight bound or the version semantics."""


@dataclass(frozen=True)
class CheckReport:
    """What a successful check measured.

    ``time_slots`` is the simulated makespan with every FORWARD and BACKWARD costing one
    slot and communication / reductions free: a rough estimate for bubbles, not a profile.
    """

    schedule: str
    d: int
    m: int
    first_step: int
    num_steps: int
    max_inflight: tuple[int, ...]
    time_slots: int

    @property
    def bubble(self) -> float:
        """Idle fraction of a stage over the simulated makespan."""
        busy = 2 * self.m * self.num_steps
        return (self.time_slots - busy) / self.time_slots


def expected_version(schedule: str, mb: int, m: int) -> int:
    """The paper's version of 0-based microbatch ``mb``: k = mb + 1 uses
    max(floor((k-1)/m) - 1, 0) under 2BW, and W(step) under the flushing schedules."""
    k = mb + 1
    return max((k - 1) // m - 1, 0) if schedule == "2bw" else (k - 1) // m


@dataclass
class _World:
    """State shared by all simulated stages: channels, collectives and the ready queue."""

    d: int
    num_steps: int
    act_chan: list[deque[tuple[int, int]]]  # stage r -> r+1: (mb, send time)
    grad_chan: list[deque[tuple[int, int]]]  # stage r+1 -> r
    act_waiter: list[bool]  # stage r+1 blocks on act_chan[r]
    grad_waiter: list[bool]  # stage r blocks on grad_chan[r]
    reduced: list[int]  # stages that ran REDUCE_GRADS(t), by local step
    reduce_time: list[int]
    update_waiters: list[list[int]]
    ready: deque[int]
    position: list[int] = field(default_factory=list)  # action index where each stage blocked
    max_inflight: list[int] = field(default_factory=list)
    clock: list[int] = field(default_factory=list)


def _fail(r: int, i: int, a: Action, msg: str) -> ScheduleError:
    return ScheduleError(f"stage {r} action #{i} {a}: {msg}")


def _stage(
    world: _World, schedule: str, r: int, m: int, first_step: int, acts: Sequence[Action], limit: int
) -> Generator[None, None, None]:
    """Run stage ``r``'s program, yielding whenever it blocks; raise on any violation."""
    d, n_steps = world.d, world.num_steps
    lo, n_mb = first_step * m, world.num_steps * m
    last = r == d - 1
    two_bw = schedule == "2bw"
    fwd_version = [-1] * n_mb
    done_bwd = bytearray(n_mb)
    # 0: not received, 1: received and not yet consumed, 2: consumed
    got_act = bytearray(n_mb)
    got_grad = bytearray(n_mb)
    sent_act = bytearray(n_mb)
    sent_grad = bytearray(n_mb)
    bwd_per_step = [0] * n_steps
    reduced = bytearray(n_steps)
    live: dict[int, int] = {}  # version -> in-flight microbatches using it
    newest = first_step  # updates of earlier steps were applied before this segment
    inflight = max_inflight = 0
    next_bwd = 0
    clock = 0
    act_in = world.act_chan[r - 1] if r > 0 else None
    act_out = world.act_chan[r] if not last else None
    grad_in = world.grad_chan[r] if not last else None
    grad_out = world.grad_chan[r - 1] if r > 0 else None
    act_waiter, grad_waiter, ready = world.act_waiter, world.grad_waiter, world.ready

    for i, a in enumerate(acts):
        op = a.op
        if op is not _R and op is not _U:
            j = a.mb - lo
            if not 0 <= j < n_mb:
                raise _fail(r, i, a, f"microbatch outside this segment ({lo}..{lo + n_mb - 1})")
            if a.step != a.mb // m:
                raise _fail(r, i, a, f"step field {a.step} but microbatch belongs to step {a.mb // m}")
        if op is _F:
            if fwd_version[j] >= 0:
                raise _fail(r, i, a, "microbatch forwarded twice")
            v = a.version
            want = a.step - 1 if two_bw else a.step  # == expected_version(schedule, a.mb, m)
            if want < 0:
                want = 0
            if v != want:
                raise _fail(r, i, a, f"forward on W({v}) but microbatch k={a.mb + 1} must use W({want})")
            if v > newest:
                raise _fail(r, i, a, f"forward on W({v}) before APPLY_UPDATE({v - 1}) on this stage")
            if r > 0:
                if got_act[j] != 1:
                    raise _fail(r, i, a, "forward without its activations received (RECV_ACT missing)")
                got_act[j] = 2
            fwd_version[j] = v
            clock += 1
            inflight += 1
            if inflight > max_inflight:
                max_inflight = inflight
                if inflight > limit:
                    raise _fail(r, i, a, f"{inflight} microbatches in flight, limit is {limit}")
            live[v] = live.get(v, 0) + 1
            if len(live) + (newest not in live) > 2:
                raise _fail(r, i, a, f"more than two weight versions live: {sorted(set(live) | {newest})}")
        elif op is _B:
            if fwd_version[j] < 0:
                raise _fail(r, i, a, "backward before forward")
            if done_bwd[j]:
                raise _fail(r, i, a, "microbatch backwarded twice")
            if j != next_bwd:
                raise _fail(r, i, a, f"backwards out of microbatch order (expected mb {lo + next_bwd})")
            v = fwd_version[j]
            if a.version != v:
                raise _fail(r, i, a, f"backward on W({a.version}) but forward ran on W({v})")
            if not last:
                if got_grad[j] != 1:
                    raise _fail(r, i, a, "backward without its gradient received (RECV_GRAD missing)")
                got_grad[j] = 2
            done_bwd[j] = 1
            next_bwd += 1
            bwd_per_step[a.step - first_step] += 1
            clock += 1
            inflight -= 1
            if live[v] == 1:
                del live[v]
            else:
                live[v] -= 1
        elif op is _RA:
            if act_in is None:
                raise _fail(r, i, a, "stage 0 has no previous stage to receive activations from")
            if got_act[j]:
                raise _fail(r, i, a, "activations received twice")
            while not act_in:
                world.act_waiter[r - 1] = True
                world.position[r] = i
                yield
            mb, sent_at = act_in.popleft()
            if mb != a.mb:
                raise _fail(r, i, a, f"mismatched order: stage {r - 1} sent activations of mb {mb} first")
            got_act[j] = 1
            if sent_at > clock:
                clock = sent_at
        elif op is _RG:
            if grad_in is None:
                raise _fail(r, i, a, "the last stage has no next stage to receive gradients from")
            if got_grad[j]:
                raise _fail(r, i, a, "gradient received twice")
            while not grad_in:
                world.grad_waiter[r] = True
                world.position[r] = i
                yield
            mb, sent_at = grad_in.popleft()
            if mb != a.mb:
                raise _fail(r, i, a, f"mismatched order: stage {r + 1} sent the gradient of mb {mb} first")
            got_grad[j] = 1
            if sent_at > clock:
                clock = sent_at
        elif op is _SA:
            if act_out is None:
                raise _fail(r, i, a, "the last stage has no next stage to send activations to")
            if fwd_version[j] < 0 or sent_act[j]:
                raise _fail(r, i, a, "activations sent before the forward or sent twice")
            sent_act[j] = 1
            act_out.append((a.mb, clock))
            if act_waiter[r]:
                act_waiter[r] = False
                ready.append(r + 1)
        elif op is _SG:
            if grad_out is None:
                raise _fail(r, i, a, "stage 0 has no previous stage to send gradients to")
            if not done_bwd[j] or sent_grad[j]:
                raise _fail(r, i, a, "gradient sent before the backward or sent twice")
            sent_grad[j] = 1
            grad_out.append((a.mb, clock))
            if grad_waiter[r - 1]:
                grad_waiter[r - 1] = False
                ready.append(r - 1)
        elif op is _R or op is _U:
            s = a.step - first_step
            if not 0 <= s < n_steps:
                raise _fail(r, i, a, f"step outside this segment ({first_step}..{first_step + n_steps - 1})")
            if bwd_per_step[s] != m:
                raise _fail(r, i, a, f"only {bwd_per_step[s]} of the {m} backwards of step {a.step} done")
            if op is _R:
                if reduced[s]:
                    raise _fail(r, i, a, "gradients reduced twice")
                reduced[s] = 1
                world.reduced[s] += 1
                if clock > world.reduce_time[s]:
                    world.reduce_time[s] = clock
                if world.reduced[s] == d:
                    world.ready.extend(world.update_waiters[s])
                    world.update_waiters[s].clear()
            else:
                if a.step != newest:
                    raise _fail(r, i, a, f"updates out of order: the next update is APPLY_UPDATE({newest})")
                if not reduced[s]:
                    raise _fail(r, i, a, "update before REDUCE_GRADS on this stage")
                if world.reduced[s] < d:
                    world.update_waiters[s].append(r)
                    world.position[r] = i
                    yield
                    if world.reduced[s] < d:  # woken by a bug in the simulation itself
                        raise _fail(r, i, a, "resumed before every stage reduced")
                if world.reduce_time[s] > clock:
                    clock = world.reduce_time[s]
                newest += 1
                if len(live) + (newest not in live) > 2:
                    raise _fail(r, i, a, f"more than two weight versions live: {sorted(set(live) | {newest})}")
        else:  # pragma: no cover - Op is closed
            raise _fail(r, i, a, "unknown op")

    where = f"stage {r} at the end of the segment"
    if next_bwd != n_mb:
        missing = [lo + j for j in range(n_mb) if fwd_version[j] < 0 or not done_bwd[j]]
        raise ScheduleError(f"{where}: microbatches not forwarded and backwarded: {missing[:8]}")
    if r > 0 and not all(x == 2 for x in got_act):
        raise ScheduleError(f"{where}: received activations never used")
    if not last and (not all(sent_act) or not all(x == 2 for x in got_grad)):
        raise ScheduleError(f"{where}: activations not sent or gradients not used")
    if r > 0 and not all(sent_grad):
        raise ScheduleError(f"{where}: input gradients not sent back")
    if not all(reduced) or newest != first_step + n_steps:
        raise ScheduleError(f"{where}: not drained: applied up to W({newest}), reduced {list(reduced)}")
    world.max_inflight[r] = max_inflight
    world.clock[r] = clock


def check_actions(
    schedule: str, d: int, m: int, first_step: int, num_steps: int, stages: Sequence[Sequence[Action]]
) -> CheckReport:
    """Check hand-made or generated stage programs (one list per stage) for a drained segment."""
    validate_pipeline(schedule, d, m)
    if first_step < 0 or num_steps < 1:
        raise ConfigError(f"a segment needs first_step >= 0 and num_steps >= 1, got {first_step}, {num_steps}")
    if len(stages) != d:
        raise ScheduleError(f"expected programs for {d} stages, got {len(stages)}")
    world = _World(
        d=d,
        num_steps=num_steps,
        act_chan=[deque() for _ in range(d)],
        grad_chan=[deque() for _ in range(d)],
        act_waiter=[False] * d,
        grad_waiter=[False] * d,
        reduced=[0] * num_steps,
        reduce_time=[0] * num_steps,
        update_waiters=[[] for _ in range(num_steps)],
        ready=deque(range(d)),
        position=[0] * d,
        max_inflight=[0] * d,
        clock=[0] * d,
    )
    runs = [
        _stage(world, schedule, r, m, first_step, stages[r], inflight_limit(schedule, d, r, m)) for r in range(d)
    ]
    finished = [False] * d
    ready = world.ready
    while ready:
        r = ready.popleft()
        if next(runs[r], StopIteration) is StopIteration:
            finished[r] = True
    if not all(finished):
        stuck = ", ".join(
            f"stage {r} at #{world.position[r]} {stages[r][world.position[r]]}" for r in range(d) if not finished[r]
        )
        raise ScheduleError(f"deadlock: {stuck}")
    for r in range(d - 1):
        if world.act_chan[r] or world.grad_chan[r]:
            raise ScheduleError(f"messages between stages {r} and {r + 1} were never received")
    return CheckReport(schedule, d, m, first_step, num_steps, tuple(world.max_inflight), max(world.clock))


def check_schedule(schedule: str, d: int, m: int, first_step: int = 0, num_steps: int = 3) -> CheckReport:
    """Generate every stage's program with :func:`stage_actions` and check them together."""
    stages = [stage_actions(schedule, d, r, m, first_step, num_steps) for r in range(d)]
    return check_actions(schedule, d, m, first_step, num_steps, stages)
