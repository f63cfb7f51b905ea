"""Grouped transfers for backends that run point-to-point ops in issue order (NCCL).

NCCL executes the sends and receives between two ranks on one stream, in the order they were
issued, and a large send does not finish before the peer's matching receive runs. Under that
model a stage that prefetches ``RECV_ACT(i)`` before ``SEND_GRAD(j)`` deadlocks against a
previous stage that posts ``RECV_GRAD(j)`` before ``SEND_ACT(i)``: each receive waits for a send
queued behind the other's receive. Plain issue order deadlocks too: in the 1F1B steady state
stage r runs ``SEND_GRAD(j) RECV_ACT(i)`` while stage r-1 runs ``SEND_ACT(i) RECV_GRAD(j)``.

The fix (Megatron-LM's ``send_forward_recv_backward``) is to issue each run of consecutive
transfers with the same peer as one ``batch_isend_irecv`` group, whose ops progress together,
and wait for the whole group before the next action. :func:`comm_groups` cuts a stage's action
list into such groups; :func:`check_grouped` proves, for all stages together, that the groups
complete under the strictest model of that backend: a group completes only when every op in it
meets its counterpart in the group the peer is blocked on at the same moment (rendezvous), and
every stage runs its actions strictly in order. Anything that completes under this model
completes under NCCL's real, looser one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .actions import Action, Op
from .checker import ScheduleError
from .schedules import stage_actions, validate_pipeline

COMM_OPS: frozenset[Op] = frozenset({Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD})

# op -> (peer offset, the op the peer must run, for the same microbatch)
_PEER: dict[Op, tuple[int, Op]] = {
    Op.SEND_ACT: (1, Op.RECV_ACT),
    Op.RECV_GRAD: (1, Op.SEND_GRAD),
    Op.RECV_ACT: (-1, Op.SEND_ACT),
    Op.SEND_GRAD: (-1, Op.RECV_GRAD),
}


def peer_offset(op: Op) -> int:
    """+1 for transfers with the next stage, -1 for the previous one."""
    return _PEER[op][0]


def comm_groups(actions: Sequence[Action]) -> dict[int, int]:
    """``{start: end}`` for every maximal run ``actions[start:end]`` of transfers with one peer.

    Transfers that are adjacent in the list but go to different peers form separate groups.
    """
    groups: dict[int, int] = {}
    i, n = 0, len(actions)
    while i < n:
        op = actions[i].op
        if op not in COMM_OPS:
            i += 1
            continue
        j = i + 1
        while j < n and actions[j].op in COMM_OPS and peer_offset(actions[j].op) == peer_offset(op):
            j += 1
        groups[i] = j
        i = j
    return groups


def check_grouped_actions(
    stages: Sequence[Sequence[Action]], groups_of: Callable[[Sequence[Action]], dict[int, int]] = comm_groups,
) -> None:
    """Simulate all stages with grouped transfers; raise :class:`ScheduleError` on a deadlock.

    A stage issues a group and waits until every op in it is done. An op is done once the peer
    has posted its counterpart (same microbatch) in the group that peer is waiting on, so the
    ops of one group progress independently (as in an NCCL group) but no op is ever posted ahead
    of the group before it. Compute ops and ``REDUCE_GRADS`` never block; ``APPLY_UPDATE(t)``
    waits until every stage ran ``REDUCE_GRADS(t)`` (those reductions are collectives).
    ``groups_of`` cuts a program into groups (tests pass other cuttings to show they deadlock).
    """
    d = len(stages)
    groups = [groups_of(a) for a in stages]
    pc = [0] * d
    reduced: dict[int, int] = {}
    pending: dict[int, set[tuple[Op, int]]] = {}  # stage -> ops of its current group not yet done
    while True:
        before = list(pc)
        for r in range(d):  # run every stage up to its next group, a blocked update or its end
            acts = stages[r]
            while pc[r] < len(acts) and pc[r] not in groups[r]:
                a = acts[pc[r]]
                if a.op is Op.APPLY_UPDATE and reduced.get(a.step, 0) < d:
                    break
                if a.op is Op.REDUCE_GRADS:
                    reduced[a.step] = reduced.get(a.step, 0) + 1
                pc[r] += 1
            if pc[r] in groups[r] and r not in pending:
                pending[r] = {(a.op, a.mb) for a in acts[pc[r]:groups[r][pc[r]]]}
        if all(pc[r] == len(stages[r]) for r in range(d)):
            return
        matched = False
        for r in list(pending):
            for op, mb in list(pending[r]):
                off, want = _PEER[op]
                peer = pending.get(r + off)
                if peer is not None and (want, mb) in peer:
                    peer.discard((want, mb))
                    pending[r].discard((op, mb))
                    matched = True
        for r in [r for r, left in pending.items() if not left]:
            pc[r] = groups[r][pc[r]]
            del pending[r]
        if pc == before and not matched:
            stuck = ", ".join(
                f"stage {r} at #{pc[r]} {stages[r][pc[r]]}" for r in range(d) if pc[r] < len(stages[r])
            )
            raise ScheduleError(f"grouped transfers deadlock: {stuck}")


def check_grouped(schedule: str, d: int, m: int, first_step: int = 0, num_steps: int = 3) -> None:
    """:func:`check_grouped_actions` on the generated programs of every stage."""
    validate_pipeline(schedule, d, m)
    check_grouped_actions([stage_actions(schedule, d, r, m, first_step, num_steps) for r in range(d)])
