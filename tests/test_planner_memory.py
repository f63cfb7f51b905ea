"""The memory model, term by term, against hand-computed numbers.

Synthetic blocks with round numbers make every term checkable by hand: 8 layers of 100 params,
stash 10 bytes and input 1 byte each; an embedding of 1000 params (2 bytes of token ids, 3 of
stash); a head of 500 params, 400 of them the tied word embedding, with a 50-byte stash and a
70-byte workspace.
"""

import pytest

from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import BlockCost, MicrobatchCosts, analytic_microbatch_costs
from megatron_2bw.planner.memory_model import (
    Candidate,
    ParamBytes,
    activation_bytes,
    in_flight,
    plan_memory,
    stage_memory,
    stage_params,
    weight_versions,
)
from megatron_2bw.planner.report import paper_model

L = 8
COSTS = MicrobatchCosts(
    layer=BlockCost(1.0, 2.0, params=100, stash_bytes=10, input_bytes=1, output_bytes=1, workspace_bytes=10),
    embedding=BlockCost(0.0, 0.0, params=1000, stash_bytes=3, input_bytes=2, output_bytes=1),
    head=BlockCost(1.0, 2.0, params=500, stash_bytes=50, input_bytes=1, output_bytes=0, workspace_bytes=70),
    tied_params=400,
)


def cand(schedule="2bw", d=4, m=8, recompute=True, w=1):
    return Candidate(1, d, w, 1, m, recompute, schedule)


def test_weight_versions():
    assert weight_versions("2bw") == 2
    assert weight_versions("flush") == weight_versions("gpipe") == 1
    two = stage_memory(COSTS, cand("2bw"), L, 1)
    one = stage_memory(COSTS, cand("flush"), L, 1)
    # Stage 1 of d = 4: two layers, 200 params, 2 bytes each per fp16 version: 2|W|/d vs |W|/d.
    assert two.weights == two.second_weights == 400
    assert one.weights == 400 and one.second_weights == 0


def test_gradients_and_optimizer_state():
    s = stage_memory(COSTS, cand("flush"), L, 1)
    assert s.grads == 200 * 2                    # fp16 gradient
    assert s.optimizer == 200 * (4 + 8)          # fp32 master + Adam moments
    assert ParamBytes().per_param == 16
    assert ParamBytes.for_precision("fp32").per_param == 16
    two = stage_memory(COSTS, cand("2bw"), L, 1)
    # + 2BW's second version and its second gradient buffer (ScheduleSpec.grad_buffers = 2)
    assert (two.weights + two.second_weights + two.grads + two.optimizer) == 200 * 20


def test_embedding_on_first_stage_head_on_last():
    assert stage_params(COSTS, L, 4, 0) == 2 * 100 + 1000
    assert stage_params(COSTS, L, 4, 1) == 2 * 100
    assert stage_params(COSTS, L, 4, 3) == 2 * 100 + 500          # with its copy of the tied embedding
    assert stage_params(COSTS, L, 1, 0) == 8 * 100 + 1000 + 500 - 400  # one stage: one embedding


def test_in_flight_counts():
    assert [in_flight("2bw", 4, 8, i) for i in range(4)] == [4, 3, 2, 1]   # 1F1B: d - stage
    assert [in_flight("flush", 4, 2, i) for i in range(4)] == [2, 2, 2, 1]  # at most m
    assert in_flight("gpipe", 4, 8, 3) == 8                                  # all m
    assert in_flight("sequential", 4, 8, 0) == 1


def test_2bw_activations_follow_the_paper():
    # Recomputation (our engine re-runs the whole stage): d*A_input on stage 0 (its input is the
    # token ids) plus one microbatch's full stash (layers A_total/d and the embedding's own) while recomputing.
    assert activation_bytes(COSTS, cand("2bw", recompute=True), L, 0) == 4 * 2 + 20 + (2 + 3)
    assert activation_bytes(COSTS, cand("2bw", recompute=True), L, 1) == 20 + 3 * 1
    # No recomputation: d * A_total/d (each layer's stash includes its input).
    assert activation_bytes(COSTS, cand("2bw", recompute=False), L, 0) == 4 * (20 + 2 + 3)
    assert activation_bytes(COSTS, cand("2bw", recompute=False), L, 1) == 3 * 20


def test_gpipe_and_flush_activations():
    # GPipe: A_total/d + m*A_input.
    assert activation_bytes(COSTS, cand("gpipe", m=8, recompute=True), L, 1) == 20 + 8 * 1
    assert activation_bytes(COSTS, cand("gpipe", m=8, recompute=False), L, 1) == 8 * 20
    # Flush: as 2BW (at most d in flight), one weight version.
    assert activation_bytes(COSTS, cand("flush"), L, 1) == activation_bytes(COSTS, cand("2bw"), L, 1)


def test_last_stage_head_and_logits():
    last = stage_memory(COSTS, cand("2bw", recompute=True), L, 3)
    assert last.activations == 1 * 1 + 20 + 50   # one input in flight + one microbatch recomputed (head included)
    assert last.workspace == 70                    # logits while the cross-entropy runs
    gpipe_last = stage_memory(COSTS, cand("gpipe", m=8, recompute=True), L, 3)
    assert gpipe_last.activations == 8 * 1 + 20 + 50  # GPipe keeps every microbatch's input; one softmax at a time


def test_total_and_representative_stages():
    mem = plan_memory(COSTS, cand("2bw", d=4), L)
    assert [s.stage for s in mem] == [0, 1, 3]
    s = mem[1]
    assert s.total == 400 + 400 + 2 * 400 + 2400 + 23 + 10  # two gradient buffers
    assert len(plan_memory(COSTS, cand("flush", d=1, m=8), L)) == 1


def test_2bw_refuses_fewer_microbatches_than_stages():
    with pytest.raises(ConfigError, match="m=2 < d=4"):
        Candidate(1, 4, 1, 1, 2, False, "2bw")
    Candidate(1, 4, 1, 1, 2, False, "flush")  # fine for the flushing schedules


def test_paper_formula_on_the_real_2p2b_model():
    """2BW with recomputation, a middle stage of GPT-2.2B at d = 8: 2|W|/d + A_total/d + d*A_input
    (+ gradients and optimizer state), with the layer numbers written out by hand."""
    m = paper_model("gpt-2.2b")
    c = analytic_microbatch_costs(m, load_cluster("aws-p3.16xlarge"), "fp16", 1, 4)
    s, h, a, b = 512, 2304, 32, 4
    layer_p = 12 * h * h + 13 * h
    a_layer = s * b * h * 34 + 5 * a * s * s * b
    a_in = s * b * h * 2
    mem = stage_memory(c, Candidate(1, 8, 8, b, 16, True, "2bw"), m.num_layers, 1)
    assert mem.weights + mem.second_weights == 2 * 4 * layer_p * 2
    assert mem.grads + mem.optimizer == 4 * layer_p * (2 * 2 + 12)  # two fp16 gradient buffers
    assert mem.activations == 4 * a_layer + 7 * a_in


def test_recompute_policies_inside_stages():
    """Two layers on a middle stage of 2BW (d=4, m=8, 3 microbatches in flight on stage 1); a
    layer keeps 10 bytes, 4 of them its attention core, and its input is 1 byte."""
    from dataclasses import replace

    from megatron_2bw.schedule.recompute_policy import RecomputePolicy
    costs = replace(COSTS, layer=replace(COSTS.layer, core_stash_bytes=4, core_forward_s=0.25))
    n = in_flight("2bw", 4, 8, 1)
    assert n == 3

    def act(policy):
        return activation_bytes(costs, Candidate(1, 4, 1, 1, 8, False, "2bw", recompute_policy=policy), L, 1)

    assert act(None) == n * 2 * 10
    assert act(RecomputePolicy("selective")) == n * 2 * (10 - 4) + 4  # plus one core rebuilt in backward
    assert act(RecomputePolicy("full", "uniform", 1)) == n * 2 * 1 + 10  # inputs, plus one layer rebuilt
    assert act(RecomputePolicy("full", "uniform", 2)) == n * 1 + 20  # one chunk input, one chunk rebuilt
    assert act(RecomputePolicy("full", "block", 1)) == n * (1 + 10) + 10
    with pytest.raises(ConfigError, match="either --recompute-activations"):
        Candidate(1, 4, 1, 1, 8, True, "2bw", recompute_policy=RecomputePolicy("selective"))


def test_selective_leaves_korthikanti_34sbh_on_the_real_2p2b_model():
    """Selective recomputation frees the 5as/h term: 34 sbh per layer remains (fp16, dropout, t=1)."""
    m = paper_model("gpt-2.2b")
    c = analytic_microbatch_costs(m, load_cluster("aws-p3.16xlarge"), "fp16", 1, 4)
    s, h, a, b = 512, 2304, 32, 4
    assert c.layer.core_stash_bytes == 5 * a * s * s * b
    assert c.layer.stash_bytes - c.layer.core_stash_bytes == s * b * h * 34


def test_ef_state_is_counted_for_2bw_only_and_sharded():
    """ef keeps one fp32 gradient per parameter (pipeline/compensation.py): +4 bytes on 2BW stages only,
    sharded over w with the distributed optimizer like the optimizer state."""
    ef = ParamBytes.for_precision("bf16", compensation="ef")
    plain = ParamBytes.for_precision("bf16")
    two, two_ef = (stage_memory(COSTS, cand("2bw"), L, 1, pb) for pb in (plain, ef))
    assert two_ef.optimizer_state - two.optimizer_state == 200 * 4
    flush, flush_ef = (stage_memory(COSTS, cand("flush"), L, 1, pb) for pb in (plain, ef))
    assert flush_ef.total == flush.total
    zero = Candidate(1, 4, 2, 1, 8, True, "2bw", distributed_optimizer=True)
    assert (stage_memory(COSTS, zero, L, 1, ef).optimizer_state - stage_memory(COSTS, zero, L, 1, plain).optimizer_state
            == 100 * 4)


def test_muon_state_is_one_momentum_per_matrix_element():
    """--optimizer muon keeps one fp32 momentum per transformer-layer weight instead of Adam's two moments:
    4 bytes less per layer parameter (the embedding and head stay on AdamW), sharded like the state."""
    adam, muon = ParamBytes.for_precision("bf16"), ParamBytes.for_precision("bf16", optimizer="muon")
    assert (muon.muon_saving, adam.muon_saving) == (4, 0) and muon.optimizer_state == adam.optimizer_state
    middle = (stage_memory(COSTS, cand("2bw"), L, 1, pb) for pb in (adam, muon))
    a, m = middle
    layers = a.params  # a middle stage holds transformer layers only
    assert a.optimizer_state - m.optimizer_state == 4 * layers
    first = [stage_memory(COSTS, cand("2bw"), L, 0, pb) for pb in (adam, muon)]
    assert first[0].optimizer_state - first[1].optimizer_state == 4 * (first[0].params - COSTS.embedding.params)
    zero = Candidate(1, 4, 2, 1, 8, True, "2bw", distributed_optimizer=True)
    za, zm = (stage_memory(COSTS, zero, L, 1, pb) for pb in (adam, muon))
    assert za.optimizer_state - zm.optimizer_state == 4 * layers // 2
