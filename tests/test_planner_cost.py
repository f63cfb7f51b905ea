"""The cost model, term by term, on a toy cluster whose numbers can be checked by hand.

Toy cluster: 4 GPUs per server, NVLink all-reduce 100 B/s and p2p 50 B/s, NIC 10 B/s, HBM 1000 B/s.
"""

import pytest

from megatron_2bw.planner.cost_model import (
    boundary_bandwidth,
    bubble_slots,
    data_parallel_allreduce_time,
    optimizer_traffic_bytes,
    p2p_time,
    predict,
    ring_allreduce_time,
    stage_time,
    tensor_bandwidth,
    tied_embedding_sync_time,
)
from megatron_2bw.planner.efficiency import EfficiencyCurve
from megatron_2bw.planner.hardware import Cluster
from megatron_2bw.planner.layer_costs import BlockCost, MicrobatchCosts
from megatron_2bw.planner.memory_model import Candidate, ParamBytes

TOY = Cluster(
    name="toy", device="toy", device_memory_bytes=10**9, reserved_memory_bytes=0, peak_flops={"fp16": 1e12},
    memory_bandwidth=1000.0, devices_per_server=4, intra_server_allreduce_bandwidth=100.0,
    intra_server_p2p_bandwidth=50.0, inter_server_bandwidth=10.0, efficiency=EfficiencyCurve(0.5, 1.0),
)
L = 4
COSTS = MicrobatchCosts(
    layer=BlockCost(1.0, 2.0, params=100, stash_bytes=10, input_bytes=100, output_bytes=100),
    embedding=BlockCost(0.0, 0.0, params=0, stash_bytes=0, input_bytes=0, output_bytes=100),
    head=BlockCost(0.5, 1.0, params=0, stash_bytes=0, input_bytes=100, output_bytes=0),
)


def test_ring_allreduce():
    assert ring_allreduce_time(100, 4, 10) == pytest.approx(2 * 3 / 4 * 100 / 10)
    assert ring_allreduce_time(100, 1, 10) == 0.0


def test_p2p_is_twice_activation_in_and_out():
    assert p2p_time(100, 100, 50, 10) == pytest.approx(2 * 100 / 50 + 2 * 100 / 10)
    assert p2p_time(0, 100, 1, 10) == pytest.approx(20)


def test_boundaries_inside_and_between_servers():
    # t*w = 2: two stages per server; boundary 0 stays inside, boundary 1 crosses with 2 GPUs on the NIC.
    assert boundary_bandwidth(1, 2, 0, TOY) == 50.0
    assert boundary_bandwidth(1, 2, 1, TOY) == pytest.approx(10 / 2)
    # t*w >= G: every boundary crosses and the whole server shares the NIC.
    assert boundary_bandwidth(2, 2, 0, TOY) == pytest.approx(10 / 4)


def test_data_parallel_allreduce_inside_vs_across_servers():
    # t*w = 4 <= 4 GPUs per server: a ring on NVLink.
    assert data_parallel_allreduce_time(100, 1, 4, TOY) == pytest.approx(2 * 3 / 4 * 100 / 100)
    # t = 1, w = 8: 4 replicas per server, 2 servers; NVLink ring, then the NIC carries one group.
    assert data_parallel_allreduce_time(100, 1, 8, TOY) == pytest.approx(2 * 3 / 4 * 100 / 100 + 2 * 1 / 2 * 100 / 10)
    # t = 2, w = 4: 2 replicas per server, 2 servers, 2 groups (one per tensor rank) share the NIC.
    assert data_parallel_allreduce_time(100, 2, 4, TOY) == pytest.approx(2 * 1 / 2 * 100 / 100
                                                                         + 2 * (2 * 1 / 2 * 100 / 10))
    assert data_parallel_allreduce_time(100, 2, 1, TOY) == 0.0


def test_tensor_and_tied_embedding_links():
    assert tensor_bandwidth(4, TOY) == 100.0
    assert tensor_bandwidth(8, TOY) == 10.0  # a group wider than a server crosses the NIC
    assert tied_embedding_sync_time(100, 1, 1, 2, TOY) == pytest.approx(100 / 100)  # both ends in one server
    assert tied_embedding_sync_time(100, 1, 2, 4, TOY) == pytest.approx(100 / (10 / 2))
    assert tied_embedding_sync_time(100, 1, 2, 1, TOY) == 0.0


def test_bubble_slots():
    assert bubble_slots("flush", 8) == bubble_slots("gpipe", 8) == 7
    assert bubble_slots("2bw", 8) == 0


def test_recompute_is_forward_twice():
    plain = stage_time(COSTS, Candidate(1, 2, 1, 1, 4, False, "flush"), L, 0, TOY, float("inf"), 50.0)
    again = stage_time(COSTS, Candidate(1, 2, 1, 1, 4, True, "flush"), L, 0, TOY, float("inf"), 50.0)
    assert plain.compute_s == pytest.approx(2 * (1 + 2))
    assert again.compute_s / plain.compute_s == pytest.approx(4 / 3)
    last = stage_time(COSTS, Candidate(1, 2, 1, 1, 4, True, "flush"), L, 1, TOY, 50.0, float("inf"))
    assert last.compute_s == pytest.approx(2 * (2 * 1 + 2) + 2.0)  # the head is recomputed too (whole stage)


def test_stage_terms_and_batch_time_by_schedule():
    opt = 200 * optimizer_traffic_bytes(ParamBytes()) / 1000  # 200 params per stage over HBM
    assert optimizer_traffic_bytes(ParamBytes()) == 32
    # d = 2, w = 1, m = 4: stage 0 = 2 layers + p2p out (NVLink); stage 1 = 2 layers + head + p2p in.
    flush = predict(COSTS, Candidate(1, 2, 1, 1, 4, False, "flush"), L, TOY)
    s0, s1 = flush.stages
    assert (s0.compute_s, s0.p2p_s, s0.allreduce_s) == pytest.approx((6.0, 4.0, 0.0))
    assert (s1.compute_s, s1.p2p_s) == pytest.approx((7.5, 4.0))
    assert s1.optimizer_s == pytest.approx(opt)
    assert flush.microbatch_s == pytest.approx(11.5)
    assert flush.bubble_s == pytest.approx(1 * 11.5)
    assert flush.batch_s == pytest.approx((4 + 2 - 1) * 11.5 + opt)
    twobw = predict(COSTS, Candidate(1, 2, 1, 1, 4, False, "2bw"), L, TOY)
    assert twobw.bubble_s == 0 and twobw.batch_s == pytest.approx(4 * 11.5 + opt)
    seq = predict(COSTS, Candidate(1, 2, 1, 1, 4, False, "sequential"), L, TOY)
    assert seq.batch_s == pytest.approx(4 * (6 + 7.5 + 2 * 100 / 50) + opt)  # each boundary crossed once
    assert twobw.samples_per_sec == pytest.approx(4 / twobw.batch_s)
    assert twobw.samples_per_sec > flush.samples_per_sec > seq.samples_per_sec


def test_allreduce_overlaps_2bw_but_not_flush():
    # w = 8, t = 1, d = 2 on 4-GPU servers: large cross-server all-reduce.
    cand = dict(tensor_parallel=1, pipeline_parallel=2, data_parallel=8, micro_batch_size=1, num_micro_batches=2,
                recompute=False)
    flush = predict(COSTS, Candidate(**cand, schedule="flush"), L, TOY)
    twobw = predict(COSTS, Candidate(**cand, schedule="2bw"), L, TOY)
    ar = max(s.allreduce_s for s in flush.stages)
    assert ar > 0
    assert flush.batch_s == pytest.approx(flush.pipeline_s + ar + flush.optimizer_s)
    assert twobw.batch_s == pytest.approx(max(2 * twobw.microbatch_s, ar) + twobw.optimizer_s)


def test_recompute_policies_add_the_forward_they_rerun():
    """Stage 0 of d=2 holds the (free) embedding and 2 layers of forward 1 s, backward 2 s, an
    attention core of 0.25 s inside the forward."""
    from dataclasses import replace

    from megatron_2bw.schedule.recompute_policy import RecomputePolicy
    costs = replace(COSTS, layer=replace(COSTS.layer, core_forward_s=0.25, tp_allreduce_forward_bytes=7))

    def compute(policy):
        cand = Candidate(1, 2, 1, 1, 2, False, "2bw", recompute_policy=policy)
        return stage_time(costs, cand, L, 0, TOY, float("inf"), 50.0).compute_s

    assert compute(None) == pytest.approx(2 * (1 + 2))
    assert compute(RecomputePolicy("selective")) == pytest.approx(6 + 2 * 0.25)
    assert compute(RecomputePolicy("full", "uniform", 2)) == pytest.approx(6 + 2 * 1)
    assert compute(RecomputePolicy("full", "block", 1)) == pytest.approx(6 + 1)
