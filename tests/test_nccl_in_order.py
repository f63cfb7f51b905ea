"""gpu-review-2 N12: NCCL matches a pair's transfers in issue order (tags ignored), so the checker proves that
every link's sends come in the order its receiver posts the receives, for every schedule, with
post-validation's re-run after a failed validation, and refuses a program that breaks it."""

from __future__ import annotations

import pytest

from megatron_2bw.schedule import schedules
from megatron_2bw.schedule.actions import Op
from megatron_2bw.schedule.grouping import check_grouped, check_in_order, with_rerun
from megatron_2bw.schedule.replay import ScheduleError
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, stage_actions

PV = ("zb-h1", "zb-h2", "zb-v")


def _programs(schedule: str, d: int, m: int, pv: bool, first_step: int = 0, steps: int = 3):
    return [stage_actions(schedule, d, r, m, first_step, steps, None, pv) for r in range(d)]


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_every_schedule_sends_in_the_order_its_peers_receive(schedule: str) -> None:
    spec = schedules.get_schedule(schedule)
    for d in (2, 3, 4):
        least = max(d, 2, spec.min_microbatches(d))
        for m in sorted({least, 2 * d, 2 * d + 1 if schedule != "interleaved-1f1b" else 3 * d}):
            for pv in (False, True) if schedule in PV else (False,):
                place = schedules.get_schedule(schedule, None, pv).placement(d)
                progs = _programs(schedule, d, m, pv)
                check_in_order(progs, place)
                check_in_order(_programs(schedule, d, m, pv, first_step=2, steps=1), place)  # a cut segment
                if pv:
                    check_in_order(with_rerun(progs), place)


def test_rerun_repeats_the_warm_up_after_each_validate() -> None:
    prog = _programs("zb-h2", 2, 4, True)[1]
    again = with_rerun([prog])[0]
    k = next(i for i, a in enumerate(prog) if a.op is Op.VALIDATE)
    start = max(i for i in range(k) if prog[i].op is Op.APPLY_UPDATE and prog[i].step == prog[k].step) + 1
    assert start < k and again[:k + 1] == prog[:k + 1] and again[k + 1:k + 1 + (k - start)] == prog[start:k]


def test_a_swapped_pair_of_sends_on_a_shared_link_is_refused() -> None:
    """zb-v at d = 2: rank 1 sends rank 0 both gradients and (its second chunk's) activations; swapping two
    sends on that link keeps every count right and is caught only by the in-order rule."""
    place = schedules.get_schedule("zb-v").placement(2)
    progs = _programs("zb-v", 2, 4, False)
    check_in_order(progs, place)
    prog = progs[1]
    sends = [i for i, a in enumerate(prog) if a.op in (Op.SEND_ACT, Op.SEND_GRAD) and place.peer(1, a) == 0]
    kinds = {prog[i].op for i in sends}
    assert kinds == {Op.SEND_ACT, Op.SEND_GRAD}  # both kinds on the one link
    i, j = sends[0], next(k for k in sends if prog[k].op is not prog[sends[0]].op)
    prog[i], prog[j] = prog[j], prog[i]
    with pytest.raises(ScheduleError, match="another order"):
        check_in_order(progs, place)


def test_check_grouped_runs_the_in_order_rule() -> None:
    check_grouped("zb-v", 2, 4, post_validation=True)
    check_grouped("interleaved-1f1b", 2, 4)
