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

from .actions import TRANSFERS, Action, Op
from .placement import Placement
from .replay import Rendezvous, Replay, ScheduleError
from .schedules import get_schedule, stage_actions, validate_pipeline

__all__ = ["COMM_OPS", "ScheduleError", "check_grouped", "check_grouped_actions", "check_in_order", "comm_groups",
           "peer_offset", "with_rerun"]

COMM_OPS: frozenset[Op] = frozenset(TRANSFERS)


def peer_offset(op: Op) -> int:
    """+1 for transfers with the next stage, -1 for the previous one."""
    return TRANSFERS[op][0]


def comm_groups(actions: Sequence[Action], peer: Callable[[Action], object] | None = None) -> dict[int, int]:
    """``{start: end}`` for every maximal run ``actions[start:end]`` of transfers with one peer.

    Transfers that are adjacent in the list but go to different peers form separate groups. ``peer``
    names a transfer's peer (a rank: :meth:`~.placement.Placement.peer`, where chunks make it depend on the
    action); by default the stage offset of its op.
    """
    key = peer or (lambda a: peer_offset(a.op))
    groups: dict[int, int] = {}
    i, n = 0, len(actions)
    while i < n:
        op = actions[i].op
        if op not in COMM_OPS:
            i += 1
            continue
        j, mine = i + 1, key(actions[i])
        while j < n and actions[j].op in COMM_OPS and key(actions[j]) == mine:
            j += 1
        groups[i] = j
        i = j
    return groups


def check_grouped_actions(
    stages: Sequence[Sequence[Action]], groups_of: Callable[..., dict[int, int]] = comm_groups,
    placement: Placement | None = None,
) -> None:
    """Replay all stages with grouped transfers (:class:`~.replay.Rendezvous`); raise
    :class:`ScheduleError` on a deadlock.

    A stage issues a group and waits until every op in it is done. An op is done once the peer
    has posted its counterpart (same microbatch) in the group that peer is waiting on, so the
    ops of one group progress independently (as in an NCCL group) but no op is ever posted ahead
    of the group before it. Compute ops and ``REDUCE_GRADS`` never block; ``APPLY_UPDATE(t)``
    waits until every stage ran ``REDUCE_GRADS(t)`` (those reductions are collectives).
    ``groups_of`` cuts a program into groups (tests pass other cuttings to show they deadlock).
    """
    Replay(stages, channel=Rendezvous(groups_of), placement=placement).run()


def check_in_order(stages: Sequence[Sequence[Action]], placement: Placement | None = None) -> None:
    """NCCL matches the transfers between two ranks in issue order, ignoring tags: per ordered pair of ranks,
    the messages one sends the other (in program order) must be exactly the messages the other receives
    from it (in its program order), or buffers of one shape are silently swapped (a V's or an interleaved
    ring's link carries activations and gradients alike). A grouped unit issues its sends before its
    receives, which keeps each direction's order, so program order is issue order."""
    place = placement or Placement(len(stages))
    sent: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], list] = {}
    for r, prog in enumerate(stages):
        for a in prog:
            if a.op not in COMM_OPS:
                continue
            p = place.peer(r, a)
            pair, book = ((r, p), sent) if a.op in (Op.SEND_ACT, Op.SEND_GRAD) else ((p, r), got)
            book.setdefault(pair, []).append(place.message(r, a))
    for pair in sorted(set(sent) | set(got)):
        out, into = sent.get(pair, []), got.get(pair, [])
        if out != into:
            k = next((k for k, (x, y) in enumerate(zip(out, into)) if x != y), min(len(out), len(into)))
            raise ScheduleError(f"stage {pair[0]} sends stage {pair[1]} its messages in another order than that "
                                f"stage receives them (NCCL matches in issue order): message #{k} sent "
                                f"{out[k] if k < len(out) else None}, received {into[k] if k < len(into) else None}")


def with_rerun(stages: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """The programs as run when every VALIDATE(t) fails: the warm-up between APPLY_UPDATE(t) and VALIDATE(t)
    runs again right after it (a rollback is global: every stage re-runs its part)."""
    out = []
    for prog in stages:
        new: list[Action] = []
        for i, a in enumerate(prog):
            new.append(a)
            if a.op is Op.VALIDATE:
                start = max(j for j in range(i) if prog[j].op is Op.APPLY_UPDATE and prog[j].step == a.step) + 1
                new.extend(prog[start:i])
        out.append(new)
    return out


def check_grouped(schedule: str, d: int, m: int, first_step: int = 0, num_steps: int = 3,
                  chunks: int | None = None, post_validation: bool = False) -> None:
    """:func:`check_grouped_actions` on the generated programs of every stage (with post-validation: the
    speculative programs, and the same without VALIDATE, where every update waits for the global norm)."""
    validate_pipeline(schedule, d, m, chunks, post_validation)
    place = get_schedule(schedule, chunks, post_validation).placement(d)
    stages = [stage_actions(schedule, d, r, m, first_step, num_steps, chunks, post_validation) for r in range(d)]
    check_grouped_actions(stages, placement=place)
    check_in_order(stages, place)
    if post_validation:
        check_grouped_actions([[a for a in p if a.op is not Op.VALIDATE] for p in stages], placement=place)
        check_in_order(with_rerun(stages), place)
