"""Grouped transfers (the NCCL-safe mode): the rendezvous proof for every schedule, the proof's
power to find the deadlocks of ungrouped or prefetched transfers, and real gloo runs of the
grouped executor against the single-process reference.

In grouped mode every send is waited for before the next action, and a gloo send completes only
once the peer posted its receive, so these runs follow the rendezvous model the proof uses:
an ordering that could deadlock on NCCL hangs here too (and the worker timeout fails the test).
"""

import pytest
from multiproc import run_workers
from pipeline_harness import train_tiny
from test_pipeline_layouts import SCHEDULES, compare

from megatron_2bw.schedule.actions import Op, format_actions, parse_actions
from megatron_2bw.schedule.checker import ScheduleError
from megatron_2bw.schedule.grouping import COMM_OPS, check_grouped, check_grouped_actions, comm_groups
from megatron_2bw.schedule.schedules import stage_actions

KW = dict(steps=4, lr=1e-3)


def test_comm_groups_cut_runs_by_peer():
    acts = parse_actions("RA0 F0v0 SA0 RA1 F1v0 SA1 RG0 B0v0 SG0 RA2 F2v0", m=4)
    # SA0 (next) and RA1 (previous) are adjacent but go to different peers: two groups
    assert comm_groups(acts) == {0: 1, 2: 3, 3: 4, 5: 7, 8: 10}


@pytest.mark.parametrize("schedule", (*SCHEDULES, "zb-h1", "zb-h2"))
def test_grouped_transfers_never_deadlock(schedule):
    for d in range(1, 9):
        for m in range(1, 17):
            if schedule == "2bw" and m < d:
                continue
            for first in (0, 5):
                check_grouped(schedule, d, m, first, 3)


def _singletons(acts):
    return {i: i + 1 for i, a in enumerate(acts) if a.op in COMM_OPS}


def _prefetched(acts):
    """The gloo executor's order: each receive posted one action before its slot."""
    acts = list(acts)
    for i in range(1, len(acts)):
        if acts[i].op in (Op.RECV_ACT, Op.RECV_GRAD) and acts[i - 1].op not in (Op.RECV_ACT, Op.RECV_GRAD):
            acts[i - 1], acts[i] = acts[i], acts[i - 1]
    return acts


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_proof_finds_the_deadlocks_of_ungrouped_transfers(schedule):
    stages = [stage_actions(schedule, 2, r, 4, 0, 2) for r in range(2)]
    with pytest.raises(ScheduleError, match="deadlock"):  # 1F1B: SEND_GRAD RECV_ACT vs SEND_ACT RECV_GRAD
        check_grouped_actions(stages, _singletons)
    pre = [_prefetched(a) for a in stages]
    assert format_actions(pre[1]) != format_actions(stages[1])
    with pytest.raises(ScheduleError, match="deadlock"):
        check_grouped_actions(pre, _singletons)
    check_grouped_actions(stages)  # the grouping the executor uses


def _grouped(layout):
    return {s: train_tiny(s, layout=layout, p2p_mode="grouped", **KW) for s in SCHEDULES}


@pytest.mark.parametrize("layout", [(1, 4, 1), (1, 2, 2)], ids=["d4", "d2w2"])
def test_grouped_executor_matches_single_process(layout):
    ref = {s: train_tiny(s, **KW) for s in SCHEDULES}
    t, d, w = layout
    outs = run_workers(_grouped, t * d * w, layout, timeout=240)
    for s in SCHEDULES:
        dloss, dparam = compare([o[s] for o in outs], ref[s])
        assert dloss < 2e-5, (s, dloss)
        assert dparam < 1e-4, (s, dparam)
