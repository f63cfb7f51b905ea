"""Recomputation inside stages (--recompute-granularity/-method/-num-layers): the same training as
without it (dropout 0.1 replayed, fp32 bitwise) on every schedule, and a stash that shrinks as the
planner's memory model predicts."""

import functools

import pipeline_harness
import pytest
import torch

from megatron_2bw.config import PipelineConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.schedule.recompute_policy import RecomputePolicy
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, get_schedule
from megatron_2bw.schedule.stages import stage_slice

# one model chunk per rank: these compare against a one-stage run, which a chunked schedule (interleaved,
# V) cannot be; tests/test_interleaved_numerics.py covers those against the single process
ONE_CHUNK = tuple(s for s in SCHEDULE_NAMES if get_schedule(s).chunks == 1)
from multiproc import run_workers

from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
from megatron_2bw.planner.memory_model import edge_activation_bytes, layer_stash_with

KW = dict(steps=3, dropout=0.1, global_batch=8, micro=2, lr=1e-3)
SELECTIVE = RecomputePolicy("selective")
UNIFORM1, UNIFORM2, UNIFORM3 = (RecomputePolicy("full", "uniform", n) for n in (1, 2, 3))
BLOCK1, BLOCK2 = RecomputePolicy("full", "block", 1), RecomputePolicy("full", "block", 2)


def train(policy, schedule, layout=None, kind="gpt-tiny"):
    """``pipeline_harness.train_tiny`` with every stage built under ``policy``."""
    class Spec(ModelSpec):
        def __init__(self, *args, **kw):
            super().__init__(*args, recompute=policy, **kw)

    saved = pipeline_harness.ModelSpec
    pipeline_harness.ModelSpec = Spec
    try:
        return pipeline_harness.train_tiny(schedule, layout=layout, kind=kind, **KW)
    finally:
        pipeline_harness.ModelSpec = saved


@functools.lru_cache(maxsize=None)
def single(policy, schedule):
    return train(policy, schedule)


def same_training(a, b):
    assert a["losses"] == b["losses"]  # bitwise: the replay draws the same dropout masks
    assert a["norms"] == b["norms"]
    for k, p in a["params"].items():
        assert torch.equal(p, b["params"][k]), k


@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_every_option_trains_like_no_recomputation(schedule):
    base = single(None, schedule)
    for policy in (SELECTIVE, UNIFORM3, BLOCK2):  # chunks (3, 1); two single layers and two plain ones
        same_training(base, single(policy, schedule))


def test_bert_padding_mask():
    """BERT's attention mask passes through the recomputed core and chunks."""
    base = train(None, "2bw", kind="bert-tiny")
    for policy in (SELECTIVE, UNIFORM2):
        same_training(base, train(policy, "2bw", kind="bert-tiny"))


def _options(layout, schedule, policies):
    base = train(None, schedule, layout)
    return [(base, train(p, schedule, layout)) for p in policies]


def test_pipeline_parallel_2bw():
    for outs in run_workers(_options, 2, (1, 2, 1), "2bw", (SELECTIVE, UNIFORM1, BLOCK1)):
        for base, other in outs:
            if base["last"]:
                assert base["losses"] == other["losses"]
            for k, p in base["params"].items():
                assert torch.equal(p, other["params"][k]), k
            assert other["stats"]["peak_stashed_bytes"] < base["stats"]["peak_stashed_bytes"]


def test_tensor_parallel_selective():
    """t = 2: each rank's heads draw their attention-dropout masks from the tracker; replayed exactly."""
    for outs in run_workers(_options, 2, (2, 1, 1), "flush", (SELECTIVE, UNIFORM2)):
        for base, other in outs:
            same_training(base, other)


def test_stash_follows_the_memory_model():
    """Per microbatch, measured stash vs the model's (transformer layers under the policy plus the
    embedding's and head's): within 12%, the model below (the CPU engine also keeps fp32 attention-
    dropout masks, counted by the model as 1 byte). Chunk inputs are counted exactly."""
    cfg = get_preset("gpt-tiny", hidden_dropout=0.1, attention_dropout=0.1)
    costs = analytic_microbatch_costs(cfg, load_cluster("aws-p3.16xlarge"), "fp32", 1, KW["micro"])
    edge = edge_activation_bytes(costs, cfg.num_layers, 1, 0)
    measured, predicted = {}, {}
    for policy in (None, SELECTIVE, UNIFORM1, UNIFORM2, UNIFORM3, BLOCK2):
        st = single(policy, "gpipe")["stats"]
        assert st["max_inflight"] == 4  # one stage, m = 4: every microbatch's stash at once
        measured[policy] = st["peak_stashed_bytes"] / st["max_inflight"]
        predicted[policy] = layer_stash_with(costs, stage_slice(cfg.num_layers, 1, 0).num_layers, policy)[0] + edge
        assert 0.88 <= predicted[policy] / measured[policy] <= 1.0, (policy, predicted[policy], measured[policy])
    # four chunk inputs against two (uniform 2; uniform 3 cuts 4 layers into 3 + 1)
    assert measured[UNIFORM1] - measured[UNIFORM2] == 2 * costs.layer.input_bytes
    assert measured[UNIFORM2] == measured[UNIFORM3]
    for policy in (SELECTIVE, UNIFORM1, BLOCK2):  # the relative saving, within 3 points
        saved = 1 - measured[policy] / measured[None]
        model = 1 - predicted[policy] / predicted[None]
        assert abs(saved - model) < 0.03, (policy, saved, model)


@pytest.mark.parametrize("kw, message", [
    (dict(recompute_method="uniform"), "needs --recompute-granularity full"),
    (dict(recompute_granularity="full"), "needs --recompute-method"),
    (dict(recompute_granularity="selective", recompute_method="block", recompute_num_layers=1),
     "needs --recompute-granularity full"),
    (dict(recompute=True, recompute_granularity="selective"), "either --recompute-activations"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0), "must be >= 1"),
    (dict(recompute_num_layers=2), "needs --recompute-method"),
    (dict(recompute_granularity="all"), "full or selective"),
])
def test_invalid_combinations_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(**kw)


def test_segments():
    assert UNIFORM3.segments(4) == [(0, 3, True), (3, 1, True)]
    assert BLOCK2.segments(4) == [(0, 1, True), (1, 1, True), (2, 2, False)]
    assert BLOCK2.segments(1) == [(0, 1, True)]
    assert SELECTIVE.segments(3) == [(0, 3, False)]
    assert RecomputePolicy.from_pipeline(PipelineConfig()) is None
    assert RecomputePolicy.from_pipeline(PipelineConfig(recompute_granularity="selective")) == SELECTIVE


def test_search_tries_the_finer_options_on_the_paper_2p2b_model():
    """GPT-2.2B, 64 V100s, batch 512: with selective and per-layer recomputation the search sees
    twice the candidates, keeps every old one, and its best is at least as fast."""
    from megatron_2bw.planner.report import paper_model
    from megatron_2bw.planner.search import FINER_RECOMPUTE, PlanRequest, search
    v100 = load_cluster("aws-p3.16xlarge")
    old = search(PlanRequest(paper_model("gpt-2.2b"), v100, 64, 512))
    new = search(PlanRequest(paper_model("gpt-2.2b"), v100, 64, 512, recompute_policies=FINER_RECOMPUTE))
    assert new.considered == 2 * old.considered
    assert new.best.samples_per_sec >= old.best.samples_per_sec
    seen = {e.candidate.recompute_policy for e in new.ranked}
    assert {None, *FINER_RECOMPUTE} <= seen
    # the paper's layout, a middle stage (2 layers, 16 - 1 = 15 microbatches in flight): selective
    # keeps every layer's core out of each stash and rebuilds one core at a time
    from megatron_2bw.planner.memory_model import Candidate, in_flight, stage_memory
    costs = analytic_microbatch_costs(paper_model("gpt-2.2b"), v100, "fp16", 1, 4)
    plain, sel = (stage_memory(costs, Candidate(1, 16, 4, 4, 32, False, "2bw", recompute_policy=p), 32, 1)
                  for p in (None, FINER_RECOMPUTE[0]))
    n, core = in_flight("2bw", 16, 32, 1), 5 * 32 * 512 * 512 * 4
    assert n == 15 and costs.layer.core_stash_bytes == core
    assert plain.activations - sel.activations == n * 2 * core - core
