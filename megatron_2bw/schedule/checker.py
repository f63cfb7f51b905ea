"""Executable proof that a set of stage programs is a correct pipeline schedule.

All stages are replayed together (:mod:`.replay`) with the executor's gloo semantics: sends never
block and queue per boundary and direction; a receive waits for the head message of its queue and
must name the expected microbatch; APPLY_UPDATE(t) waits until every stage has run REDUCE_GRADS(t)
(those reductions are collectives across stages).

Beyond deadlock freedom it proves, per stage: every microbatch of the segment is forwarded once and
backwarded once on each of the rank's model chunks (forward first, each chunk's backwards in microbatch
order; ``in flight`` counts chunk stashes); a schedule that splits its backward
runs BACKWARD_INPUT (in microbatch order, after the forward) then BACKWARD_WEIGHT of each microbatch
and never a whole BACKWARD (the others never I or W), sends the gradient only after I, and reduces a
step only after every W of it; the in-flight count (until a microbatch's B or W) never exceeds
the schedule's :meth:`~.schedules.ScheduleSpec.inflight`; every microbatch runs forward and backward
on the schedule's :meth:`~.schedules.ScheduleSpec.version`; a version is used only after the update
that makes it; an update uses only finished backwards; no more weight versions are live on a stage
than the executor keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .actions import MICROBATCH_OPS, Action, Op
from .replay import Replay, ScheduleError, Timing
from .schedules import ScheduleSpec, get_schedule, stage_actions, validate_pipeline

__all__ = ["CheckReport", "ScheduleError", "check_actions", "check_schedule"]

# Per-microbatch receive state: not received, received and not yet consumed, consumed.
_NOT_RECEIVED, _RECEIVED, _CONSUMED = 0, 1, 2


@dataclass(frozen=True)
class CheckReport:
    """What a successful check measured.

    ``time_slots`` is the replayed makespan with every FORWARD and BACKWARD costing one
    slot (BACKWARD_INPUT and BACKWARD_WEIGHT half a slot each) and communication / reductions free:
    a rough estimate for bubbles, not a profile.
    ``max_live_versions``: per stage, most weight versions needed at once (in flight or newest).
    """

    schedule: str
    d: int
    m: int
    first_step: int
    num_steps: int
    max_inflight: tuple[int, ...]
    time_slots: float
    max_live_versions: tuple[int, ...] = ()
    chunks: int = 1  # model chunks per rank: every chunk's FORWARD and BACKWARD is one slot

    @property
    def bubble(self) -> float:
        """Idle fraction of a stage over the simulated makespan."""
        busy = 2 * self.m * self.num_steps * self.chunks
        return (self.time_slots - busy) / self.time_slots


class _StageRules:
    """The checker's rules for one stage: one method per op, run before the action executes."""

    def __init__(self, spec: ScheduleSpec, d: int, r: int, m: int, first_step: int, num_steps: int) -> None:
        self.spec, self.r, self.m, self.first_step, self.num_steps = spec, r, m, first_step, num_steps
        place = spec.placement(d)
        v = self.v = place.chunks
        # per chunk: whether its virtual stage is the model's first / last (no RECV_ACT / no RECV_GRAD)
        self.first = [place.is_first(r, c) for c in range(v)]
        self.last = [place.is_last(r, c) for c in range(v)]
        # per chunk: the chunk of this rank its input comes from / its output goes to, where the neighbouring
        # virtual stage is on the rank itself (a V's turn): a hand-over, no transfer
        mine = {place.stage(r, c): c for c in range(v)}
        self.local_in = [mine.get(place.stage(r, c) - 1) if not self.first[c] else None for c in range(v)]
        self.local_out = [mine.get(place.stage(r, c) + 1) if not self.last[c] else None for c in range(v)]
        # microbatch actions are indexed j = (mb - lo) * v + chunk
        self.lo, n_mb = first_step * m, num_steps * m * v
        self.limit = spec.inflight(d, r, m)
        self.versions = [spec.version(t) for t in range(first_step, first_step + num_steps)]
        self.fwd_version = [-1] * n_mb
        self.done_bwd, self.sent_act, self.sent_grad = bytearray(n_mb), bytearray(n_mb), bytearray(n_mb)
        self.done_inp = bytearray(n_mb)  # the input gradient exists: B or I ran
        self.got_act, self.got_grad = bytearray(n_mb), bytearray(n_mb)
        self.bwd_per_step = [0] * num_steps
        self.reduced = bytearray(num_steps)
        self.live: dict[int, int] = {}  # version -> in-flight microbatches using it
        self.newest = first_step  # updates of earlier steps were applied before this segment
        self.inflight = self.max_inflight = 0
        self.next_bwd = [0] * v  # per chunk: the next microbatch (from lo) to backward
        self.max_live = 1
        self.check = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward, Op.RECV_ACT: self._recv_act,
            Op.BACKWARD_INPUT: self._backward_input, Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.RECV_GRAD: self._recv_grad, Op.SEND_ACT: self._send_act, Op.SEND_GRAD: self._send_grad,
            Op.REDUCE_GRADS: self._reduce, Op.APPLY_UPDATE: self._update,
            Op.REDUCE_EMBEDDING: self._reduce_embedding, Op.VALIDATE: self._validate,
        }
        self.inputs_per_step = [0] * num_steps  # input gradients (B or I) done per step
        self.emb_reduced = bytearray(num_steps)
        self.validated = bytearray(num_steps)
        self.post_validation = spec.post_validation

    def _fail(self, i: int, a: Action, msg: str) -> ScheduleError:
        return ScheduleError(f"stage {self.r} action #{i} {a}: {msg}")

    def _index(self, i: int, a: Action) -> int:
        """The slot of ``a``'s (microbatch, chunk)."""
        if not 0 <= a.chunk < self.v:
            raise self._fail(i, a, f"chunk {a.chunk} outside the schedule's {self.v} chunk(s) per rank")
        return (a.mb - self.lo) * self.v + a.chunk

    def _step(self, i: int, a: Action) -> int:
        """Index of ``a``'s step within the segment, once all of its backwards ran here."""
        s = a.step - self.first_step
        if not 0 <= s < self.num_steps:
            raise self._fail(i, a, f"step outside this segment "
                                   f"({self.first_step}..{self.first_step + self.num_steps - 1})")
        if self.bwd_per_step[s] != self.m * self.v:
            raise self._fail(i, a, f"only {self.bwd_per_step[s]} of the {self.m * self.v} backwards "
                                   f"of step {a.step} done")
        return s

    def _count_live(self, i: int, a: Action) -> None:
        live = len(self.live) + (self.newest not in self.live)
        if live > self.max_live:
            self.max_live = live
            if live > self.spec.weight_versions:
                versions = sorted(set(self.live) | {self.newest})
                raise self._fail(i, a, f"weight versions {versions} live, "
                                       f"the schedule keeps {self.spec.weight_versions}")

    def _forward(self, i: int, a: Action) -> None:
        j, v = self._index(i, a), a.version
        if self.fwd_version[j] >= 0:
            raise self._fail(i, a, "microbatch forwarded twice")
        want = self.versions[a.step - self.first_step]
        if v != want:
            raise self._fail(i, a, f"forward on W({v}) but microbatch k={a.mb + 1} must use W({want})")
        if v > self.newest:
            raise self._fail(i, a, f"forward on W({v}) before APPLY_UPDATE({v - 1}) on this stage")
        src = self.local_in[a.chunk]
        if src is not None:
            if self.fwd_version[j - a.chunk + src] < 0:
                raise self._fail(i, a, f"forward before chunk {src} on this rank made its input")
        elif not self.first[a.chunk]:
            if self.got_act[j] != _RECEIVED:
                raise self._fail(i, a, "forward without its activations received (RECV_ACT missing)")
            self.got_act[j] = _CONSUMED
        self.fwd_version[j] = v
        self.inflight += 1
        if self.inflight > self.max_inflight:
            self.max_inflight = self.inflight
            if self.inflight > self.limit:
                raise self._fail(i, a, f"{self.inflight} microbatches in flight, limit is {self.limit}")
        self.live[v] = self.live.get(v, 0) + 1
        self._count_live(i, a)

    def _backward(self, i: int, a: Action) -> None:
        if self.spec.split_backward:
            raise self._fail(i, a, f"{self.spec.name} splits its backward: BACKWARD_INPUT then BACKWARD_WEIGHT")
        self._input_grad(i, a)
        self._weight_grad(i, a)

    def _backward_input(self, i: int, a: Action) -> None:
        if not self.spec.split_backward:
            raise self._fail(i, a, f"{self.spec.name} runs whole backwards, not BACKWARD_INPUT")
        self._input_grad(i, a)

    def _backward_weight(self, i: int, a: Action) -> None:
        if not self.spec.split_backward:
            raise self._fail(i, a, f"{self.spec.name} runs whole backwards, not BACKWARD_WEIGHT")
        j = self._index(i, a)
        if not self.done_inp[j]:
            raise self._fail(i, a, "weight gradient before the input gradient (BACKWARD_INPUT)")
        if a.version != self.fwd_version[j]:
            raise self._fail(i, a, f"weight gradient on W({a.version}) but forward ran on W({self.fwd_version[j]})")
        self._weight_grad(i, a)

    def _input_grad(self, i: int, a: Action) -> None:
        """B or I: the input gradient, from the next stage's gradient, in microbatch order (per chunk)."""
        j = self._index(i, a)
        v = self.fwd_version[j]
        if v < 0:
            raise self._fail(i, a, "backward before forward")
        if self.done_inp[j]:
            raise self._fail(i, a, "microbatch backwarded twice")
        c = a.chunk
        if a.mb - self.lo != self.next_bwd[c]:
            raise self._fail(i, a, f"backwards out of microbatch order (expected mb {self.lo + self.next_bwd[c]})")
        if a.version != v:
            raise self._fail(i, a, f"backward on W({a.version}) but forward ran on W({v})")
        dst = self.local_out[c]
        if dst is not None:
            if not self.done_inp[j - c + dst]:
                raise self._fail(i, a, f"backward before chunk {dst} on this rank made its output's gradient")
        elif not self.last[c]:
            if self.got_grad[j] != _RECEIVED:
                raise self._fail(i, a, "backward without its gradient received (RECV_GRAD missing)")
            self.got_grad[j] = _CONSUMED
        s = a.step - self.first_step
        if 0 <= s < self.num_steps and s and self.post_validation and not self.validated[s - 1]:
            raise self._fail(i, a, f"backward of step {a.step} before VALIDATE({a.step - 1}): "
                                   "its loss scale is not known")
        self.done_inp[j] = 1
        self.next_bwd[c] += 1
        if 0 <= s < self.num_steps:
            self.inputs_per_step[s] += 1

    def _weight_grad(self, i: int, a: Action) -> None:
        """B or W: the step's gradient gets this microbatch's part; its stash is freed."""
        j = self._index(i, a)
        if self.done_bwd[j]:
            raise self._fail(i, a, "weight gradient of the microbatch computed twice")
        v = self.fwd_version[j]
        self.done_bwd[j] = 1
        self.bwd_per_step[a.step - self.first_step] += 1
        self.inflight -= 1
        if self.live[v] == 1:
            del self.live[v]
        else:
            self.live[v] -= 1

    def _recv_act(self, i: int, a: Action) -> None:
        j = self._index(i, a)
        if self.got_act[j] != _NOT_RECEIVED:
            raise self._fail(i, a, "activations received twice")
        self.got_act[j] = _RECEIVED

    def _recv_grad(self, i: int, a: Action) -> None:
        j = self._index(i, a)
        if self.got_grad[j] != _NOT_RECEIVED:
            raise self._fail(i, a, "gradient received twice")
        self.got_grad[j] = _RECEIVED

    def _send_act(self, i: int, a: Action) -> None:
        j = self._index(i, a)
        if self.fwd_version[j] < 0 or self.sent_act[j]:
            raise self._fail(i, a, "activations sent before the forward or sent twice")
        self.sent_act[j] = 1

    def _send_grad(self, i: int, a: Action) -> None:
        j = self._index(i, a)
        if not self.done_inp[j] or self.sent_grad[j]:
            raise self._fail(i, a, "gradient sent before the backward or sent twice")
        self.sent_grad[j] = 1

    def _reduce(self, i: int, a: Action) -> None:
        s = self._step(i, a)
        if self.reduced[s]:
            raise self._fail(i, a, "gradients reduced twice")
        self.reduced[s] = 1

    def _update(self, i: int, a: Action) -> None:
        s = self._step(i, a)
        if a.step != self.newest:
            raise self._fail(i, a, f"updates out of order: the next update is APPLY_UPDATE({self.newest})")
        if not self.reduced[s]:
            raise self._fail(i, a, "update before REDUCE_GRADS on this stage")
        if s and self.post_validation and not self.validated[s - 1]:
            raise self._fail(i, a, f"update before VALIDATE({a.step - 1})")
        self.newest += 1
        self._count_live(i, a)

    def _reduce_embedding(self, i: int, a: Action) -> None:
        """REDUCE_EMBEDDING(t): the last stage's tied embedding gradient, after every input gradient of t (the
        head's weight gradient is taken there), once, before REDUCE_GRADS(t)."""
        s = a.step - self.first_step
        if not 0 <= s < self.num_steps:
            raise self._fail(i, a, "step outside this segment")
        if not self.post_validation:
            raise self._fail(i, a, f"{self.spec.name} without post-validation reduces the embedding in REDUCE_GRADS")
        if not any(self.last):
            raise self._fail(i, a, "only the stage holding the head reduces the tied embedding early")
        if self.inputs_per_step[s] != self.m * self.v:
            raise self._fail(i, a, f"only {self.inputs_per_step[s]} of the {self.m * self.v} input gradients of step "
                                   f"{a.step} done")
        if self.emb_reduced[s] or self.reduced[s]:
            raise self._fail(i, a, "embedding reduced twice, or after REDUCE_GRADS")
        self.emb_reduced[s] = 1

    def _validate(self, i: int, a: Action) -> None:
        """VALIDATE(t): once, after APPLY_UPDATE(t), never for a segment's last step (its update is exact)."""
        s = a.step - self.first_step
        if not 0 <= s < self.num_steps - 1:
            raise self._fail(i, a, "validates a step outside this segment or its last step (whose update is exact)")
        if not self.post_validation:
            raise self._fail(i, a, f"{self.spec.name} runs without post-validation")
        if self.newest <= a.step:
            raise self._fail(i, a, f"VALIDATE before APPLY_UPDATE({a.step})")
        if self.validated[s]:
            raise self._fail(i, a, "validated twice")
        self.validated[s] = 1

    def finish(self) -> None:
        """The segment must end drained: everything forwarded, backwarded, sent, used and applied."""
        where = f"stage {self.r} at the end of the segment"
        v = self.v
        if sum(self.next_bwd) != len(self.fwd_version) or not all(self.done_bwd):
            missing = [self.lo + j // v for j, x in enumerate(self.fwd_version) if x < 0 or not self.done_bwd[j]]
            raise ScheduleError(f"{where}: microbatches not forwarded and backwarded: {missing[:8]}")
        for c in range(v):
            mine = slice(c, None, v)  # the chunk's slots
            gets = not self.first[c] and self.local_in[c] is None  # its input and gradient cross ranks
            gives = not self.last[c] and self.local_out[c] is None
            if gets and not all(x == _CONSUMED for x in self.got_act[mine]):
                raise ScheduleError(f"{where}: received activations never used")
            if gives and (not all(self.sent_act[mine]) or not all(x == _CONSUMED for x in self.got_grad[mine])):
                raise ScheduleError(f"{where}: activations not sent or gradients not used")
            if gets and not all(self.sent_grad[mine]):
                raise ScheduleError(f"{where}: input gradients not sent back")
        if not all(self.reduced) or self.newest != self.first_step + self.num_steps:
            raise ScheduleError(f"{where}: not drained: applied up to W({self.newest}), reduced {list(self.reduced)}")
        if self.post_validation and not all(self.validated[:-1]):
            raise ScheduleError(f"{where}: speculative updates never validated: {list(self.validated)}")


def _check_fields(r: int, program: Sequence[Action], m: int, first_step: int, num_steps: int) -> None:
    """Every microbatch action names a microbatch of the segment and that microbatch's step."""
    lo, hi = first_step * m, (first_step + num_steps) * m
    for i, a in enumerate(program):
        if a.op in MICROBATCH_OPS:
            if not lo <= a.mb < hi:
                raise ScheduleError(f"stage {r} action #{i} {a}: microbatch outside this segment ({lo}..{hi - 1})")
            if a.step != a.mb // m:
                raise ScheduleError(f"stage {r} action #{i} {a}: step field {a.step} "
                                    f"but microbatch belongs to step {a.mb // m}")


def check_validation_cuts(stages: Sequence[Sequence[Action]]) -> None:
    """Every VALIDATE(t) cuts the programs consistently, so that a failed validation can re-run the warm-up
    of step t+1 with no message in flight: before its VALIDATE(t) a stage has run only forwards of step t+1
    (with their transfers), and each transfer of step t+1 it ran there meets its counterpart before the peer's
    VALIDATE(t) (the first chunk's activations, which go from rank r to rank r+1: one chunk, or a V)."""
    d = len(stages)
    steps = {a.step for p in stages for a in p if a.op is Op.VALIDATE}
    for t in sorted(steps):
        sent: list[list[int]] = []
        got: list[list[int]] = []
        for r, prog in enumerate(stages):
            at = [i for i, a in enumerate(prog) if a.op is Op.VALIDATE and a.step == t]
            if len(at) != 1:
                raise ScheduleError(f"stage {r}: {len(at)} VALIDATE({t}) actions, every stage needs one")
            start = max(i for i, a in enumerate(prog[:at[0]]) if a.op is Op.APPLY_UPDATE and a.step == t) + 1
            sends, recvs = [], []
            for i in range(start, at[0]):
                a = prog[i]
                if a.step != t + 1 or a.op not in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT) or a.chunk:
                    raise ScheduleError(f"stage {r} action #{i} {a}: only step {t + 1}'s forwards (of the first "
                                        f"chunk) may run on the speculative W({t + 1}) before VALIDATE({t})")
                if a.op is Op.SEND_ACT:
                    sends.append(a.mb)
                elif a.op is Op.RECV_ACT:
                    recvs.append(a.mb)
            sent.append(sends)
            got.append(recvs)
        for r in range(d - 1):
            if sent[r] != got[r + 1]:
                raise ScheduleError(f"VALIDATE({t}) is not a consistent cut: stage {r} sends microbatches {sent[r]} "
                                    f"before it, stage {r + 1} receives {got[r + 1]}")


def check_actions(
    schedule: str, d: int, m: int, first_step: int, num_steps: int, stages: Sequence[Sequence[Action]],
    chunks: int | None = None, post_validation: bool = False,
) -> CheckReport:
    """Check hand-made or generated stage programs (one list per stage) for a drained segment."""
    validate_pipeline(schedule, d, m, chunks, post_validation)
    if first_step < 0 or num_steps < 1:
        raise ConfigError(f"a segment needs first_step >= 0 and num_steps >= 1, got {first_step}, {num_steps}")
    if len(stages) != d:
        raise ScheduleError(f"expected programs for {d} stages, got {len(stages)}")
    for r, program in enumerate(stages):
        _check_fields(r, program, m, first_step, num_steps)
    spec = get_schedule(schedule, chunks, post_validation)
    if post_validation:
        check_validation_cuts(stages)
    rules = [_StageRules(spec, d, r, m, first_step, num_steps) for r in range(d)]
    trace = Replay(stages, timing=Timing.unit(d), rules=rules, placement=spec.placement(d)).run()
    if post_validation:  # the fallback too: a stage that cannot speculate waits at its update for every stage
        exact = [[a for a in p if a.op is not Op.VALIDATE] for p in stages]
        Replay(exact, timing=Timing.unit(d), placement=spec.placement(d)).run()
    return CheckReport(schedule, d, m, first_step, num_steps, tuple(x.max_inflight for x in rules),
                       trace.makespan, tuple(x.max_live for x in rules), spec.chunks)


def check_schedule(schedule: str, d: int, m: int, first_step: int = 0, num_steps: int = 3,
                   chunks: int | None = None, post_validation: bool = False) -> CheckReport:
    """Generate every stage's program with :func:`stage_actions` and check them together."""
    stages = [stage_actions(schedule, d, r, m, first_step, num_steps, chunks, post_validation) for r in range(d)]
    return check_actions(schedule, d, m, first_step, num_steps, stages, chunks, post_validation)
