"""fp32 gradient accumulation and the distributed optimizer (ZeRO-1) in the planner: memory, time,
the search's choice, the printed command and the paper table, against hand-computed numbers."""

import math
from dataclasses import replace

import pytest

from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.config import OptimizerConfig
from megatron_2bw.planner.cost_model import data_parallel_allreduce_time, predict
from megatron_2bw.planner.efficiency import EfficiencyCurve
from megatron_2bw.planner.hardware import Cluster, load_cluster
from megatron_2bw.planner.layer_costs import BlockCost, MicrobatchCosts, analytic_microbatch_costs
from megatron_2bw.planner.memory_model import Candidate, ParamBytes, stage_memory
from megatron_2bw.planner.options_report import OPTION_SETS, format_options, options_comparison
from megatron_2bw.planner.report import _fits, max_model_size, paper_comparison, paper_model, pretrain_command
from megatron_2bw.planner.search import PlanRequest, evaluate, search

V100 = load_cluster("aws-p3.16xlarge")
from test_planner_memory import COSTS, L  # 8 layers of 100 params; embedding 1000; head 500 (400 tied)

DATA = ["--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"]
TRAIN = ["--train-iters", "10", "--lr", "1e-3", "--device", "cpu", *DATA]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("asked", [None, True, False])
def test_gradient_precision_follows_the_trainers_rule(precision, asked):
    trainer = OptimizerConfig("adam", dtype=precision, accumulate_allreduce_grads_in_fp32=asked).fp32_grads
    assert ParamBytes.for_precision(precision, asked).grad == (4 if trainer else 2)
    a100 = load_cluster("dgx-a100-80gb")
    assert PlanRequest(paper_model("gpt-355m"), a100, 8, 64, precision, fp32_grads=asked).accumulates_in_fp32 == trainer


def test_gradient_buffers_times_gradient_bytes():
    """Stage 1 of d = 4 holds 2 layers = 200 params; 2BW keeps two gradient buffers, Flush/GPipe one."""
    bf16 = ParamBytes.for_precision("bf16")  # fp32 accumulation by default
    for schedule, buffers in (("2bw", 2), ("flush", 1), ("gpipe", 1)):
        s = stage_memory(COSTS, Candidate(1, 4, 1, 1, 8, True, schedule), L, 1, bf16)
        assert s.grads == buffers * 200 * 4
        fp16 = stage_memory(COSTS, Candidate(1, 4, 1, 1, 8, True, schedule), L, 1, ParamBytes.for_precision("fp16"))
        assert fp16.grads == buffers * 200 * 2
        assert s.total - fp16.total == buffers * 200 * 2


def test_distributed_optimizer_shards_master_and_state_with_padding():
    """Stage 0 of d = 4: 2 layers + the embedding = 1200 params; w = 7: shards of ceil(1200/7) = 172."""
    pb = ParamBytes.for_precision("fp16")
    whole = stage_memory(COSTS, Candidate(1, 4, 7, 1, 8, True, "2bw"), L, 0, pb)
    zero = stage_memory(COSTS, Candidate(1, 4, 7, 1, 8, True, "2bw", distributed_optimizer=True), L, 0, pb)
    assert (whole.master, whole.optimizer_state) == (1200 * 4, 1200 * 8)
    assert (zero.master, zero.optimizer_state) == (172 * 4, 172 * 8)
    assert (zero.weights, zero.second_weights, zero.grads) == (whole.weights, whole.second_weights, whole.grads)
    # the save's gather buffer (172 fp32 elements) outweighs this toy's 43 bytes of activations
    assert zero.save == 172 * 4 and whole.save == 0
    assert whole.total - zero.total == (1200 - 172) * 12 - (zero.save - zero.activations - zero.workspace)
    one = stage_memory(COSTS, Candidate(1, 4, 1, 1, 8, True, "2bw", distributed_optimizer=True), L, 0, pb)
    assert one.optimizer == 1200 * 12  # one replica: nothing to shard
    fp32 = stage_memory(COSTS, Candidate(1, 4, 7, 1, 8, True, "flush", distributed_optimizer=True), L, 0,
                        ParamBytes.for_precision("fp32"))
    assert (fp32.master, fp32.optimizer_state, fp32.weights) == (0, 172 * 8, 1200 * 4)  # fp32: no master copy


def test_real_2p2b_middle_stage_bf16_zero():
    """GPT-2.2B, d = 8 (4 layers per stage), w = 8, bf16, 2BW: the static bytes written out by hand."""
    m = paper_model("gpt-2.2b")
    c = analytic_microbatch_costs(m, load_cluster("dgx-a100-80gb"), "bf16", 1, 4)
    h = 2304
    p = 4 * (12 * h * h + 13 * h)
    cand = Candidate(1, 8, 8, 4, 16, True, "2bw", distributed_optimizer=True)
    s = stage_memory(c, cand, m.num_layers, 1, ParamBytes.for_precision("bf16"))
    shard = math.ceil(p / 8)
    assert s.params == p
    assert (s.weights + s.second_weights, s.grads) == (2 * p * 2, 2 * p * 4)
    assert (s.master, s.optimizer_state) == (shard * 4, shard * 8)


# ---- time: toy cluster, 4 GPUs per server, NVLink 100 B/s, NIC 10 B/s, HBM 1000 B/s --------------
TOY = Cluster(
    name="toy", device="toy", device_memory_bytes=10**9, reserved_memory_bytes=0, peak_flops={"fp16": 1e12},
    memory_bandwidth=1000.0, devices_per_server=4, intra_server_allreduce_bandwidth=100.0,
    intra_server_p2p_bandwidth=50.0, inter_server_bandwidth=10.0, efficiency=EfficiencyCurve(0.5, 1.0),
)
TOY_COSTS = MicrobatchCosts(  # 4 layers of 100 params; free embedding and head
    layer=BlockCost(1.0, 2.0, params=100, stash_bytes=10, input_bytes=100, output_bytes=100),
    embedding=BlockCost(0.0, 0.0, params=0, stash_bytes=0, input_bytes=0, output_bytes=100),
    head=BlockCost(0.5, 1.0, params=0, stash_bytes=0, input_bytes=100, output_bytes=0),
)


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_reduce_scatter_all_gather_and_sharded_step(schedule):
    """d = 2 (2 layers of 10000 params per stage), w = 8 across two servers, m = 2. An all-reduce of
    B bytes costs ring(4 on NVLink) + ring(2 servers on the NIC) = 1.5 B/100 + 1.0 B/10, a
    reduce-scatter or an all-gather half of that. Every boundary crosses servers (t*w >= 4): the
    slowest stage takes 2 + 2 + 1.5 s of compute and 2 x 100 B / (10/4 B/s) of p2p per microbatch."""
    costs = replace(TOY_COSTS, layer=replace(TOY_COSTS.layer, params=10000))
    n = 20000
    base = dict(tensor_parallel=1, pipeline_parallel=2, data_parallel=8, micro_batch_size=1, num_micro_batches=2,
                recompute=False, schedule=schedule)
    half = lambda nbytes: (0.75 * nbytes / 100 + 0.5 * nbytes / 10)  # noqa: E731
    per_mb = 2 * (1 + 2) + 1.5 + 2 * 100 / 2.5
    for pb, scatter, gather, traffic in ((ParamBytes(2, 2, 4, 8), half(2 * n), half(2 * n), 32),
                                         (ParamBytes(2, 4, 4, 8), half(4 * n), half(2 * n), 38)):
        whole = predict(costs, Candidate(**base), 4, TOY, pb)
        zero = predict(costs, Candidate(**base, distributed_optimizer=True), 4, TOY, pb)
        assert zero.microbatch_s == pytest.approx(per_mb)
        assert whole.stages[0].allreduce_s == pytest.approx(2 * half(n * pb.grad))
        assert zero.stages[0].allreduce_s == pytest.approx(scatter + gather)
        assert whole.optimizer_s == pytest.approx(n * traffic / 1000)
        assert zero.optimizer_s == pytest.approx(2500 * traffic / 1000)  # ceil(20000 / 8) on each replica
        if schedule == "flush":  # both collectives exposed: after the drain, before the next first forward
            assert zero.exposed_allreduce_s == pytest.approx(scatter + gather)
        else:  # both overlap step t+1's two microbatches
            assert zero.exposed_allreduce_s == pytest.approx(scatter + gather - 2 * per_mb)
        assert zero.batch_s == pytest.approx(zero.pipeline_s + zero.exposed_allreduce_s + zero.optimizer_s)
    assert half(400) * 2 == pytest.approx(data_parallel_allreduce_time(400, 1, 8, TOY))


# ---- the search, the command, auto-plan ------------------------------------------------------------

def test_search_chooses_zero_where_only_it_fits():
    """GPT-2.2B on 64 V100s, B = 512, equal stages: d = 4, w = 16, b = 8 with recomputation does not
    fit with a replicated optimizer; sharding frees (N - ceil(N/16)) x 12 bytes on every stage, and
    it fits."""
    model = paper_model("gpt-2.2b")
    req = PlanRequest(model, V100, 64, 512, balance_stages=False)
    cand = Candidate(1, 4, 16, 8, 4, True, "2bw")
    from megatron_2bw.planner.search import default_costs
    costs = default_costs(req)
    whole, zero = evaluate(cand, costs, req), evaluate(replace(cand, distributed_optimizer=True), costs, req)
    assert whole.prediction is None and zero.prediction is not None
    for a, b in zip(whole.memory, zero.memory):
        assert a.total - b.total == (a.params - math.ceil(a.params / 16)) * 12
    best = search(PlanRequest(model, V100, 64, 512), top=1).best  # the pruned search's best is the exhaustive one's
    replicated = search(PlanRequest(model, V100, 64, 512, distributed_optimizer_options=(False,)), top=1).best
    assert best.candidate.distributed_optimizer and best.samples_per_sec > replicated.samples_per_sec
    assert not replicated.candidate.distributed_optimizer


@pytest.mark.parametrize("precision, asked, flag", [
    ("fp16", None, None), ("fp16", True, "--accumulate-allreduce-grads-in-fp32"),
    ("bf16", None, None), ("bf16", False, "--grad-reduce-in-bf16"),
])
def test_printed_command_carries_the_options(precision, asked, flag):
    req = PlanRequest(paper_model("gpt-355m"), load_cluster("dgx-a100-80gb"), 16, 256, precision, fp32_grads=asked)
    result = search(req)
    zero = next(e for e in result.ranked if e.candidate.distributed_optimizer)
    plain = next(e for e in result.ranked if not e.candidate.distributed_optimizer)
    for ev in (zero, plain):
        argv = pretrain_command(ev, req)
        cfg = build_config(parse_args([*argv[1:], *TRAIN], "gpt"), "gpt", 16, cuda_available=False)
        assert cfg.optimizer.use_distributed_optimizer == ev.candidate.distributed_optimizer
        assert ("--use-distributed-optimizer" in argv) == ev.candidate.distributed_optimizer
        assert cfg.optimizer.fp32_grads == req.accumulates_in_fp32
        assert [a for a in argv if "grad" in a] == ([flag] if flag else [])


def test_auto_plan_choice_carries_zero():
    from megatron_2bw.planner.auto_plan import PlanChoice
    choice = PlanChoice(1, 2, 4, 2, False, "2bw", None, True)
    assert choice.layout.distributed_optimizer and not PlanChoice(1, 2, 4, 2, False, "2bw").layout.distributed_optimizer


# ---- the paper table ---------------------------------------------------------------------------------

def test_options_table_3p8b():
    rows = options_comparison(scenarios=[("gpt-3.8b", 64, 512)])
    by = {x.options.label: x.row for x in rows}
    table = format_options(rows, {})
    print("\n" + table)
    paper = paper_comparison(scenarios=[("gpt-3.8b", 64, 512)])[0]
    first = by[OPTION_SETS[0].label]
    assert first.best["2BW"].candidate == paper.best["2BW"].candidate  # the paper's setting: the paper table's
    for o in OPTION_SETS:
        r = by[o.label]
        assert r.best["2BW"].candidate.distributed_optimizer <= o.distributed_optimizer
        assert f"{r.ratio('PipeDream-Flush'):.2f}x" in [ln for ln in table.splitlines() if o.label in ln][0]
    # sharding only adds candidates: never slower
    assert by[OPTION_SETS[1].label].best["2BW"].samples_per_sec >= first.best["2BW"].samples_per_sec
    assert by[OPTION_SETS[3].label].best["2BW"].samples_per_sec >= by[OPTION_SETS[2].label].best["2BW"].samples_per_sec
    # fp32 gradients on the paper's best layout: two more bytes per parameter in each of 2BW's two buffers
    req32 = PlanRequest(paper_model("gpt-3.8b"), V100, 64, 512, fp32_grads=True)
    from megatron_2bw.planner.search import default_costs
    again = evaluate(first.best["2BW"].candidate, default_costs(req32), req32)
    for a, b in zip(first.best["2BW"].memory, again.memory):
        assert b.total - a.total == 2 * a.params * 2


def test_largest_model_with_and_without_zero():
    template, depths = paper_model("gpt-3.8b"), [1, 16, 64]
    plain = max_model_size(template, V100, 64, depths)
    zero = max_model_size(template, V100, 64, depths, distributed_optimizer=True)
    print("\n" + ", ".join(f"d={a.pipeline_parallel}: {a.num_parameters / 1e9:.1f}B -> {b.num_parameters / 1e9:.1f}B"
                           for a, b in zip(plain, zero)))
    for a, b in zip(plain, zero):
        d = a.pipeline_parallel
        assert b.num_layers >= a.num_layers
        for row, on in ((a, False), (b, True)):  # the largest: one more layer per stage does not fit
            assert _fits(template, row.num_layers, V100, d, 64 // d, "2bw", "fp16", on) is not None
            assert _fits(template, row.num_layers + d, V100, d, 64 // d, "2bw", "fp16", on) is None
    assert zero[0].num_layers > plain[0].num_layers      # w = 64 replicas share the optimizer
    assert zero[-1].num_layers == plain[-1].num_layers  # d = 64: one replica, nothing to shard
