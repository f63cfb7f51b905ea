"""The forward-only evaluation program: every microbatch through every virtual stage exactly once, in
chunk order on each rank, with transfers that gloo's matching, NCCL's grouped rendezvous and NCCL's
in-order matching all accept (proved by the checker's replay for every placement)."""

import pytest

from megatron_2bw.schedule.actions import Op
from megatron_2bw.schedule.evaluation import evaluation_program
from megatron_2bw.schedule.grouping import check_grouped_actions, check_in_order
from megatron_2bw.schedule.replay import Replay
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, get_schedule


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("d", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_every_microbatch_through_every_stage_once(schedule, d, n):
    place = get_schedule(schedule).placement(d)
    programs = [evaluation_program(place, r, n) for r in range(d)]
    forwards = sorted((place.stage(r, a.chunk), a.mb) for r, p in enumerate(programs) for a in p if a.op is Op.FORWARD)
    assert forwards == sorted((s, i) for s in range(place.num_stages) for i in range(n))
    for r, prog in enumerate(programs):  # each rank runs a microbatch's chunks before the next microbatch's
        mine = [(a.mb, place.stage(r, a.chunk)) for a in prog if a.op is Op.FORWARD]
        assert mine == sorted(mine)
    assert all(a.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT) for p in programs for a in p)
    Replay(programs, placement=place).run()  # gloo: tagged point-to-point
    check_grouped_actions(programs, placement=place)  # NCCL: grouped units
    check_in_order(programs, place)  # NCCL: in-order matching per pair of ranks


def test_a_receive_precedes_its_forward():
    place = get_schedule("interleaved-1f1b", 2).placement(2)
    prog = evaluation_program(place, 0, 2)
    seen = set()
    for a in prog:
        if a.op is Op.RECV_ACT:
            seen.add((a.chunk, a.mb))
        if a.op is Op.FORWARD and not place.is_first(0, a.chunk):
            assert (a.chunk, a.mb) in seen
