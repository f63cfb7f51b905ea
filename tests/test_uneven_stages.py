"""Uneven pipeline stages: the split flags, Megatron's rules, the planner's choice, and training.

References: Megatron-core's layer-offset rule (``get_transformer_layer_offset``, written out below
from its definition), brute force over every split for the planner, and the single-process run for
training (as tests/test_pipeline_layouts.py does for even splits).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest
from e2e import corpus  # noqa: F401 - session fixture

from megatron_2bw.argv import to_argv
from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.presets import GPT2_VOCAB
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.cost_model import predict, stage_time
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
from megatron_2bw.planner.memory_model import Candidate, ParamBytes, stage_memory
from megatron_2bw.planner.report import format_table, plan_json, pretrain_command
from megatron_2bw.planner.search import PlanRequest, default_costs, evaluate, search
from megatron_2bw.planner.simulator import simulate_plan
from megatron_2bw.planner.split import balanced_split
from megatron_2bw.schedule.stages import (
    canonical_split,
    format_split,
    layers_per_stage,
    megatron_split,
    min_layers,
    stage_range,
    stage_slice,
)

DATA = ["--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"]
TRAIN = ["--train-iters", "10", "--lr", "1e-3", "--device", "cpu", *DATA]
V100 = load_cluster("aws-p3.16xlarge")


# ---- Megatron's rule ------------------------------------------------------------------------------

def megatron_offsets(L: int, d: int, first=None, last=None, emb=False, loss=False) -> list[int]:
    """Megatron-core's first-layer offset of each stage (no virtual pipeline), from its definition."""
    out = []
    for r in range(d):
        if first is not None or last is not None:
            middle = d - (first is not None) - (last is not None)
            per = (L - (first or 0) - (last or 0)) // middle if middle else 0
            mr = r if first is None else r - 1
            out.append(0 if r == 0 else mr * per + (first or 0))
        else:
            per = (L + emb + loss) // d
            out.append(r * per - (1 if emb and r > 0 else 0))
    return out


MEGATRON_CASES = [
    (8, 4, dict(first=2)), (8, 4, dict(last=5)), (10, 4, dict(first=3, last=3)), (10, 4, dict(first=4, last=2)),
    (7, 2, dict(first=3)), (6, 2, dict(first=2, last=4)), (30, 8, dict(emb=True, loss=True)),
    (31, 8, dict(emb=True)), (31, 8, dict(loss=True)), (6, 8, dict(emb=True, loss=True)),
    (4, 1, dict(emb=True, loss=True)),
]


@pytest.mark.parametrize("L, d, kw", MEGATRON_CASES)
def test_megatron_flags_give_megatrons_layer_offsets(L, d, kw):
    split = megatron_split(L, d, first=kw.get("first"), last=kw.get("last"),
                           account_for_embedding=kw.get("emb", False), account_for_loss=kw.get("loss", False))
    counts = layers_per_stage(L, d, split)
    assert [stage_slice(L, d, r, split).first_layer for r in range(d)] == megatron_offsets(L, d, **kw)
    assert sum(counts) == L
    if split is None:
        assert counts == (L // d,) * d  # canonical form of the even split


@pytest.mark.parametrize("L, d, kw, match", [
    (8, 4, dict(first=3), "not divisible by the 3 middle"),
    (8, 4, dict(first=0), "must be > 0"),
    (8, 2, dict(first=3, last=3), "leaves 2 layers for 0 middle"),
    (8, 3, dict(first=4, last=4), "leaves 0 layers for 1 middle"),
    (8, 4, dict(emb=True), "9 is not divisible"),
    (8, 4, dict(first=2, loss=True), "cannot be combined"),
    (8, 1, dict(last=8), "needs --pipeline-model-parallel-size > 1"),
])
def test_megatron_flags_refuse_what_megatron_refuses(L, d, kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        megatron_split(L, d, first=kw.get("first"), last=kw.get("last"), account_for_embedding=kw.get("emb", False),
                       account_for_loss=kw.get("loss", False))
    assert "\n" not in str(e.value)


def test_explicit_split_rules_and_stage_ranges():
    assert canonical_split(8, 4, [2, 2, 2, 2]) is None and canonical_split(8, 4, (3, 2, 2, 1)) == (3, 2, 2, 1)
    assert canonical_split(4, 2, (0, 4)) == (0, 4)  # an edge stage may hold only the embedding / the head
    # [embedding, layer 0..7, head]: stage 0 holds list items 0..3, stage 3 items 8..9
    assert [stage_range(8, 4, r, (3, 2, 2, 1)) for r in range(4)] == [(0, 4), (4, 6), (6, 8), (8, 10)]
    assert [stage_range(4, 2, r, (0, 4)) for r in range(2)] == [(0, 1), (1, 6)]
    for bad, match in [((3, 0, 4, 1), "stage 1 has 0 layers"), ((3, 3, 1), "has 3 stages"),
                       ((3, 3, 3, 1), "sums to 10"), ((-1, 3, 3, 3), "stage 0 has -1")]:
        with pytest.raises(ConfigError, match=match):
            canonical_split(8, 4, bad)


def _cfg(extra: list[str], d: int = 4, world: int = 4, layers: int = 8):
    argv = ["--model-preset", "gpt-tiny", "--num-layers", str(layers), "--micro-batch-size", "1",
            "--pipeline-model-parallel-size", str(d), *extra, *TRAIN]
    return build_config(parse_args(argv, "gpt"), "gpt", world, cuda_available=False)


@pytest.mark.parametrize("extra, want", [
    ([], None), (["--pipeline-layer-split", "3,2,2,1"], (3, 2, 2, 1)), (["--pipeline-layer-split", "2 2 2 2"], None),
    (["--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "2"], (4, 1, 1, 2)),
    (["--decoder-last-pipeline-num-layers", "5"], (1, 1, 1, 5)),
])
def test_trainer_flags_resolve_to_one_split_and_back(extra, want):
    cfg = _cfg(extra)
    assert cfg.pipeline.layer_split == want
    again = build_config(parse_args(to_argv(cfg), "gpt"), "gpt", 4, cuda_available=False)
    assert again.pipeline.layer_split == want and again == replace(cfg, model=replace(
        cfg.model, vocab_size=again.model.vocab_size))


def test_uneven_depth_needs_a_split_and_split_flags_do_not_mix():
    with pytest.raises(ConfigError, match="not divisible by --pipeline-model-parallel-size 3"):
        _cfg([], d=3, world=3)
    assert _cfg(["--pipeline-layer-split", "3,3,2"], d=3, world=3).pipeline.layer_split == (3, 3, 2)
    with pytest.raises(ConfigError, match="cannot be combined with --account-for-loss-in-pipeline-split"):
        _cfg(["--pipeline-layer-split", "3,2,2,1", "--account-for-loss-in-pipeline-split"])
    with pytest.raises(ConfigError, match="invalid"):
        _cfg(["--pipeline-layer-split", "3,x,2,1"])


# ---- the planner ----------------------------------------------------------------------------------

GPT2_MEDIUM = ModelConfig("gpt", 24, 1024, 16, 1024, 1024, GPT2_VOCAB)


def _slowest(costs, cand, L, cluster) -> float:
    """The slowest stage's time per microbatch, each stage priced by the cost model under ``cand``'s split."""
    d, inf = cand.pipeline_parallel, float("inf")
    return max(stage_time(costs, cand, L, r, cluster, 1e10 if r else inf, 1e10 if r < d - 1 else inf).microbatch_s
               for r in range(d))


def test_head_heavy_model_gets_a_faster_split_than_the_even_one():
    """GPT-2 vocabulary, hidden 1024, 24 layers, 8 stages: the head costs several layers."""
    costs = analytic_microbatch_costs(GPT2_MEDIUM, V100, "fp16", 1, 4)
    cand = Candidate(1, 8, 1, 4, 16, False, "2bw")
    split = balanced_split(costs, cand, 24, V100, ParamBytes())
    assert split is not None and sum(split) == 24 and split[-1] < 3
    even = _slowest(costs, cand, 24, V100)
    balanced = _slowest(costs, replace(cand, layer_split=split), 24, V100)
    print(f"\nsplit {split}: slowest stage {balanced * 1e3:.2f} ms vs even {even * 1e3:.2f} ms")
    assert balanced < even * 0.9
    assert predict(costs, replace(cand, layer_split=split), 24, V100).samples_per_sec > \
        predict(costs, cand, 24, V100).samples_per_sec


def _compositions(L: int, d: int):
    for c in itertools.product(range(L + 1), repeat=d):
        if sum(c) == L and all(n >= min_layers(r, d) for r, n in enumerate(c)):
            yield c


@pytest.mark.parametrize("d, schedule, recompute", [(3, "2bw", False), (4, "flush", True), (2, "gpipe", False)])
def test_chosen_split_is_the_brute_force_optimum(d, schedule, recompute):
    model = replace(GPT2_MEDIUM, num_layers=9)
    costs = analytic_microbatch_costs(model, V100, "fp16", 1, 2)
    cand = Candidate(1, d, 1, 2, 8, recompute, schedule)
    best = min(_slowest(costs, replace(cand, layer_split=c), 9, V100) for c in _compositions(9, d))
    split = balanced_split(costs, cand, 9, V100, ParamBytes())
    assert _slowest(costs, replace(cand, layer_split=split), 9, V100) == pytest.approx(best, rel=1e-12)


def test_split_respects_the_memory_limit_and_is_the_best_that_fits():
    """A limit that the fastest split exceeds: the chosen split is the fastest of those that fit."""
    model = replace(GPT2_MEDIUM, num_layers=10)
    costs = analytic_microbatch_costs(model, V100, "fp16", 1, 8)
    cand = Candidate(1, 4, 1, 8, 8, False, "2bw")  # 2BW: stage 0 keeps the most microbatches in flight
    pb = ParamBytes()

    def peak(c):
        return max(stage_memory(costs, replace(cand, layer_split=c), 10, r, pb).total for r in range(4))

    fastest = min(_compositions(10, 4), key=lambda c: _slowest(costs, replace(cand, layer_split=c), 10, V100))
    limit = peak(fastest) - 1
    fitting = [c for c in _compositions(10, 4) if peak(c) <= limit]
    assert fitting, "the limit must leave some split"
    best = min(_slowest(costs, replace(cand, layer_split=c), 10, V100) for c in fitting)
    split = balanced_split(costs, cand, 10, V100, pb, memory_limit=limit)
    assert peak(split) <= limit
    assert _slowest(costs, replace(cand, layer_split=split), 10, V100) == pytest.approx(best, rel=1e-12)


def test_planner_prints_the_split_and_its_command_gives_it_to_the_trainer():
    request = PlanRequest(GPT2_MEDIUM, V100, 8, 64)
    result = search(request)
    uneven = [ev for ev in result.ranked if ev.candidate.layer_split][:4]
    assert uneven, "a head-heavy model should get uneven stages"
    table, js = format_table(result, top=20), plan_json(result)
    best = result.best.candidate
    assert js["best"]["layer_split"] == (list(best.layer_split) if best.layer_split else None)
    assert format_split(uneven[0].candidate.layer_split) in table
    for ev in uneven:
        argv = pretrain_command(ev, request)
        c = ev.candidate
        assert "--pipeline-layer-split" in argv
        cfg = build_config(parse_args([*argv[1:], *TRAIN], "gpt"), "gpt", request.num_gpus, cuda_available=False)
        assert cfg.pipeline.layer_split == c.layer_split
        assert (cfg.parallel.pipeline, cfg.pipeline.micro_batch_size) == (c.pipeline_parallel, c.micro_batch_size)
    # the balanced candidate beats the same layout with even stages, as evaluated by the search
    ev = uneven[0]
    even = evaluate(replace(ev.candidate, layer_split=None), default_costs(request),
                    replace(request, balance_stages=False))
    assert ev.samples_per_sec > even.samples_per_sec


def test_simulator_takes_the_split():
    model = replace(GPT2_MEDIUM, num_layers=8)
    costs = analytic_microbatch_costs(model, V100, "fp16", 1, 4)
    cand = Candidate(1, 4, 1, 4, 8, False, "2bw")
    split = balanced_split(costs, cand, 8, V100, ParamBytes())
    even = simulate_plan(costs, cand, 8, V100).step_time_s
    balanced = simulate_plan(costs, replace(cand, layer_split=split), 8, V100).step_time_s
    print(f"\nsimulated 2BW step: even {even * 1e3:.1f} ms, split {split} {balanced * 1e3:.1f} ms")
    assert balanced < even


# ---- training: uneven pipelines match the single-process run -----------------------------------

SCHEDULES = ("2bw", "flush", "gpipe")
KW = dict(steps=6, lr=1e-3)


def _train_split(schedule: str, layout, split):
    """``pipeline_harness.train_tiny`` with the stages cut by ``split`` (the harness builds even stages)."""
    import pipeline_harness as h  # noqa: PLC0415 - inside the worker

    from megatron_2bw.models.spec import ModelSpec  # noqa: PLC0415

    saved = h.stage_range, h.ModelSpec
    h.stage_range = lambda L, d, r: stage_range(L, d, r, split)
    h.ModelSpec = functools.partial(ModelSpec, split=split)
    try:
        return h.train_tiny(schedule, layout=layout, **KW)
    finally:
        h.stage_range, h.ModelSpec = saved


def _all(layout, splits):
    return {(s, split): _train_split(s, layout, split) for split in splits for s in SCHEDULES}


@pytest.fixture(scope="module")
def reference():
    from pipeline_harness import train_tiny  # noqa: PLC0415

    return {s: train_tiny(s, **KW) for s in SCHEDULES}


@pytest.mark.parametrize("layout, splits", [
    ((1, 2, 1), [(3, 1), (0, 4), (4, 0)]),
    ((1, 4, 1), [(0, 2, 2, 0), (1, 1, 1, 1)]),
    ((1, 3, 1), [(1, 2, 1)]),
    ((2, 2, 1), [(1, 3)]),
], ids=["d2", "d4", "d3", "t2d2"])
def test_uneven_pipeline_matches_single_process(layout, splits, reference):
    from multiproc import run_workers  # noqa: PLC0415
    from test_pipeline_layouts import compare  # noqa: PLC0415

    t, d, w = layout
    outs = run_workers(_all, t * d * w, layout, splits, timeout=300)
    for split in splits:
        for s in SCHEDULES:
            dloss, dparam = compare([o[(s, split)] for o in outs], reference[s])
            print(f"{layout} {split} {s}: loss {dloss:.2e} params {dparam:.2e}")
            assert dloss < 2e-5, (split, s, dloss)
            assert dparam < 1e-4, (split, s, dparam)


def test_trainer_runs_an_uneven_split_like_the_even_one(corpus, tmp_path):  # noqa: F811
    """``pretrain_gpt.py`` on 2 processes: the split 3,1 trains exactly as the even 2,2 split, and the
    run records it (start record and checkpoint ``args``)."""
    from e2e import read_metrics, torchrun, train_args, train_losses  # noqa: PLC0415

    losses = {}
    for name, extra in (("even", ()), ("split", ("--pipeline-layer-split", "3,1"))):
        metrics = str(tmp_path / f"{name}.jsonl")
        args = train_args(corpus, preset="gpt-tiny", d=2, iters=6, extra=(
            "--log-interval", "1", "--eval-iters", "0", "--metrics-file", metrics, *extra))
        res = torchrun("pretrain_gpt.py", args, nproc=2)
        assert res.returncode == 0, res.describe()
        records = read_metrics(metrics)
        start = next(r for r in records if r["type"] == "start")
        assert start["config"]["pipeline"]["layer_split"] == ([3, 1] if extra else None)
        losses[name] = train_losses(records)
    assert losses["even"].keys() == losses["split"].keys() and len(losses["even"]) == 6
    for i, loss in losses["even"].items():
        assert abs(loss - losses["split"][i]) < 2e-5, (i, loss, losses["split"][i])


def test_auto_plan_refuses_split_flags_and_its_choice_carries_the_split():
    from megatron_2bw.planner.auto_plan import PlanChoice  # noqa: PLC0415
    from megatron_2bw.training.auto_layout import plan_layout  # noqa: PLC0415

    args = parse_args(["--model-preset", "gpt-tiny", "--auto-plan", "--global-batch-size", "8",
                       "--pipeline-layer-split", "3,1", *TRAIN], "gpt")
    with pytest.raises(ConfigError, match="--auto-plan chooses the stage split itself; drop --pipeline-layer-split"):
        plan_layout(args, "gpt", 2)
    choice = PlanChoice(1, 2, 1, 1, False, "2bw", (3, 1))
    args = parse_args(["--model-preset", "gpt-tiny", "--auto-plan", "--global-batch-size", "4", *TRAIN], "gpt")
    cfg = build_config(args, "gpt", 2, layout=choice.layout, cuda_available=False)
    assert cfg.pipeline.layer_split == (3, 1) and cfg.parallel.pipeline == 2


def test_simulate_tool_takes_a_split():
    import importlib.util  # noqa: PLC0415
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "simulate.py")
    spec = importlib.util.spec_from_file_location("tool_simulate_h13", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = ["--model-preset", "gpt-355m", "--schedule", "2bw", "--d", "4", "--m", "8", "--b", "4", "--json"]
    even = json.loads(tool.run(argv))
    balanced = json.loads(tool.run([*argv, "--pipeline-layer-split", "balanced"]))
    explicit = json.loads(tool.run([*argv, "--pipeline-layer-split", "7,7,7,3"]))
    assert balanced["step_time_s"] < 0.8 * even["step_time_s"]
    assert explicit["step_time_s"] == pytest.approx(balanced["step_time_s"])  # the planner's split is 7,7,7,3
