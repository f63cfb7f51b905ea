"""The planner prices every registry schedule through the ScheduleSpec contract, not by name.

The zero-bubble and interleaved specs land from other branches; here two small specs with their
formulas (a ZB-H1-like split backward, an interleaved-like two-chunk layout) are registered for the
test only (``monkeypatch`` on ``SCHEDULES``), and the cost model, memory model and search must price
and rank them exactly as those formulas say, by hand on a toy cluster. The three shipped schedules
must price as before: the default ``bubble_time`` is ``bubble_slots * (f + b + w)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.planner.cost_model import bubble_slots, predict, stage_times
from megatron_2bw.planner.efficiency import EfficiencyCurve
from megatron_2bw.planner.hardware import Cluster, load_cluster
from megatron_2bw.planner.layer_costs import (
    BlockCost,
    LayerCosts,
    MicrobatchCosts,
    analytic_microbatch_costs,
    core_forward_flops,
    layer_forward_flops,
)
from megatron_2bw.planner.memory_model import Candidate, stage_memory
from megatron_2bw.planner.search import PlanRequest, batch_time_lower_bound, search
from megatron_2bw.schedule.schedules import SCHEDULES, ScheduleSpec


@dataclass(frozen=True)
class _ZBH1Like(ScheduleSpec):
    """ZB-H1's formulas: 1F1B's stashes, the backward split, bubble (d-1)(f+b-w)."""

    split_backward: bool = True

    def bubble_time(self, d, m, f, b, w):
        return (d - 1) * max(f + b - w, 0.0)

    def deferred_weight_grads(self, d, r, m):
        return min(r + 1, m)

    def held_pairs(self, d, r, m):  # one forwarded microbatch beside r + 1 deferred ones, or d - r forwarded
        return ((1, min(r + 1, m)), (min(d - r, m), 0))


@dataclass(frozen=True)
class _InterleavedLike(ScheduleSpec):
    """Interleaved 1F1B's formulas with two chunks: Megatron's warm-up in chunk-microbatches, bubble / chunks."""

    chunks: int = 2

    def inflight(self, d, r, m):
        return min(m * self.chunks, (d - r - 1) * 2 + (self.chunks - 1) * d + 1)

    def bubble_time(self, d, m, f, b, w):
        return (d - 1) * (f + b + w) / self.chunks


@pytest.fixture
def fake_schedules(monkeypatch):
    monkeypatch.setitem(SCHEDULES, "zbh1-like", _ZBH1Like("zbh1-like"))
    monkeypatch.setitem(SCHEDULES, "interleaved-like", _InterleavedLike("interleaved-like"))


# Toy cluster: 4 GPUs per server, NVLink p2p 50 B/s; every number below can be checked by hand.
TOY = Cluster(
    name="toy", device="toy", device_memory_bytes=10**9, reserved_memory_bytes=0, peak_flops={"fp16": 1e12},
    memory_bandwidth=1000.0, devices_per_server=4, intra_server_allreduce_bandwidth=100.0,
    intra_server_p2p_bandwidth=50.0, inter_server_bandwidth=10.0, efficiency=EfficiencyCurve(0.5, 1.0),
)
FAST = replace(TOY, name="fast", intra_server_p2p_bandwidth=1e12)
L = 4
COSTS = MicrobatchCosts(  # layer: forward 1 s, backward 2 s (weight gradient unstated: half of it)
    layer=BlockCost(1.0, 2.0, params=100, stash_bytes=10, input_bytes=100, output_bytes=100,
                    weight_grad_stash_bytes=3),
    embedding=BlockCost(0.0, 0.0, params=0, stash_bytes=4, input_bytes=8, output_bytes=100),
    head=BlockCost(0.5, 1.0, params=0, stash_bytes=50, input_bytes=100, output_bytes=0, backward_weight_s=0.5,
                   weight_grad_stash_bytes=7),
)


def _cand(schedule, m=4):
    return Candidate(1, 2, 1, 1, m, False, schedule)


def test_stage_split_into_forward_input_grad_weight_grad():
    s0, s1 = stage_times(COSTS, _cand("flush"), L, TOY)
    # stage 0: 2 layers + embedding; p2p 2 * 100 B / 50 B/s = 4 s, half of it the forward's
    assert s0.microbatch_s == pytest.approx(10.0)
    assert s0.fbw == pytest.approx((2 * 1.0 + 2.0, 10.0 - 4.0 - 2.0, 2 * 1.0))
    # stage 1: 2 layers + head: compute 7.5, p2p 4; the head's weight gradient is stated (0.5)
    assert s1.microbatch_s == pytest.approx(11.5)
    assert s1.fbw == pytest.approx((2.0 + 0.5 + 2.0, 4.5, 2.0 + 0.5))
    assert sum(s1.fbw) == pytest.approx(s1.microbatch_s, rel=1e-15)


@pytest.mark.parametrize("schedule", ["flush", "gpipe", "2bw"])
def test_shipped_schedules_price_as_bubble_slots(schedule):
    """The default bubble_time reproduces bubble_slots * t_mb (what the planner priced before)."""
    for cluster in (TOY, load_cluster("dgx-a100-80gb")):
        model = ModelConfig("gpt", 8, 512, 8, 256, vocab_size=1024)
        costs = analytic_microbatch_costs(model, cluster, "fp16", 1, 2) if cluster is not TOY else COSTS
        layers = 8 if cluster is not TOY else L
        for d, m in ((2, 4), (4, 8)):
            cand = Candidate(1, d, 1, 1, m, False, schedule)
            p = predict(costs, cand, layers, cluster)
            assert p.bubble_s == pytest.approx(bubble_slots(schedule, d) * p.microbatch_s, rel=1e-12, abs=1e-15)
            assert p.pipeline_s == pytest.approx((m + bubble_slots(schedule, d)) * p.microbatch_s, rel=1e-12)


def test_zero_bubble_like_priced_by_its_formula(fake_schedules):
    flush, zb = predict(COSTS, _cand("flush"), L, TOY), predict(COSTS, _cand("zbh1-like"), L, TOY)
    assert flush.bubble_s == pytest.approx(11.5)  # (d - 1) * t_mb of the slowest stage
    assert zb.bubble_s == pytest.approx(1 * (4.5 + 4.5 - 2.5))  # (d - 1)(f + b - w) of the same stage
    assert zb.microbatch_s == flush.microbatch_s
    assert flush.batch_s - zb.batch_s == pytest.approx(11.5 - 6.5)


def test_interleaved_like_pays_chunks_times_the_transfers(fake_schedules):
    s0, s1 = stage_times(COSTS, _cand("interleaved-like"), L, TOY)
    # stage 0 receives its second chunk's input from the last stage (one server: NVLink 50 B/s) and sends
    # both chunks' outputs: 2 * (100 + 200) / 50; stage 1 receives two and sends one back to stage 0
    assert s0.p2p_s == pytest.approx(2 * (100 + 200) / 50)
    assert s1.p2p_s == pytest.approx(2 * (200 + 100) / 50)
    p = predict(COSTS, _cand("interleaved-like"), L, TOY)
    assert p.microbatch_s == pytest.approx(7.5 + 12.0)
    assert p.bubble_s == pytest.approx(19.5 / 2)  # (d - 1) * t_mb / chunks
    # across servers the wrap-around transfer shares the NIC: t*w*d = 8 > 4 GPUs per server
    wide = stage_times(COSTS, Candidate(1, 2, 4, 1, 4, False, "interleaved-like"), L, TOY)
    assert wide[0].p2p_s == pytest.approx(2 * (100 / (10 / 4) + 200 / (10 / 4)))


def _request(cluster, schedules):
    model = ModelConfig("gpt", L, 64, 4, 16, vocab_size=128)
    return PlanRequest(model, cluster, 2, 4, "fp16", max_micro_batch_size=1, schedules=schedules,
                       recompute_options=(False,), balance_stages=False, distributed_optimizer_options=(False,))


@pytest.mark.parametrize("cluster, order", [
    # slow links: two chunks' transfers cost more than half the bubble
    (TOY, ["zbh1-like", "flush", "interleaved-like"]),
    (FAST, ["zbh1-like", "interleaved-like", "flush"]),  # free links: half the bubble wins
])
def test_search_ranks_by_the_formulas(fake_schedules, cluster, order):
    names = ("flush", "zbh1-like", "interleaved-like")
    req = _request(cluster, names)
    costs = LayerCosts("toy", {(1, 1): COSTS})
    result = search(req, costs)
    piped = [e for e in result.ranked if e.candidate.pipeline_parallel == 2]
    assert [e.candidate.schedule for e in piped] == order
    by_name = {e.candidate.schedule: e for e in piped}
    base = {n: predict(COSTS, _cand(n), L, cluster) for n in names}
    for n in names:
        assert by_name[n].prediction.batch_s == pytest.approx(base[n].batch_s, rel=1e-12)
        # the search's pruning bound stays a bound for a schedule with its own bubble formula
        assert batch_time_lower_bound(by_name[n].candidate, costs, req) <= base[n].batch_s * (1 + 1e-9)


def test_memory_of_chunks_and_deferred_weight_gradients(fake_schedules):
    flush = [stage_memory(COSTS, _cand("flush"), L, r) for r in (0, 1)]
    inter = [stage_memory(COSTS, _cand("interleaved-like"), L, r) for r in (0, 1)]
    zb = [stage_memory(COSTS, _cand("zbh1-like"), L, r) for r in (0, 1)]
    # Flush, stage 0: 2 in flight x (2 layers x 10 + embedding 8 + 4) + the layer's workspace (0)
    assert flush[0].activations == 2 * (20 + 12)
    # interleaved: Megatron's warm-up counts chunk-microbatches: (d - r - 1) * 2 + (v - 1) * d + 1 = 5 on
    # stage 0, each half the rank's stash; stage 1: 3 of them, the head's stash included in the rank's
    assert inter[0].activations == round(5 / 2 * (20 + 12))
    assert inter[1].activations == round(3 / 2 * (20 + 50))
    # ZB-H1-like, peak over its (F..I, I..W) pairs. A deferred microbatch keeps what its W reads plus the
    # gradients its I caught (layers 3 each, head 7; unstated reads: the whole stash), except on the first
    # stage, whose I computes nothing: there it keeps its stash (32) and the gradient received (100).
    assert zb[0].activations == max(1 * 32 + 1 * (32 + 100), 2 * 32)
    assert zb[1].activations == max(1 * 70 + 2 * (70 + 2 * 3 + 7), 1 * 70)
    assert COSTS.embedding.deferred_bytes == COSTS.embedding.stash_bytes  # unstated: the whole stash
    # with recomputation a forwarded microbatch keeps its input (token ids 8, hidden states 100) and the one
    # being recomputed its stage's whole stash
    rec = [stage_memory(COSTS, replace(_cand("zbh1-like"), recompute=True), L, r) for r in (0, 1)]
    assert rec[0].activations == 8 + 1 * (8 + 100) + 32
    assert rec[1].activations == 100 + 2 * (70 + 13) + 70
    # stated reads replace the whole stash
    cheap = replace(COSTS, layer=replace(COSTS.layer, weight_grad_input_bytes=4),
                    head=replace(COSTS.head, weight_grad_input_bytes=5))
    assert stage_memory(cheap, _cand("zbh1-like"), L, 1).activations == max(70 + 2 * (2 * 4 + 5 + 13), 70)
    assert all(z.weights == f.weights and z.grads == f.grads for z, f in zip(zb, flush))


def test_analytic_weight_gradient_is_the_weight_gemms():
    """w = the weight GEMMs' FLOPs at the layer's speed, b the rest; the deferred bytes by hand (GPT)."""
    a100 = load_cluster("dgx-a100-80gb")
    model = ModelConfig("gpt", 4, 512, 8, 1024, vocab_size=1024)
    b, t, e = 2, 2, 2
    c = analytic_microbatch_costs(model, a100, "bf16", t, b)
    speed = a100.peak("bf16") * a100.efficiency.layer_fraction(b, 1024, 512, t)
    gemms = (layer_forward_flops(model, b, t) - core_forward_flops(model, b, t)) / speed
    assert c.layer.weight_grad_s == pytest.approx(gemms, rel=1e-12)
    assert c.layer.input_grad_s == pytest.approx(c.layer.backward_s - gemms, rel=1e-12)
    assert 0 < c.layer.weight_grad_s < c.layer.input_grad_s  # dX also carries the core and memory-bound kernels
    s, h, f = 1024, 512, 4 * 512
    # output gradients: QKV (3bsh/t), fc1 (bsf/t), proj and fc2 (bsh, replicated), the two norms (bsh)
    want = e * b * s * (4 * h + (3 * h + f) // t)
    assert c.layer.deferred_bytes == want
    sp = analytic_microbatch_costs(replace(model, sequence_parallel=True), a100, "bf16", t, b)
    assert sp.layer.deferred_bytes == e * b * s * (2 * h + (2 * h + 3 * h + f) // t)  # the norms' shard
    assert c.embedding.weight_grad_s == c.embedding.backward_s  # no input gradient below the embedding
    # a profile without the split: half the backward, the whole stash
    bare = BlockCost(1.0, 3.0, params=1, stash_bytes=9, input_bytes=1, output_bytes=1)
    assert (bare.weight_grad_s, bare.input_grad_s, bare.deferred_bytes) == (1.5, 1.5, 9)


@pytest.mark.parametrize("kind", ["gpt-tiny", "llama-tiny", "bert-tiny"])
def test_deferred_bytes_are_what_the_engine_keeps(kind):
    """The analytic bytes a deferred W keeps beyond the stash equal what ``split_backward``'s I keeps for
    W in a real stage (fp32, t = 1): a middle stage's layer, and the last stage's head on top of it."""
    import torch
    from pipeline_harness import _dataset
    from torch import nn

    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.pipeline.split_backward import accumulator, backward_input
    from megatron_2bw.tensor_parallel.random import RNGTracker

    cfg = get_preset(kind, hidden_dropout=0.0, attention_dropout=0.0)
    costs = analytic_microbatch_costs(cfg, load_cluster("dgx-a100-80gb"), "fp32", 1, 2)
    kept = []
    for r in (1, 3):  # d = 4: one layer in the middle, one layer and the head last
        torch.manual_seed(0)
        spec = ModelSpec(cfg, ModelGroups(), 7, rng=RNGTracker(7, 0))
        layers = nn.ModuleList(spec.build_stage(4, r))
        batch = spec.make_batch(_dataset(cfg, 2))
        x = out = torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
        for layer in layers:
            out = layer(out, batch)
        last = r == 3
        if last:
            out = spec.loss_fn()(out, batch)
        index = {accumulator(p): i for i, p in enumerate(layers.parameters())}
        _, deferred = backward_input(out, None if last else torch.ones_like(out), x, index)
        kept.append(deferred.nbytes)
    assert kept[0] == costs.layer.deferred_bytes
    assert kept[1] == costs.layer.deferred_bytes + costs.head.deferred_bytes


def test_unknown_schedule_still_refused():
    from megatron_2bw.errors import ConfigError

    with pytest.raises(ConfigError, match="--pipeline-schedule must be one of"):
        _cand("zbh1-like")  # registered only inside the tests that ask for fake_schedules


def test_13b_t2_fits_on_8_h100_by_hand():
    """scale-review section 1: "a standard 13B t=2 on 8 H100 does not fit". It does (bf16, fp32 gradient
    accumulation, distributed optimizer over w = 4, fused attention, b = 1), by this hand count."""
    from megatron_2bw.planner.hardware import GiB
    from megatron_2bw.planner.search import default_costs, evaluate

    model = ModelConfig("gpt", 40, 5120, 40, 2048, vocab_size=50257, hidden_dropout=0.1, attention_dropout=0.1)
    req = PlanRequest(model, load_cluster("dgx-h100"), 8, 1024, "bf16", memory_margin=0.1)
    ev = evaluate(Candidate(2, 1, 4, 1, 256, False, "flush", distributed_optimizer=True), default_costs(req), req)
    s, h, f, a, t, V = 2048, 5120, 4 * 5120, 40, 2, 50432  # the vocabulary padded to a multiple of 128 * t
    layer = (4 * h * h + 3 * h + 2 * h * f + f) // t + 6 * h
    p = 40 * layer + V * h // t + s * h + 2 * h  # layers, word + position embeddings, final LayerNorm (tied head)
    mem = ev.memory[0]
    assert mem.params == p
    assert (mem.weights, mem.grads, mem.master, mem.optimizer_state) == (2 * p, 4 * p, 4 * -(-p // 4), 8 * -(-p // 4))
    # Korthikanti's sbh(10 + 24/t) per layer plus the kernel's log-sum-exp; the embedding's dropout mask and
    # token ids; the head's norm tensors and fp32 softmax
    acts = 40 * (s * h * (10 + 24 // t) + 4 * a * s // t) + (s * h + 8 * s) + (2 * 2 * s * h + 4 * s * V // t)
    assert mem.activations == acts
    assert ev.prediction is not None and ev.memory_bytes_per_gpu < req.memory_limit_bytes
    assert 60 * GiB < ev.memory_bytes_per_gpu < 66 * GiB


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zb-v"])
def test_split_memory_is_the_simulated_timeline_peak(schedule):
    """The memory model's peak over ``held_pairs`` equals the simulator's event-by-event peak (stash until I,
    what W reads and the caught gradients until W); with recomputation the model adds the recomputing
    microbatch's stash on top of every pair, an upper bound of the timeline, as it is on a V's rank 0,
    which holds the first virtual stage (whose I computes nothing) and the last."""
    from megatron_2bw.planner.layer_costs import analytic_layer_costs
    from megatron_2bw.planner.simulator import simulate, stage_costs

    model = ModelConfig("gpt", 16, 1024, 16, 1024, vocab_size=50257)
    costs = analytic_layer_costs(model, load_cluster("dgx-a100-80gb"), "bf16", (1,), (2,)).at(1, 2)
    for recompute in (False, True):
        cand = Candidate(1, 4, 1, 2, 8, recompute, schedule)
        sim = simulate(schedule, 4, 8, stage_costs(costs, cand, 16), num_steps=2).peak_activation_bytes
        model_peak = [stage_memory(costs, cand, 16, r).activations for r in range(4)]
        for r, (s, mm) in enumerate(zip(sim, model_peak)):
            if recompute or (schedule == "zb-v" and r == 0):  # a V's rank 0: either chunk's rule, the larger
                assert 0.5 * mm < s <= mm
            else:
                assert s == pytest.approx(mm, rel=1e-6)
