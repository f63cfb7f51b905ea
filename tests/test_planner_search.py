"""The search: its space, its constraints, its speed, and the paper's planner choices."""

import time

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.report import paper_model
from megatron_2bw.planner.search import PlanRequest, candidates, default_costs, pipeline_depths, search, tensor_sizes
from megatron_2bw.schedule.schedules import PLANNED_SCHEDULES, SCHEDULE_NAMES

V100 = load_cluster("aws-p3.16xlarge")


def test_search_space_respects_every_constraint():
    model = paper_model("gpt-2.2b")
    req = PlanRequest(model, V100, 64, 512)
    seen = list(candidates(req, default_costs(req)))
    assert seen
    layouts = set()
    for c in seen:
        assert c.num_gpus == 64 and c.global_batch_size == 512
        assert V100.devices_per_server % c.tensor_parallel == 0 and model.num_attention_heads % c.tensor_parallel == 0
        assert model.num_layers % c.pipeline_parallel == 0
        assert c.micro_batch_size & (c.micro_batch_size - 1) == 0
        if c.schedule == "2bw":
            assert c.num_micro_batches >= c.pipeline_parallel
        if c.pipeline_parallel == 1:
            assert c.schedule == "flush"  # no pipelining: plain data/tensor parallelism
        layouts.add((c.tensor_parallel, c.pipeline_parallel, c.data_parallel))
    assert (1, 8, 8) in layouts and (1, 1, 64) in layouts and (8, 1, 8) in layouts
    # every schedule of the registry, and those whose steps overlap under post-validation with it (ids: zb-h2+pv)
    assert {c.schedule for c in seen} == set(PLANNED_SCHEDULES) == {*SCHEDULE_NAMES, "zb-h2+pv", "zb-v+pv"}
    assert {c.recompute for c in seen} == {True, False}


def test_divisors():
    m = ModelConfig("gpt", 24, 1152, 12, 128, 128, 1000)
    assert tensor_sizes(m, V100, 64) == (1, 2, 4)  # 8 does not divide 12 heads
    assert pipeline_depths(m, 64, 1) == (1, 2, 4, 8)  # 3, 6, 12, 24 do not divide 64 GPUs
    assert pipeline_depths(m, 48, 2) == (1, 2, 3, 4, 6, 8, 12, 24)


def test_ranked_best_first_and_all_fit():
    r = search(PlanRequest(paper_model("gpt-1.3b"), V100, 16, 256))
    # to the ranking's 1e-9 (a tie goes to less memory: zb-h2 and zb-h2+pv can price alike up to the last bits)
    speeds = [round(e.samples_per_sec, 9) for e in r.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.memory_bytes_per_gpu <= V100.usable_memory_bytes for e in r.ranked)
    # one-stage layouts whose cheaper recomputation fits are not evaluated again with a costlier one
    assert r.considered == len(r.ranked) + r.too_big + r.pruned and r.pruned > 0


def test_pruned_candidates_are_slower():
    """Evaluate every candidate the search skipped: each is no faster than a candidate of the same
    layout that the ranking kept, so pruning never loses a plan; and the lower bound holds."""
    from megatron_2bw.planner.search import (
        FINER_RECOMPUTE,
        _group,
        batch_time_lower_bound,
        candidates,
        default_costs,
        evaluate,
    )
    req = PlanRequest(paper_model("gpt-1.3b"), V100, 16, 256, recompute_policies=FINER_RECOMPUTE)
    r = search(req)
    costs = default_costs(req)
    ranked = {(_group(e.candidate), e.candidate.recompute, e.candidate.recompute_policy): e.samples_per_sec
              for e in r.ranked}
    best_kept: dict[tuple, float] = {}
    for (key, _, _), sps in ranked.items():
        best_kept[key] = max(best_kept.get(key, 0.0), sps)
    missing = deep = 0
    for cand in candidates(req, costs):
        ev = evaluate(cand, costs, req)
        if ev.prediction is None:
            continue
        assert batch_time_lower_bound(ev.candidate, costs, req) <= ev.prediction.batch_s * (1 + 1e-9)
        if (_group(cand), cand.recompute, cand.recompute_policy) not in ranked:
            missing += 1
            deep += cand.pipeline_parallel > 1
            assert ev.samples_per_sec <= best_kept[_group(cand)] * (1 + 1e-9)
    assert deep > 0 and r.pruned >= missing > deep  # pruned with and without a pipeline


def test_nothing_fits_is_one_line():
    with pytest.raises(ConfigError, match="nothing fits") as e:
        search(PlanRequest(paper_model("gpt-3.8b"), V100, 1, 8))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="must be positive"):
        PlanRequest(paper_model("gpt-3.8b"), V100, 0, 8)


def _paper_choice(result, t, d, w):
    return next(e for e in result.ranked if (e.candidate.tensor_parallel, e.candidate.pipeline_parallel,
                                             e.candidate.data_parallel) == (t, d, w)
                and e.candidate.recompute and e.candidate.schedule == "2bw")


@pytest.mark.parametrize("name, layout", [("gpt-2.2b", (1, 8, 8)), ("gpt-3.8b", (1, 16, 4))])
def test_paper_planner_choices(name, layout):
    """64 x V100-16GB (p3.16xlarge), seq 512, batch 512, fp16 + mixed-precision Adam; the paper's
    planner cut equal stages (``balance_stages=False``; test_uneven_stages.py covers balancing) and
    replicated the optimizer (the distributed optimizer: test_planner_zero.py)."""
    result = search(PlanRequest(paper_model(name), V100, 64, 512, balance_stages=False,
                                distributed_optimizer_options=(False,)))
    best, paper = result.best, _paper_choice(result, *layout)
    rank = result.ranked.index(paper) + 1
    print(f"\n{name}: best {best.candidate} {best.samples_per_sec:.1f}/s; paper's (t,d,w)={layout} with "
          f"recomputation: rank {rank}, {paper.samples_per_sec:.1f}/s = "
          f"{paper.samples_per_sec / best.samples_per_sec:.3f} of best")
    assert paper.samples_per_sec >= 0.9 * best.samples_per_sec
    # Recomputation is what the paper's layouts need: it beats not recomputing on that layout.
    no_rc = [e for e in result.ranked if (e.candidate.tensor_parallel, e.candidate.pipeline_parallel,
                                          e.candidate.data_parallel) == layout and not e.candidate.recompute
             and e.candidate.schedule == "2bw"]
    assert all(e.samples_per_sec < paper.samples_per_sec for e in no_rc)


def test_3p8b_choice_is_first():
    best = search(PlanRequest(paper_model("gpt-3.8b"), V100, 64, 512, distributed_optimizer_options=(False,)),
                  top=1).best.candidate
    assert (best.tensor_parallel, best.pipeline_parallel, best.data_parallel, best.recompute) == (1, 16, 4, True)


@pytest.mark.parametrize("gpus, most", [(64, 4000), (1024, 4000)])
def test_search_stays_small(gpus, most):
    """The search prices a bounded number of candidates (2,810 and 2,328 for GPT-3 175B on 64 and 1,024 A100s):
    a space that grows by a factor fails here on any machine. How fast it prices them is for a benchmark to
    measure, not a timed test (a 3 s limit failed on a host half as fast as the one it was set on); the limit
    below only catches a search that runs away (4-7 s on that host)."""
    model = ModelConfig("gpt", 96, 12288, 96, 2048, 2048, 50257)
    request = PlanRequest(model, load_cluster("dgx-a100-80gb"), gpus, 1536, "bf16")
    start = time.process_time()
    result = search(request, require_fit=False, top=10)  # what tools/plan.py runs (test_planner_pruning.py)
    elapsed = time.process_time() - start
    print(f"\nsearch over {gpus} GPUs: {result.considered} candidates, {result.priced} priced, "
          f"in {elapsed * 1e3:.0f} ms")
    assert 0 < result.considered <= most and result.priced <= result.considered
    assert elapsed < 120.0
