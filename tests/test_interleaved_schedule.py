"""interleaved-1f1b as data: torch's ScheduleInterleaved1F1B compute order, deadlock freedom under gloo's
queues and NCCL's rendezvous for the (d, m, v) sweep, the in-flight bound, the ideal bubble replayed by the
checker and by the timed simulator, and the placement's chunk peers."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.simulator import StageCosts, simulate
from megatron_2bw.schedule.actions import Action, Op, format_actions
from megatron_2bw.schedule.checker import check_schedule
from megatron_2bw.schedule.grouping import check_grouped
from megatron_2bw.schedule.placement import Placement
from megatron_2bw.schedule.schedules import get_schedule, stage_actions, validate_pipeline

NAME = "interleaved-1f1b"
NUM_STEPS = 2


def _torch_order(d: int, r: int, v: int, m: int) -> list[tuple[bool, int, int]]:
    """(forward?, virtual stage, microbatch) of torch's ScheduleInterleaved1F1B on rank r (no process group:
    the order is computed from the rank, the depth, the local stage count and m alone)."""
    s = object.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s.rank, s._n_microbatches = d, v, r, m
    s.number_of_rounds = max(1, m // d)
    s.microbatches_per_round = m // s.number_of_rounds
    return [(a.computation_type == _ComputationType.FORWARD, a.stage_index, a.microbatch_index)
            for a in s._calculate_single_rank_operations(r) if a is not None]


@pytest.mark.parametrize("v", [2, 3, 4])
def test_compute_order_is_torchs(v):
    for d in (2, 3, 4, 8):
        for m in (d, 2 * d, 3 * d):
            spec = get_schedule(NAME, v)
            place = spec.placement(d)
            for r in range(d):
                prog = stage_actions(NAME, d, r, m, 0, 1, v)
                ours = [(a.op is Op.FORWARD, place.stage(r, a.chunk), a.mb) for a in prog
                        if a.op in (Op.FORWARD, Op.BACKWARD)]
                assert ours == _torch_order(d, r, v, m), (d, m, r)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_every_small_layout_is_correct_under_gloo_and_nccl_matching(v):
    spec = get_schedule(NAME, v)
    for d in range(2, 9):
        for m in range(d, 4 * d + 1, d):
            report = check_schedule(NAME, d, m, 0, NUM_STEPS, chunks=v)
            check_grouped(NAME, d, m, 0, NUM_STEPS, chunks=v)
            assert report.max_inflight == tuple(spec.inflight(d, r, m) for r in range(d)), (d, m)
            # unit compute: a fill and a drain of d-1 chunk slots each, every step
            assert report.time_slots == NUM_STEPS * (2 * v * m + 2 * (d - 1)), (d, m)
            assert report.bubble == pytest.approx(spec.bubble(d, m))


def test_rank0_holds_d_plus_a_fraction_of_microbatches():
    spec = get_schedule(NAME, 2)
    # in chunk stashes: (v-1)*d + 2*(d-1-r) warm-up forwards plus one, capped at v*m
    assert [spec.inflight(4, r, 16) for r in range(4)] == [11, 9, 7, 5]
    assert [spec.inflight(4, r, 4) for r in range(4)] == [8, 8, 7, 5]
    assert spec.inflight(4, 0, 16) / spec.chunks == 4 + 3 / 2  # d + (d-1)/v whole-rank microbatches


@pytest.mark.parametrize(("d", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 16, 4), (3, 6, 3)])
def test_simulated_step_is_the_ideal_interleaved_step(d, m, v):
    f, b = 1.0, 2.0  # a backward costs two forwards: the rounds keep every rank's slots equal anyway
    sim = simulate(NAME, d, m, [StageCosts(f, b, stash_bytes=600) for _ in range(d)], num_steps=4, chunks=v)
    spec = get_schedule(NAME, v)
    assert sim.step_time_s == pytest.approx(m * (f + b) + spec.bubble_time(d, m, f, b, 0.0))
    assert spec.bubble_time(d, m, f, b, 0.0) == pytest.approx((d - 1) * (f + b) / v)
    assert sim.bubble_fraction == pytest.approx(spec.bubble(d, m))
    # the simulator's stash is one chunk's: a rank's stash bytes / v per in-flight chunk microbatch
    assert sim.peak_activation_bytes[0] == spec.inflight(d, 0, m) * 600 // v
    flush = simulate("flush", d, m, [StageCosts(f, b) for _ in range(d)], num_steps=4)
    assert sim.step_time_s < flush.step_time_s


def test_chunk_peers_wrap_from_the_last_rank_to_the_first():
    d = 4
    prog0 = stage_actions(NAME, d, 0, 4, 0, 1, 2)
    prog3 = stage_actions(NAME, d, 3, 4, 0, 1, 2)
    place = get_schedule(NAME, 2).placement(d)
    # rank 0 receives chunk 1's activations from rank 3 (virtual stage 3 -> 4) and sends its gradients back
    assert {place.peer(0, a) for a in prog0 if a.op is Op.RECV_ACT} == {3}
    assert {place.peer(0, a) for a in prog0 if a.op is Op.SEND_GRAD} == {3}
    assert {place.peer(3, a) for a in prog3 if a.op is Op.SEND_ACT} == {0}
    assert all(a.chunk == 0 for a in prog3 if a.op is Op.SEND_ACT)  # the last chunk holds the loss
    assert all(a.chunk == 1 for a in prog0 if a.op is Op.RECV_ACT)  # chunk 0 holds the embedding
    assert place.message(3, Action(Op.SEND_ACT, 5, 1, chunk=0)) == place.message(0, Action(Op.RECV_ACT, 5, 1, chunk=1))
    assert "F0c1v0" in format_actions(prog0)


def test_v_placement_is_data():
    v = Placement(4, 2, "v")
    assert [v.stage(r, 0) for r in range(4)] == [0, 1, 2, 3]
    assert [v.stage(r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert [v.rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.peer(3, Action(Op.SEND_ACT, 0, 0, chunk=0)) == 3  # rank d-1 hands over to itself
    assert v.is_last(0, 1) and v.is_first(0, 0)
    i = Placement(4, 2)
    assert [i.rank(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert i.is_last(3, 1) and not i.is_last(3, 0)


def test_refusals_are_one_line():
    cases = [
        (lambda: validate_pipeline(NAME, 4, 6), r"multiple of the pipeline depth .*: m=6, d=4"),
        (lambda: validate_pipeline(NAME, 4, 2), r"m=2 < d=4"),
        (lambda: validate_pipeline(NAME, 1, 4), r"needs --pipeline-model-parallel-size >= 2"),
        (lambda: get_schedule("flush", 2), r"needs --pipeline-schedule interleaved-1f1b"),
        (lambda: get_schedule(NAME, 0), r"must be >= 1"),
    ]
    for call, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)


# ---------------------------------------------------------------- zb-v: two chunks in a V, split backward


def _torch_zbv_order(d: int, r: int, m: int) -> list[tuple[str, int, int]]:
    """(F/I/W, virtual stage, microbatch) of torch's ScheduleZBVZeroBubble on rank r."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    s = object.__new__(ScheduleZBVZeroBubble)
    s.pp_group_size, s.num_stages, s.rank, s._n_microbatches = d, 2 * d, r, m
    short = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}
    return [(short[a.computation_type], a.stage_index, a.microbatch_index)
            for a in s._calculate_single_rank_operations(r) if a is not None]


def test_zbv_compute_order_is_torchs():
    label = {Op.FORWARD: "F", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}
    for d in (2, 3, 4, 6):
        for m in (2 * d - 1, 2 * d, 3 * d):
            place = get_schedule("zb-v").placement(d)
            for r in range(d):
                prog = stage_actions("zb-v", d, r, m, 0, 1)
                ours = [(label[a.op], place.stage(r, a.chunk), a.mb) for a in prog if a.op in label]
                assert ours == _torch_zbv_order(d, r, m), (d, m, r)


def test_zbv_every_small_layout_is_correct_under_gloo_and_nccl_matching():
    spec = get_schedule("zb-v")
    for d in range(2, 7):
        for m in range(2 * d - 1, 3 * d + 1):
            report = check_schedule("zb-v", d, m, 0, NUM_STEPS)
            check_grouped("zb-v", d, m, 0, NUM_STEPS)
            # every rank holds 2d chunk stashes at most: d whole-rank microbatches, 1F1B's peak on its first stage
            assert report.max_inflight == (2 * d,) * d == tuple(spec.inflight(d, r, m) for r in range(d)), (d, m)
            assert [spec.deferred_weight_grads(d, r, m) for r in range(d)] == [2 * r + 1 for r in range(d)]
    progs = [stage_actions("zb-v", 4, r, 7, 0, 1) for r in range(4)]
    # rank d-1 turns the V by itself: no transfer between its chunks; rank 0 sends and receives nothing of chunk 1's end
    assert not any(a.op in (Op.SEND_ACT,) and a.chunk == 0 for a in progs[3])
    assert not any(a.op is Op.RECV_GRAD for a in progs[0] if a.chunk == 1)
    with pytest.raises(ConfigError, match=r"^ZB-V needs at least 7 microbatches per step at d=4: m=6 < 7$"):
        validate_pipeline("zb-v", 4, 6)


def test_zbv_bubble_is_the_fill_of_half_a_rank():
    spec = get_schedule("zb-v")
    for d, m in ((2, 4), (4, 8), (4, 16)):
        # equal F, I, W: only the step's fill of d-1 chunk forwards (half a rank's forward each) stays idle
        assert spec.bubble_time(d, m, 1.0, 1.0, 1.0) == pytest.approx((d - 1) / 2)
        assert spec.bubble_time(d, m, 1.0, 1.0, 1.0) < get_schedule("zb-h1").bubble_time(d, m, 1.0, 1.0, 1.0)
        sim = simulate("zb-v", d, m, [StageCosts(1.0, 2.0) for _ in range(d)], num_steps=4)
        assert sim.step_time_s == pytest.approx(3 * m + spec.bubble_time(d, m, 1.0, 1.0, 1.0))
