"""One replay engine for the stages' action programs: the deadlock checker, the NCCL-order proof and
the planner's timed simulator all run their programs through it.

Every stage runs its list strictly in order. A stage runs until it blocks and is resumed only when what
it waits for happens, so sweeping every small pipeline stays fast. Blocking points:

- a transfer, with pluggable channel semantics: :class:`Fifo` (gloo as the executor uses it: sends never
  block and queue per boundary and direction; a receive waits for the head message of its queue, which
  must be its microbatch) or :class:`Rendezvous` (NCCL in issue order: each run of transfers with one peer
  is one group, done only when every op in it meets its counterpart in the group the peer is blocked on);
- ``APPLY_UPDATE(t)``, until every stage ran ``REDUCE_GRADS(t)`` (the reductions are collectives); where the
  stage's program validates step t later (``VALIDATE(t)``: optimizer post-validation) the update is speculative
  and waits only for the stage's own gradient, the tied word embedding's all-reduce included (with the last
  stage's ``REDUCE_EMBEDDING(t)``, or its ``REDUCE_GRADS(t)`` where it has none), and ``VALIDATE(t)`` waits
  for every stage's ``REDUCE_GRADS(t)`` instead.

The clock (:class:`Timing`; by default compute takes one unit, a split backward's halves half a unit
each, and everything else is free) ends every action at a time: compute takes its stage's time; a
message occupies its link after the later of its send and the link's previous message and arrives
``latency`` later; a receive ends at the later of the stage's clock and the arrival; the reduction
chain of step t is done for every stage at ``max_r(launch_r + reduce_s_r) + collective_s``, chains
finishing in step order; an update starts when its chain is done.

Programs whose ranks hold several model chunks (``Action.chunk``) name each transfer's peer through the
:class:`~.placement.Placement` given (by default one chunk per rank: stage ``r`` on rank ``r``), and a
message is matched by what it carries (the sending virtual stage and the microbatch), so a link between
two ranks may carry several chunks' messages (interleaved: rank d-1 to rank 0 for the next chunk).

Rules (the checker's semantics) plug in per stage: ``check[op](i, action)`` runs once before each action
and ``finish()`` when the stage's program ends; both raise to refuse the program.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .actions import TRANSFERS, Action, Op
from .placement import Placement, group_key

BLOCKED = -1  # a handler's answer when the stage must wait

Handler = Callable[[int, int, Action], int]  # (stage, index, action) -> next index or BLOCKED


class ScheduleError(AssertionError):
    """A schedule violates deadlock freedom, the in-flight bound or the version semantics."""


class StageRules(Protocol):
    """Per-stage checks: one callable per op, run before the action, and an end-of-program check."""

    check: Mapping[Op, Callable[[int, Action], None]]

    def finish(self) -> None: ...


@dataclass(frozen=True)
class Timing:
    """Per stage: compute, update and reduction times; per boundary: a message's link occupancy and
    latency (both directions alike); ``collective_s`` closes every reduction chain."""

    forward_s: Sequence[float]
    backward_s: Sequence[float]
    update_s: Sequence[float]
    reduce_s: Sequence[float]
    reduce_busy_s: Sequence[float]
    transfer_s: Sequence[float]
    latency_s: Sequence[float]
    collective_s: float = 0.0
    # a split backward's halves, BACKWARD_INPUT and BACKWARD_WEIGHT; None: half of ``backward_s`` each
    input_s: Sequence[float] | None = None
    weight_s: Sequence[float] | None = None

    @classmethod
    def unit(cls, d: int) -> Timing:
        """Every FORWARD and BACKWARD one slot (a split one's I and W half a slot each); transfers,
        reductions and updates free."""
        zeros = (0.0,) * d
        return cls((1.0,) * d, (1.0,) * d, zeros, zeros, zeros, zeros, zeros)

    def split(self) -> tuple[list[float], list[float]]:
        """Per stage, the times of BACKWARD_INPUT and BACKWARD_WEIGHT."""
        half = [b / 2 for b in self.backward_s]
        return (list(self.input_s) if self.input_s is not None else half,
                list(self.weight_s) if self.weight_s is not None else half)


@dataclass
class Trace:
    """When every action ended, per stage in program order; ``update_start`` where an update waited."""

    end: list[list[float]]
    update_start: dict[tuple[int, int], float]

    def start(self, r: int, i: int) -> float:
        """An action starts when the one before it ended (an update: when its reduction was done)."""
        waited = self.update_start.get((r, i))
        if waited is not None:
            return waited
        return self.end[r][i - 1] if i else 0.0

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.end if e), default=0.0)


_NO_PEER = {
    Op.RECV_ACT: "stage 0 has no previous stage to receive activations from",
    Op.SEND_GRAD: "stage 0 has no previous stage to send gradients to",
    Op.SEND_ACT: "the last stage has no next stage to send activations to",
    Op.RECV_GRAD: "the last stage has no next stage to receive gradients from",
}


class Replay:
    """Runs every stage's program with one channel model, a clock and optional rules."""

    def __init__(
        self, programs: Sequence[Sequence[Action]], *, channel: Fifo | Rendezvous | None = None,
        timing: Timing | None = None, rules: Sequence[StageRules] | None = None,
        error: type[Exception] = ScheduleError, placement: Placement | None = None,
    ) -> None:
        self.programs = [p if isinstance(p, (list, tuple)) else list(p) for p in programs]
        d = self.d = len(self.programs)
        self.placement = placement or Placement(d)
        if self.placement.d != d:
            raise ValueError(f"a placement of {self.placement.d} ranks for {d} programs")
        self.timing = timing or Timing.unit(d)
        self.forward_s, self.backward_s = list(self.timing.forward_s), list(self.timing.backward_s)
        self.input_s, self.weight_s = self.timing.split()
        self.rules, self.error = rules, error
        self.pc, self.clock = [0] * d, [0.0] * d
        self.end = [[0.0] * len(p) for p in self.programs]
        self.update_start: dict[tuple[int, int], float] = {}
        self.resumed = [False] * d  # blocked inside an action: its rules already ran
        self.ready: deque[int] = deque(range(d))
        self.launched: dict[int, dict[int, float]] = {}  # step -> stage -> its reduction chain's end
        self.reduced_at: dict[int, float] = {}  # step -> every stage's chain done
        self.last_reduced = 0.0
        self.update_waiters: dict[int, list[int]] = {}
        # optimizer post-validation: the steps each stage validates (its updates of them are speculative), when
        # each stage launched its part of the tied embedding's all-reduce, and the stages waiting for a partner's
        self.validated = [frozenset(a.step for a in p if a.op is Op.VALIDATE) for p in self.programs]
        self.emb_early = [frozenset(a.step for a in p if a.op is Op.REDUCE_EMBEDDING) for p in self.programs]
        self.emb_launched: dict[tuple[int, int], float] = {}  # (step, rank) -> its embedding link's launch
        self.emb_waiters: dict[tuple[int, int], list[int]] = {}
        self.channel = channel or Fifo()
        self.channel.attach(self)
        self.handlers = [self._stage_handlers(r) for r in range(d)]

    def _stage_handlers(self, r: int) -> dict[Op, Handler]:
        return {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input, Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.REDUCE_GRADS: self._reduce, Op.APPLY_UPDATE: self._update, Op.REDUCE_EMBEDDING: self._reduce_embedding,
            Op.VALIDATE: self._validate, **self.channel.handlers(r),
        }

    def fail(self, r: int, i: int, a: Action, msg: str) -> Exception:
        return self.error(f"stage {r} action #{i} {a}: {msg}")

    def no_peer(self, r: int, i: int, a: Action) -> int:
        """The handler of a transfer towards a stage that does not exist."""
        raise self.fail(r, i, a, _NO_PEER[a.op])

    def peer(self, r: int, i: int, a: Action) -> int:
        """The rank transfer ``a`` of stage ``r`` talks to; refuses a missing neighbour or a chunk off the layout."""
        place = self.placement
        if not 0 <= a.chunk < place.chunks:
            raise self.fail(r, i, a, f"chunk {a.chunk} outside the layout's {place.chunks} chunk(s) per rank")
        p = place.peer(r, a)
        if p is None:
            self.no_peer(r, i, a)
        return p

    def run(self) -> Trace:
        """Run to the end; the error names every stuck stage or the messages never received."""
        ready = self.ready
        while ready:
            self._advance(ready.popleft())
        stuck = [r for r in range(self.d) if self.pc[r] < len(self.programs[r])]
        if stuck:
            where = ", ".join(f"stage {r} at #{self.pc[r]} {self.programs[r][self.pc[r]]}" for r in stuck)
            raise self.error(f"{self.channel.deadlock}: {where}")
        left = self.channel.leftover()
        if left is not None:
            raise self.error(f"messages from stage {left[0]} to stage {left[1]} were never received")
        return Trace(self.end, self.update_start)

    def _advance(self, r: int) -> None:
        """Run stage ``r`` until it blocks or its program ends."""
        prog, handlers = self.programs[r], self.handlers[r]
        n, i = len(prog), self.pc[r]
        if i == n:  # already finished
            return
        if self.resumed[r]:  # the action it blocked in: its rules already ran
            i = handlers[prog[i].op](r, i, prog[i])
            if i == BLOCKED:
                return
            self.resumed[r] = False
        check = self.rules[r].check if self.rules is not None else None
        while i < n:
            a = prog[i]
            op = a.op
            if check is not None:
                check[op](i, a)
            nxt = handlers[op](r, i, a)
            if nxt < 0:  # BLOCKED
                self.pc[r], self.resumed[r] = i, True
                return
            i = nxt
        self.pc[r] = n
        if self.rules is not None:
            self.rules[r].finish()

    def _forward(self, r: int, i: int, a: Action) -> int:
        self.end[r][i] = self.clock[r] = self.clock[r] + self.forward_s[r]
        return i + 1

    def _backward(self, r: int, i: int, a: Action) -> int:
        self.end[r][i] = self.clock[r] = self.clock[r] + self.backward_s[r]
        return i + 1

    def _backward_input(self, r: int, i: int, a: Action) -> int:
        self.end[r][i] = self.clock[r] = self.clock[r] + self.input_s[r]
        return i + 1

    def _backward_weight(self, r: int, i: int, a: Action) -> int:
        self.end[r][i] = self.clock[r] = self.clock[r] + self.weight_s[r]
        return i + 1

    def _reduce(self, r: int, i: int, a: Action) -> int:
        """Launch the stage's reduction chain; the last stage to launch closes the collective."""
        now, t = self.clock[r], self.timing
        chains = self.launched.setdefault(a.step, {})
        chains[r] = now + t.reduce_s[r]
        if a.step not in self.emb_early[r]:
            self._launch_embedding(r, a.step, now)
        if len(chains) == self.d:
            self.last_reduced = max(self.last_reduced, max(chains.values()) + t.collective_s)
            self.reduced_at[a.step] = self.last_reduced
            self.ready.extend(self.update_waiters.pop(a.step, ()))
        self.end[r][i] = self.clock[r] = now + t.reduce_busy_s[r]
        return i + 1

    def _reduce_embedding(self, r: int, i: int, a: Action) -> int:
        """Launch the tied embedding's all-reduce ahead of the stage's chain (free on the stage's clock)."""
        self._launch_embedding(r, a.step, self.clock[r])
        self.end[r][i] = self.clock[r]
        return i + 1

    def _launch_embedding(self, r: int, step: int, now: float) -> None:
        self.emb_launched[(step, r)] = now
        self.ready.extend(self.emb_waiters.pop((step, r), ()))

    def _partner(self, r: int) -> int | None:
        """The rank ``r`` all-reduces the tied word embedding with: the model's first and last stage, where apart."""
        place = self.placement
        first, last = place.rank(0), place.rank(place.num_stages - 1)
        if first == last:
            return None
        return last if r == first else first if r == last else None

    def _update(self, r: int, i: int, a: Action) -> int:
        if a.step in self.validated[r]:  # speculative: the stage's own gradient, the embedding's link included
            p = self._partner(r)
            done = 0.0
            if p is not None:
                theirs = self.emb_launched.get((a.step, p))
                if theirs is None:
                    self.emb_waiters.setdefault((a.step, p), []).append(r)
                    return BLOCKED
                done = max(theirs, self.emb_launched.get((a.step, r), 0.0)) + self.timing.collective_s
        else:
            done = self.reduced_at.get(a.step)
            if done is None:
                self.update_waiters.setdefault(a.step, []).append(r)
                return BLOCKED
        start = self.clock[r] if self.clock[r] > done else done
        if start > self.clock[r]:
            self.update_start[(r, i)] = start
        self.end[r][i] = self.clock[r] = start + self.timing.update_s[r]
        return i + 1

    def _validate(self, r: int, i: int, a: Action) -> int:
        """Wait for the global norm of step ``a.step``: every stage's REDUCE_GRADS (free once it is known)."""
        done = self.reduced_at.get(a.step)
        if done is None:
            self.update_waiters.setdefault(a.step, []).append(r)
            return BLOCKED
        if done > self.clock[r]:
            self.update_start[(r, i)] = done
            self.clock[r] = done
        self.end[r][i] = self.clock[r]
        return i + 1


class _Link:
    """Messages of one kind from one rank to another: queued (message, arrival), when the link is next
    free, and whether its receiver is blocked on it; ``send``/``recv`` are the handlers of its two ends."""

    __slots__ = ("replay", "sender", "receiver", "what", "queue", "free", "waiting", "transfer_s", "latency_s")

    def __init__(self, replay: Replay, sender: int, receiver: int, what: str) -> None:
        d = replay.d
        # the boundary's costs; a wrap-around link (rank d-1 to rank 0, interleaved) costs like boundary d-2
        boundary = min(sender, receiver, d - 2) if abs(sender - receiver) == 1 else d - 2
        self.replay, self.sender, self.receiver, self.what = replay, sender, receiver, what
        self.queue: deque[tuple[object, float]] = deque()
        self.free, self.waiting = 0.0, False
        self.transfer_s, self.latency_s = replay.timing.transfer_s[boundary], replay.timing.latency_s[boundary]

    def send(self, r: int, i: int, a: Action, key: object) -> int:
        """Queue the message after the later of now and the link's previous message."""
        rp = self.replay
        now = rp.clock[r]
        self.free = (now if now > self.free else self.free) + self.transfer_s
        self.queue.append((key, self.free + self.latency_s))
        if self.waiting:
            self.waiting = False
            rp.ready.append(self.receiver)
        rp.end[r][i] = now
        return i + 1

    def recv(self, r: int, i: int, a: Action, key: object) -> int:
        """Take the head message, which must be ``key`` (``a``'s); the wait ends at its arrival."""
        if not self.queue:
            self.waiting = True
            return BLOCKED
        rp = self.replay
        head, arrival = self.queue[0]
        if head != key:
            got = head if isinstance(head, int) else f"{head[2]} of virtual stage {head[1]}"
            raise rp.fail(r, i, a, f"mismatched order: stage {self.sender} sent the {self.what} "
                                   f"of microbatch {got} first")
        self.queue.popleft()
        now = rp.clock[r]
        rp.end[r][i] = rp.clock[r] = arrival if arrival > now else now
        return i + 1


_ACT_KIND = frozenset({Op.SEND_ACT, Op.RECV_ACT})


class Fifo:
    """Sends never block; each (sender rank, receiver rank, kind) is a FIFO queue (one chunk per rank:
    each boundary between stages b and b + 1 and direction)."""

    deadlock = "deadlock"

    def attach(self, replay: Replay) -> None:
        self.replay = replay
        self.links: dict[tuple[int, int, bool], _Link] = {}
        if replay.placement.chunks == 1:  # the plain pipeline's links, in boundary order
            for b in range(replay.d - 1):
                self._link(b, b + 1, True)
            for b in range(replay.d - 1):
                self._link(b + 1, b, False)

    def _link(self, sender: int, receiver: int, acts: bool) -> _Link:
        link = self.links.get((sender, receiver, acts))
        if link is None:
            link = self.links[(sender, receiver, acts)] = _Link(
                self.replay, sender, receiver, "activations" if acts else "gradient")
        return link

    def handlers(self, r: int) -> dict[Op, Handler]:
        """Stage ``r``'s transfers bound to its links (a missing neighbour refuses them)."""
        rp = self.replay
        if rp.placement.chunks == 1:  # fast path: one link per op, the message is the microbatch
            def bound(op: Op) -> Handler:
                p = r + TRANSFERS[op][0]
                if not 0 <= p < rp.d:
                    return rp.no_peer
                acts = op in _ACT_KIND
                link = self._link(r, p, acts) if op in (Op.SEND_ACT, Op.SEND_GRAD) else self._link(p, r, acts)
                end = link.send if op in (Op.SEND_ACT, Op.SEND_GRAD) else link.recv
                return lambda r_, i, a: end(r_, i, a, a.mb)
            return {op: bound(op) for op in TRANSFERS}
        return dict.fromkeys(TRANSFERS, self._chunked)

    def _chunked(self, r: int, i: int, a: Action) -> int:
        """A transfer of a chunked layout: the link follows the chunk's virtual stage."""
        rp = self.replay
        p = rp.peer(r, i, a)
        key = rp.placement.message(r, a)
        if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            return self._link(r, p, key[0]).send(r, i, a, key)
        return self._link(p, r, key[0]).recv(r, i, a, key)

    def leftover(self) -> tuple[int, int] | None:
        """(sender, receiver) of the first link with a message nobody received."""
        return next(((link.sender, link.receiver) for link in self.links.values() if link.queue), None)


class Rendezvous:
    """Transfers in issue order, each run with one peer issued as one group (an NCCL group).

    ``groups_of(program)`` gives ``{start: end}`` for every group (with chunks, ``groups_of(program, peer=...)``
    with each transfer's peer rank); a group is done once every op in it met its counterpart (same
    message) in the group the peer has posted and waits on.
    """

    deadlock = "grouped transfers deadlock"

    def __init__(self, groups_of: Callable[[Sequence[Action]], dict[int, int]]) -> None:
        self.groups_of = groups_of

    def attach(self, replay: Replay) -> None:
        self.replay = replay
        key = group_key(replay.placement)
        if key is None:
            self.groups = [self.groups_of(p) for p in replay.programs]
        else:  # several chunks: each round's run of transfers is one group
            self.groups = [self.groups_of(p, peer=key) for p in replay.programs]
        self.pending: list[set[tuple[Op, int]] | None] = [None] * replay.d  # the posted group's open ops
        self.done_at = [0.0] * replay.d  # when its last op met its counterpart

    def handlers(self, r: int) -> dict[Op, Handler]:
        return dict.fromkeys(TRANSFERS, self._group)

    def _group(self, r: int, i: int, a: Action) -> int:
        """Post the group starting at ``i`` (first visit), then wait until it is done."""
        rp, pending = self.replay, self.pending
        end = self.groups[r].get(i)
        if end is None:
            raise rp.fail(r, i, a, "transfer outside any group")
        if pending[r] is None:
            self._post(r, i, end)
        if pending[r]:
            return BLOCKED
        pending[r] = None
        rp.clock[r] = max(rp.clock[r], self.done_at[r])
        for j in range(i, end):
            rp.end[r][j] = rp.clock[r]
        return end

    def _post(self, r: int, i: int, end: int) -> None:
        """Match the group's ops against the peer's posted group; wake the peer if that completes it."""
        rp = self.replay
        acts = rp.programs[r][i:end]
        peers = {rp.peer(r, i + k, x) for k, x in enumerate(acts)}
        place = rp.placement
        mine = {(x.op, place.message(r, x)) for x in acts}  # the message identifies the chunk's virtual stage
        self.pending[r], self.done_at[r] = mine, rp.clock[r]
        for p in peers:
            theirs = self.pending[p]
            if not theirs:
                continue
            for op, msg in list(mine):
                if (TRANSFERS[op][1], msg) in theirs:
                    mine.discard((op, msg))
                    theirs.discard((TRANSFERS[op][1], msg))
                    met = max(rp.clock[r], self.done_at[p])
                    self.done_at[r], self.done_at[p] = max(self.done_at[r], met), max(self.done_at[p], met)
            if not theirs:
                rp.ready.append(p)

    def leftover(self) -> tuple[int, int] | None:
        return None
