"""The rounds lowering (a rank's computes in rounds, transfers added between them), the footprints counted
from a compute order, and the replayed bubble of a generated program."""

from __future__ import annotations

import functools

from .actions import Action, Op
from .placement import Placement
from .replay import Replay, Timing
from .spec import ScheduleSpec

_COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
Round = tuple[tuple[Op, int, int], ...]  # (compute op, chunk, microbatch) computes a rank runs, then communicates
_GRAD = frozenset({Op.BACKWARD, Op.BACKWARD_INPUT})  # the computes that make the input gradient


def _kind(op: Op) -> int:
    """0: forward, 1: input gradient (B or I), 2: weight gradient (W)."""
    return 0 if op is Op.FORWARD else 1 if op in _GRAD else 2


def _dep(op: Op, s: int, last: int) -> int | None:
    """The virtual stage whose compute this one needs (W needs only its own I, earlier on the rank)."""
    if op is Op.FORWARD:
        return s - 1 if s > 0 else None
    return s + 1 if op in _GRAD and s < last else None


def _slots(place: Placement, rounds: tuple[tuple[Round, ...], ...]) -> dict[tuple[int, int, int], int]:
    """(virtual stage, kind, microbatch) -> its slot: each round the earliest after the rank's previous round
    and after every compute it needs on a neighbouring virtual stage (see :func:`lower_rounds`)."""
    d, last = place.d, place.num_stages - 1
    slot: dict[tuple[int, int, int], int] = {}
    pc, free = [0] * d, [0] * d
    progress = True
    while progress:
        progress = False
        for r in range(d):
            while pc[r] < len(rounds[r]):
                deps = [(x, _kind(op), j) for op, c, j in rounds[r][pc[r]]
                        if (x := _dep(op, place.stage(r, c), last)) is not None]
                if any(x not in slot for x in deps):
                    break
                k = max([free[r]] + [slot[x] + 1 for x in deps])
                for op, c, j in rounds[r][pc[r]]:
                    slot[(place.stage(r, c), _kind(op), j)] = k
                free[r], pc[r], progress = k + 1, pc[r] + 1, True
    if any(pc[r] < len(rounds[r]) for r in range(d)):
        raise RuntimeError(f"compute orders wait on each other: ranks stopped at rounds {pc}")
    return slot


@functools.lru_cache(maxsize=1024)
def lower_rounds(place: Placement,
                 rounds: tuple[tuple[Round, ...], ...]) -> tuple[tuple[tuple[Op, int, int], ...], ...]:
    """Every rank's (op, chunk, microbatch) program for one step of compute ``rounds`` (per rank, in order),
    with the transfers placed between the rounds: the lowering pass that makes a multi-chunk order a program.

    With several chunks the ranks form a ring (rank d-1 feeds rank 0 the next chunk), where the one-chunk
    convention (each transfer next to its compute, each run of transfers with one peer one NCCL group)
    deadlocks under NCCL's in-order matching: every rank can sit in a send to its previous rank that no
    one receives. Here each round gets a slot, the earliest after the rank's previous round and after every
    compute it needs on a neighbouring virtual stage; after slot k every rank runs its transfers of slot k
    as one run: the sends of its slot-k computes, then the receives of what its neighbours computed in slot
    k for it (Megatron's ``send_forward_backward_recv_forward_backward``: both directions in one group).
    The ranks' slot-k runs match among themselves, so they complete slot after slot under gloo's queues
    and NCCL's rendezvous alike (the checker proves it for every layout), and every input arrives at least
    a slot before its compute, waiting in the executor's mail until then. Megatron-like rounds (a forward
    and a backward each in the steady state) keep the slots of all ranks equally long.
    """
    d, last = place.d, place.num_stages - 1
    slot = _slots(place, rounds)
    span = max(slot.values()) + 1
    programs: list[list[list[tuple[Op, int, int]]]] = [[[] for _ in range(span)] for _ in range(d)]
    sends: list[list[list[tuple[Op, int, int]]]] = [[[] for _ in range(span)] for _ in range(d)]
    recvs: list[list[list[tuple[Op, int, int]]]] = [[[] for _ in range(span)] for _ in range(d)]
    for r in range(d):
        for rnd in rounds[r]:
            op0, c0, j0 = rnd[0]
            k = slot[(place.stage(r, c0), _kind(op0), j0)]
            programs[r][k].extend(rnd)
            for op, c, j in rnd:
                s = place.stage(r, c)
                to = (s + 1 if s < last else None) if op is Op.FORWARD else (s - 1 if s > 0 else None) \
                    if op in _GRAD else None
                if to is None or place.rank(to) == r:  # the model's end, a W, or a hand-over on the rank itself
                    continue
                sends[r][k].append((Op.SEND_ACT if op is Op.FORWARD else Op.SEND_GRAD, c, j))
                recvs[place.rank(to)][k].append((Op.RECV_ACT if op is Op.FORWARD else Op.RECV_GRAD, place.chunk(to), j))
    out = []
    for r in range(d):
        prog: list[tuple[Op, int, int]] = []
        for k in range(span):
            prog.extend(programs[r][k])
            prog.extend(sends[r][k])
            prog.extend(sorted(recvs[r][k], key=lambda x: (x[0] is Op.RECV_GRAD, x[1], x[2])))
        out.append(tuple(prog))
    return tuple(out)



def _flushed_steps(spec: ScheduleSpec, rounds, m: int, first_step: int, num_steps: int,
                   cut: int | None = None) -> list[Action]:
    """A chunked schedule's segment: each step runs one step's lowered ``rounds`` ((op, chunk, microbatch of
    the step) in order), then reduces and applies on its own, like Flush. ``cut`` (post-validation): the
    warm-up forwards after which each step checks the step before it (:func:`_insert_validation`)."""
    out: list[Action] = []
    for t in range(first_step, first_step + num_steps):
        v, lo = spec.version(t), t * m
        step = [Action(op, lo + j, t, v if op in _COMPUTE else -1, c) for op, c, j in rounds]
        if cut is not None and t > first_step:
            step = _insert_validation(step, cut, lo, t - 1)
        out.extend(step)
        out.append(Action(Op.REDUCE_GRADS, step=t))
        out.append(Action(Op.APPLY_UPDATE, step=t))
    return out



def _replayed_bubble(spec, d: int, m: int, f: float, b: float, w: float, pv: bool = False) -> float:
    """One step's idle time of the generated programs: a flushed step's makespan less its work; with
    post-validation, where consecutive steps overlap, the steady state's: the longest span of one rank's
    computes within that same flushed step, less the work (each rank goes on with the next step as soon as
    its own part of this one is done, and the parallelograms tile; ``tests/test_post_validation.py`` checks
    it against three steps' makespan less two steps'). ``spec``: the schedule without post-validation."""
    flushed, overlapped = _replayed_idle(spec, d, m, f, b, w)
    return overlapped if pv else flushed


@functools.lru_cache(maxsize=1 << 12)
def _replayed_idle(spec, d: int, m: int, f: float, b: float, w: float) -> tuple[float, float]:
    """(flushed, overlapped) idle time of one step: see :func:`_replayed_bubble`."""
    programs = [spec.actions(d, r, m, 0, 1) for r in range(d)]
    zeros = (0.0,) * d
    timing = Timing((f,) * d, (b + w,) * d, zeros, zeros, zeros, zeros, zeros, input_s=(b,) * d, weight_s=(w,) * d)
    work = m * spec.chunks * (f + b + w)  # every chunk's share
    trace = Replay(programs, timing=timing, placement=spec.placement(d)).run()
    span = 0.0
    for r, prog in enumerate(programs):
        computes = [i for i, a in enumerate(prog) if a.op in _COMPUTE]
        span = max(span, trace.end[r][computes[-1]] - trace.start(r, computes[0]))
    return max(trace.makespan - work, 0.0), max(span - work, 0.0)


def _insert_validation(step: list[Action], cut: int, lo: int, validated: int) -> list[Action]:
    """``step``'s actions with VALIDATE(``validated``) after its first ``cut`` forwards of chunk 0 (their sends
    included) and, on a stage with a previous one, after the receive of the next forward's input: the same cut
    as :func:`_post_validated` makes, for a program whose transfers a lowering pass placed."""
    has_prev = any(a.op is Op.RECV_ACT and a.chunk == 0 for a in step)
    forwards = 0
    for i, a in enumerate(step):
        if has_prev and a.op is Op.RECV_ACT and a.chunk == 0 and a.mb == lo + cut and forwards == cut:
            return [*step[:i + 1], Action(Op.VALIDATE, step=validated), *step[i + 1:]]
        if not has_prev and forwards == cut and a.op is not Op.SEND_ACT:
            return [*step[:i], Action(Op.VALIDATE, step=validated), *step[i:]]
        if a.op is Op.FORWARD and a.chunk == 0:
            forwards += 1
        elif a.op not in (Op.SEND_ACT, Op.RECV_ACT) or a.chunk:
            break
    raise RuntimeError(f"no place for post-validation after {cut} warm-up forwards in {step[:8]}")
