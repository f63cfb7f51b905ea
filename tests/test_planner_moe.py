"""The planner's expert axis (planner/moe_costs.py): expert memory per stage and the all-to-all against hand
computations from the presets' shapes, dense plans unchanged, the direction of e and of the load, the CLI."""

import importlib.util
import json
import math
import os
from dataclasses import replace

import pytest

from megatron_2bw.config.moe_presets import get_moe_preset, parameter_counts
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.candidate import Candidate, ParamBytes
from megatron_2bw.planner.cost_model import predict, stage_time
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import LayerCosts, analytic_microbatch_costs, linear_forward_flops
from megatron_2bw.planner.memory_model import slice_memory
from megatron_2bw.planner.moe_costs import alltoall_seconds, for_experts, rank_load
from megatron_2bw.planner.moe_ranking import FAMILIES, format_moe_ranking, moe_ranking, moe_ranking_json
from megatron_2bw.planner.search import FINER_RECOMPUTE, PlanRequest, search
from megatron_2bw.schedule.stages import StageSlice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tool_plan", os.path.join(ROOT, "tools", "plan.py"))
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)

H100 = load_cluster("dgx-h100")
MIXTRAL = get_moe_preset("mixtral-8x7b")
H, F, E, K, S = 4096, 14336, 8, 2, 4096  # Mixtral 8x7B: hidden, expert FFN, experts, top-k, sequence
PB = ParamBytes.for_precision("bf16")  # bf16 weights, fp32 gradients (the bf16 default), fp32 master and Adam


def test_mixtral_expert_memory_per_stage_matches_the_hand_count():
    """A middle stage of 4 layers at e = 2, w = 8, the distributed optimizer: E/e whole SwiGLU experts per layer,
    their master and Adam state sharded over the w/e = 4 ranks of the expert-data group, the rest over w = 8."""
    expert_layer = E * 3 * H * F  # gate, up, down of every expert
    dense_layer = (32 + 2 * 8) * 128 * H + H * H + 2 * H + E * H  # QKV (GQA), projection, two RMSNorms, router
    x, d = 4 * expert_layer // 2, 4 * dense_layer
    cand = Candidate(1, 8, 8, 1, 64, False, "flush", distributed_optimizer=True, expert_parallel=2)
    costs = for_experts(analytic_microbatch_costs(MIXTRAL, H100, "bf16", 1, 1), 1, 2, H100, 1.0)
    mem = slice_memory(costs, cand, StageSlice(0, 4, False, False), 1, PB)
    shard = math.ceil(d / 8) + math.ceil(x / 4)
    assert (mem.params, mem.weights, mem.grads) == (d + x, 2 * (d + x), 4 * (d + x))
    assert (mem.master, mem.optimizer_state) == (4 * shard, 8 * shard)
    assert mem.experts == 6 * x + 12 * math.ceil(x / 4)
    # the same count as the config's own (total) parameters: the layers, the embedding and the untied output layer
    assert 32 * (dense_layer + expert_layer) + 2 * 32000 * H + H == parameter_counts(MIXTRAL)[0]


def test_compute_is_counted_from_the_active_experts():
    """The MoE layer's weight GEMMs replace the dense MLP's ``3hF`` by the router's ``Eh`` and k experts' ``3hF``."""
    b = 2
    dense = analytic_microbatch_costs(replace(MIXTRAL, moe=None), H100, "bf16", 1, b)
    moe = analytic_microbatch_costs(MIXTRAL, H100, "bf16", 1, b)
    speed = H100.peak("bf16") * H100.efficiency.layer_fraction(b, S, H, 1)
    assert dense.layer.backward_weight_s == pytest.approx(linear_forward_flops(replace(MIXTRAL, moe=None), b, 1)
                                                          / speed, rel=1e-12)
    extra = 2 * b * S * (E * H + (K - 1) * 3 * H * F) / speed
    assert moe.layer.backward_weight_s - dense.layer.backward_weight_s == pytest.approx(extra, rel=1e-9)


def test_alltoall_bytes_and_seconds_match_the_hand_count():
    """One all-to-all: tokens x top-k x hidden x 2 bytes per rank, (e-1)/e leaving it; 4 per MoE layer."""
    b = 2
    costs = analytic_microbatch_costs(MIXTRAL, H100, "bf16", 1, b)
    nbytes = b * S * K * H * 2
    assert costs.moe.alltoall_bytes == nbytes
    nvlink, nic = H100.intra_server_p2p_bandwidth, H100.inter_server_bandwidth
    assert alltoall_seconds(costs, 1, 8, H100, 1.0) == pytest.approx(nbytes * 7 / 8 / nvlink, rel=1e-12)
    assert alltoall_seconds(costs, 2, 4, H100, 1.0) == pytest.approx(nbytes * 3 / 4 / nvlink, rel=1e-12)
    qwen = analytic_microbatch_costs(get_moe_preset("qwen3-30b-a3b"), H100, "bf16", 1, b)
    leaving = b * S * 8 * 2048 * 2 * 15 / 16  # e = 16 over two servers: 8 peers on NVLink, 8 across the NIC
    want = max(leaving * 7 / 15 / nvlink, leaving * 8 / 15 / (nic / 8))
    assert alltoall_seconds(qwen, 1, 16, H100, 1.0) == pytest.approx(want, rel=1e-12)
    one = alltoall_seconds(costs, 1, 8, H100, 1.0)
    at8 = for_experts(costs, 1, 8, H100, 1.0)
    assert at8.layer.forward_s - costs.layer.forward_s == pytest.approx(2 * one, rel=1e-9)
    assert at8.layer.backward_s - costs.layer.backward_s == pytest.approx(2 * one, rel=1e-9)
    cand = Candidate(1, 8, 8, b, 32, False, "flush", expert_parallel=8)
    assert stage_time(at8, cand, 32, 1, H100, 1.0, 1.0, PB).alltoall_s == pytest.approx(4 * 4 * one, rel=1e-12)
    redo = replace(cand, recompute=True)  # the recomputed forward dispatches and combines again
    assert stage_time(at8, redo, 32, 1, H100, 1.0, 1.0, PB).alltoall_s == pytest.approx(4 * 6 * one, rel=1e-12)


# The best plans of two dense searches before the expert axis existed (commit 8800c1c's tools/plan.py --json; the
# c = 2 case re-pinned by issue 44's whole-step check of a context rank's transients, which it lowers by 0.65 GB
# here: the same plans, and b = 2 now fits first):
# (t, d, w, b, schedule, recompute, policy, dist-opt, seq-par, c, split, samples/s, bytes per GPU, batch seconds)
DENSE_BEFORE = {
    ("gpt-1.3b", "16", "dgx-a100-80gb", "fp16", "64", "1"): [
        (1, 2, 8, 4, '2bw', False, None, True, False, 1, (13, 11), 553.447, 10835373056, 0.115639),
        (1, 4, 4, 4, '2bw', False, None, True, False, 1, (7, 7, 6, 4), 526.849, 8918550528, 0.121477),
        (2, 2, 4, 8, '2bw', False, None, True, True, 1, (13, 11), 510.998, 7808578560, 0.125245),
        (1, 2, 8, 4, '2bw', False, None, False, False, 1, (13, 11), 507.703, 18802024448, 0.126058)],
    ("llama-8b", "16", "dgx-h100", "bf16", "32", "2"): [
        (1, 4, 2, 2, '2bw', False, None, True, False, 2, (7, 9, 9, 7), 17.316, 73492668416, 1.847975),
        (1, 4, 2, 1, '2bw', False, None, True, False, 2, (9, 9, 8, 6), 17.017, 64724590592, 1.880513),
        (1, 2, 4, 1, 'zb-h2+pv', False, None, True, False, 2, (17, 15), 16.711, 70548287488, 1.914856),
        (2, 2, 2, 2, '2bw', False, None, True, True, 2, (17, 15), 16.64, 57638772736, 1.923123)],
}
KEYS = ("tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch_size", "schedule", "recompute",
        "recompute_policy", "distributed_optimizer", "sequence_parallel", "context_parallel", "layer_split",
        "samples_per_sec", "memory_bytes_per_gpu", "batch_seconds")


@pytest.mark.parametrize("case", sorted(DENSE_BEFORE))
def test_dense_models_plan_exactly_as_before(case):
    preset, gpus, cluster, precision, batch, cp = case
    out = json.loads(plan.run(["--model-preset", preset, "--num-gpus", gpus, "--cluster", cluster, "--precision",
                               precision, "--global-batch-size", batch, "--context-parallel-size", cp, "--top", "4",
                               "--json"]))
    rows = [tuple(tuple(r[k]) if isinstance(r[k], list) else r[k] for k in KEYS) for r in out["ranked"]]
    assert rows == DENSE_BEFORE[case]
    assert "expert_parallel" not in out["best"] and "total_parameters" not in out["model"]


def _mixtral_search(gpus: int, batch: int, **kw):
    return search(PlanRequest(MIXTRAL, H100, gpus, batch, "bf16", schedules=("flush", "2bw"), memory_margin=0.1,
                              **kw), top=3)


def test_expert_parallelism_wins_where_experts_fill_the_memory():
    """Mixtral on 16 GPUs: at e = 1 every rank holds all 8 experts of its layers, so only the deepest pipeline with
    recomputation fits; spreading the experts (e > 1) frees memory for a shallower, faster pipeline."""
    only1, searched = _mixtral_search(16, 64, expert_parallel_options=(1,)), _mixtral_search(16, 64)
    b1, best = only1.best.candidate, searched.best.candidate
    assert b1.expert_parallel == 1 and best.expert_parallel > 1
    assert best.pipeline_parallel < b1.pipeline_parallel
    assert searched.best.samples_per_sec > only1.best.samples_per_sec
    costs = analytic_microbatch_costs(MIXTRAL, H100, "bf16", 1, 1)
    part = StageSlice(0, 4, False, False)
    experts = [slice_memory(for_experts(costs, 1, e, H100, 1.0), Candidate(1, 8, 8, 1, 64, False, "flush",
                                                                           expert_parallel=e), part, 1, PB).experts
               for e in (1, 2, 4, 8)]
    assert experts == [experts[0] // e for e in (1, 2, 4, 8)]  # replicated optimizer: all of it scales as 1/e


def test_force_balanced_is_faster_than_an_uneven_load():
    """The busiest rank sets the pace: force-balanced < the default 1.25 < 1.5 at e > 1, all equal at e = 1."""
    costs = analytic_microbatch_costs(MIXTRAL, H100, "bf16", 1, 1)
    assert rank_load(costs, 1, 1.5) == pytest.approx(1.0, rel=1e-12)
    assert rank_load(costs, 8, 1.5) == pytest.approx(1.5, rel=1e-12)
    assert rank_load(costs, 4, 1.5) == pytest.approx((1.5 + (2 - 1) * (8 - 1.5) / 7) * 4 / 8, rel=1e-12)

    def batch(e: int, load: float) -> float:
        cand = Candidate(1, 8, 8, 1, 64, False, "flush", expert_parallel=e)
        return predict(for_experts(costs, 1, e, H100, load), cand, 32, H100, PB).batch_s

    assert batch(8, 1.0) < batch(8, 1.25) < batch(8, 1.5)
    assert batch(1, 1.0) == batch(1, 1.25) == batch(1, 1.5)
    forced, uneven = _mixtral_search(64, 512, moe_force_balanced=True), _mixtral_search(64, 512, moe_expert_load=1.5)
    assert forced.best.samples_per_sec > uneven.best.samples_per_sec


def test_cli_plans_a_moe_preset(capsys):
    argv = ["--model-preset", "mixtral-8x7b", "--num-gpus", "64", "--cluster", "dgx-h100", "--precision", "bf16",
            "--global-batch-size", "512", "--schedules", "flush,2bw", "--no-finer-recompute", "--top", "3"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "experts: 8 per MoE layer (32 of 32 layers), top-2; 46.70B parameters in all, 12.88B active" in out
    assert "   e a2a s/step experts GiB 0/1/last" in out and "--num-experts 8" in out
    assert plan.main(argv + ["--moe-router-force-load-balancing", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["model"]["total_parameters"], data["model"]["active_parameters"]) == parameter_counts(MIXTRAL)
    best = data["best"]
    assert best["expert_parallel"] >= 1 and best["alltoall_seconds_per_step"] >= 0
    assert set(best["expert_bytes_by_stage"]) == set(best["memory_bytes_by_stage"])
    e = best["expert_parallel"]
    assert (f"--expert-model-parallel-size {e}" in " ".join(best["command"])) == (e > 1)
    assert plan.main(argv + ["--expert-model-parallel-size", "4", "--json"]) == 0
    assert {r["expert_parallel"] for r in json.loads(capsys.readouterr().out)["ranked"]} == {4}


@pytest.mark.parametrize("extra, words", [
    (["--expert-model-parallel-size", "3"], "--num-experts 8 is not divisible by --expert-model-parallel-size 3"),
    (["--model-preset", "qwen3-30b-a3b", "--num-gpus", "8", "--expert-model-parallel-size", "16"],
     "--expert-model-parallel-size 16 does not divide --num-gpus 8"),
    (["--moe-expert-load", "0.5"], "--moe-expert-load is the busiest expert's tokens over the mean"),
])
def test_bad_expert_input_is_one_line(capsys, extra, words):
    argv = ["--model-preset", "mixtral-8x7b", "--num-gpus", "64", "--cluster", "dgx-h100", "--precision", "bf16",
            "--global-batch-size", "512"]
    assert plan.main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err


def test_ranking_rows_hold_each_familys_best_plan():
    """One search per (preset, GPUs) with a selector per family: each family's best is its own schedule's, no
    faster plan of that family exists in the exhaustive ranking, and the ratios and the table follow from them."""
    rows = moe_ranking(H100, presets=("mixtral-8x7b",), gpus=(32,), global_batch=64)
    (row,) = rows
    assert row.best["2BW"].candidate.schedule == "2bw" and row.best["Flush"].candidate.schedule == "flush"
    assert row.best["zero-bubble"].candidate.schedule.startswith("zb-")
    full = search(PlanRequest(MIXTRAL, H100, 32, 64, "bf16", recompute_policies=FINER_RECOMPUTE,
                              memory_margin=0.1, sequence_parallel_options=(False, True)))
    for name, pick in FAMILIES.items():
        best = next(e for e in full.ranked if pick(e.candidate))
        assert row.best[name].samples_per_sec == pytest.approx(best.samples_per_sec, rel=1e-12)
    assert row.ratio("Flush") == row.best["2BW"].samples_per_sec / row.best["Flush"].samples_per_sec
    table = format_moe_ranking(rows, "force-balanced")
    assert f"| mixtral-8x7b | 32 | {row.best['2BW'].samples_per_sec:7.1f} (2bw, t" in table
    assert moe_ranking_json(rows)[0]["fastest"] == row.winner
    assert plan.main(["--moe-ranking", "--moe-expert-load", "0.5"]) == 2  # checked before any search


def test_capacity_caps_the_load_and_padding_fills_it():
    """A capacity factor cuts the busiest expert at c x the mean; padding to capacity makes every expert send,
    compute and keep exactly c x the mean (on every rank: no uneven share left)."""
    def with_moe(**kw):
        model = replace(MIXTRAL, moe=replace(MIXTRAL.moe, **kw))
        return analytic_microbatch_costs(model, H100, "bf16", 1, 1)

    plain = analytic_microbatch_costs(MIXTRAL, H100, "bf16", 1, 1)
    assert rank_load(with_moe(moe_expert_capacity_factor=1.1), 8, 1.5) == pytest.approx(1.1, rel=1e-12)
    padded = with_moe(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)
    assert padded.moe.alltoall_bytes == 1.5 * plain.moe.alltoall_bytes == 1.5 * S * K * H * 2
    assert padded.moe.expert_forward_s == pytest.approx(1.5 * plain.moe.expert_forward_s, rel=1e-12)
    assert rank_load(padded, 8, 1.5) == 1.0


def test_a_measured_profile_without_expert_terms_is_refused():
    dense = analytic_microbatch_costs(replace(MIXTRAL, moe=None), H100, "bf16", 1, 1)
    with pytest.raises(ConfigError, match="analytic estimate only"):
        search(PlanRequest(MIXTRAL, H100, 8, 8, "bf16"), LayerCosts("a profile", {(1, 1): dense}))


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_moe_stash_is_what_autograd_keeps(name):
    """The MoE block's stash (``MoEMLPArith.stash`` + ``router_stash_bytes``) against the tensors the trainer's
    MoE layer saves for its backward (fp32, CPU, one rank: e = 1), each storage counted once, weights left out.
    What the count leaves out is the router's small per-expert and per-group tensors (under 4% at these
    64-wide shapes; nothing beside the rows' k x (3h + 4F) at planner scale)."""
    import torch

    from megatron_2bw.config.moe_arith import MOE_MLP, router_stash_bytes
    from megatron_2bw.moe.layer import MoELayer

    model = get_moe_preset(name)
    torch.manual_seed(0)
    layer = MoELayer(model.moe, model.hidden_size, gated=model.swiglu)
    x = torch.randn(16, 4, model.hidden_size, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    tokens = 16 * 4
    want = MOE_MLP.stash(model).full * tokens * 4 + router_stash_bytes(model) * tokens
    assert 1.0 <= sum(seen.values()) / want < 1.05


def test_shared_expert_overlap_hides_the_all_to_alls_behind_the_shared_experts():
    """``--moe-shared-expert-overlap``: the dispatch all-to-all runs beside the shared experts' first linear, the
    combine beside their second (both again beside the replay with --moe-layer-recompute), each one's gradient
    beside that half's backward (twice its forward): each hides at most itself. The halves are priced from their
    multiply-adds (per token 2 s h and s h with SwiGLU, against the routed experts' k x F x h x 3); without shared
    experts the flag changes nothing."""
    b, width = 2, 1024  # its first half's backward outlasts an all-to-all here, its second's does not
    shared = replace(MIXTRAL, moe=replace(MIXTRAL.moe, moe_shared_expert_intermediate_size=width,
                                          moe_token_dispatcher_type="alltoall"))
    plain = analytic_microbatch_costs(shared, H100, "bf16", 1, b)
    first, second = plain.moe.shared_forward_s
    assert first == pytest.approx(2 * second, rel=1e-12)
    assert (first + second) / plain.moe.expert_forward_s == pytest.approx(width / (K * F), rel=1e-12)
    one = alltoall_seconds(plain, 1, 8, H100, 1.0)
    over_model = replace(shared, moe=replace(shared.moe, moe_shared_expert_overlap=True))
    for recompute in (False, True):
        m = replace(over_model, moe=replace(over_model.moe, moe_layer_recompute=recompute))
        base = replace(m, moe=replace(m.moe, moe_shared_expert_overlap=False))
        over, without = (for_experts(analytic_microbatch_costs(x, H100, "bf16", 1, b), 1, 8, H100, 1.0)
                         for x in (m, base))
        halves = over.moe.shared_forward_s
        assert over.alltoall_s[0] == pytest.approx(without.alltoall_s[0] - sum(min(one, s) for s in halves),
                                                   rel=1e-12)
        hidden = sum(min(one, 2 * s) + (min(one, s) if recompute else 0.0) for s in halves)
        assert over.alltoall_s[1] == pytest.approx(without.alltoall_s[1] - hidden, rel=1e-12)
        assert 0 < hidden < without.alltoall_s[1]  # some hidden, not all: the test's sizes cut both ways
        assert over.layer.forward_s < without.layer.forward_s
    no_shared = replace(MIXTRAL, moe=replace(MIXTRAL.moe, moe_shared_expert_overlap=True))
    a, z = (for_experts(analytic_microbatch_costs(x, H100, "bf16", 1, b), 1, 8, H100, 1.0)
            for x in (no_shared, MIXTRAL))
    assert a.alltoall_s == z.alltoall_s and a.layer == z.layer
