"""The profiler: a small CPU profile of gpt-tiny, its JSON round trip through the planner's loader
and ``tools/plan.py --profile``, the CLI, tensor-parallel profiling, and ``auto_plan``."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.auto_plan import AutoPlan, PlanChoice, auto_plan, auto_plan_details, host_cluster
from megatron_2bw.planner.layer_costs import (
    embedding_params,
    head_params,
    layer_params,
    layer_stash_bytes,
    load_profile,
    tied_params,
    weight_grad_input_bytes,
    weight_grad_stash_bytes,
)
from megatron_2bw.planner.profiler import (
    OptimizerCost,
    Profile,
    load_full_profile,
    merge_profiles,
    profile_model,
    profile_optimizer,
    profile_tensor_parallel,
)

ROOT = os.path.join(os.path.dirname(__file__), "..")
SIZES = (1, 2)


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny() -> Profile:
    return profile_model("gpt-tiny", SIZES, device="cpu", warmup=1, reps=3)


def test_tiny_profile_measures_every_block(tiny):
    cfg = get_preset("gpt-tiny")
    s, h, e = cfg.seq_length, cfg.hidden_size, 4
    assert set(tiny.entries) == {(1, b) for b in SIZES}
    for b in SIZES:
        c = tiny.entries[(1, b)]
        for blk, n in ((c.embedding, 1), (c.layer, 2), (c.head, 1)):
            assert blk.forward_s > 0 and blk.backward_s > 0 and blk.forward_nograd_s > 0
            assert len(blk.forward_samples) == len(blk.backward_samples) == 3 * n  # 2 distinct layers in the chain
        # parameters as the planner counts them
        assert c.layer.params == layer_params(cfg, 1)
        assert c.embedding.params == embedding_params(cfg, 1)
        assert c.head.params == head_params(cfg, 1)
        assert c.tied_params == tied_params(cfg, 1)
        # boundaries: token ids in, hidden states between blocks, a scalar loss out
        assert c.embedding.input_bytes == b * s * 8 and c.embedding.output_bytes == b * s * h * e
        assert c.layer.input_bytes == c.layer.output_bytes == b * s * h * e
        assert c.head.input_bytes == b * s * h * e and c.head.output_bytes == 0
        # stashes: measured from the saved tensors; the layer's includes its input and is close to
        # the analytic count (fp32, no dropout), the head's is dominated by the fp32 softmax
        assert c.layer.stash_bytes > c.layer.input_bytes
        assert c.layer.stash_bytes == pytest.approx(layer_stash_bytes(cfg, b, 1, e), rel=0.10)
        assert c.head.stash_bytes >= 4 * b * s * cfg.padded_vocab_size(1)
        assert c.embedding.stash_bytes == 0  # token ids are its input; no dropout mask at p = 0
        # with recomputation only the input stays
        assert c.layer.recompute_stash_bytes == c.layer.input_bytes < c.layer.stash_bytes
        # the split backward: I and W timed apart; what I keeps for W is the analytic count (the output
        # gradients at the weight GEMMs and norms); the planner gets W's share of the whole backward
        for blk in (c.layer, c.head):
            assert blk.backward_input_s > 0 and blk.backward_weight_s > 0
            cost = blk.block_cost()
            assert 0 < cost.weight_grad_s < cost.backward_s
            assert cost.weight_grad_s == pytest.approx(
                blk.backward_s * blk.backward_weight_s / (blk.backward_input_s + blk.backward_weight_s), rel=1e-12)
        assert c.layer.weight_grad_stash_bytes == weight_grad_stash_bytes(cfg, b, 1, e)
        assert c.head.weight_grad_stash_bytes == b * s * h * e + e * b * s * cfg.padded_vocab_size(1)
        # and what W reads of the stash, all that stays once I has freed the rest
        assert c.layer.weight_grad_input_bytes == weight_grad_input_bytes(cfg, b, 1, e) < c.layer.stash_bytes
        assert c.head.weight_grad_input_bytes == 2 * b * s * h * e + 2 * b * s * 4 < c.head.stash_bytes
        # the embedding has no input gradient: its W is its whole backward, waiting on its output's gradient
        assert c.embedding.backward_input_s == 0 and c.embedding.backward_weight_s > 0
        assert c.embedding.block_cost().weight_grad_s == c.embedding.backward_s
        assert c.embedding.weight_grad_stash_bytes == c.embedding.output_bytes
    one, two = tiny.entries[(1, 1)], tiny.entries[(1, 2)]
    assert two.layer.stash_bytes == pytest.approx(2 * one.layer.stash_bytes, rel=0.02)
    assert tiny.optimizer is not None and tiny.optimizer.per_param_s > 0
    assert tiny.meta["device_type"] == "cpu" and "measured on" in tiny.source


def test_profile_round_trips_through_the_planner(tiny, tmp_path, capsys):
    path = tmp_path / "tiny.json"
    tiny.write(path)
    data = json.loads(path.read_text())
    assert data["format"] == "megatron_2bw-profile-v1"
    costs = load_profile(str(path))  # the teammate's loader accepts the extras
    assert dict(costs.table) == dict(tiny.layer_costs().table)
    full = load_full_profile(path)
    assert full.optimizer == tiny.optimizer
    assert full.model == get_preset("gpt-tiny")
    assert full.forward_nograd_s(1, 2, "layer") == tiny.entries[(1, 2)].layer.forward_nograd_s
    # tools/plan.py --profile FILE
    plan = _tool("plan")
    presets = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_2bw/planner/clusters")
    cluster = json.loads(open(os.path.join(presets, "aws-p3.16xlarge.json")).read())
    cpus = tmp_path / "cpus.json"  # the profile was measured on a CPU: plan for CPUs (a V100 plan is refused)
    cpus.write_text(json.dumps({**cluster, "name": "test-cpus", "device": "CPU (test host)"}))
    argv = ["--model-preset", "gpt-tiny", "--num-gpus", "4", "--global-batch-size", "16", "--precision", "fp32",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--profile", str(path), "--cluster", str(cpus)]
    assert plan.main(argv) == 0
    text = capsys.readouterr().out
    assert f"profile {path}" in text and "best configuration" in text
    assert plan.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["costs_source"].startswith(f"profile {path}")
    # the search considered only the profiled (t, b) pairs
    assert {(row["tensor_parallel"], row["micro_batch_size"]) for row in out["ranked"]} <= {(1, b) for b in SIZES}


def test_profile_tool(tmp_path, capsys):
    tool = _tool("profile_model")
    out = tmp_path / "p.json"
    assert tool.main(["--model-preset", "bert-tiny", "--micro-batch-sizes", "2", "--reps", "1", "--warmup", "0",
                      "--threads", "1", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    costs = load_profile(str(out))
    assert costs.micro_batch_sizes(1) == (2,)
    assert costs.at(1, 2).head.params == head_params(get_preset("bert-tiny"), 1)
    assert tool.main(["--model-preset", "nope", "--out", str(out)]) == 2
    assert "unknown --model-preset" in capsys.readouterr().err
    assert tool.main(["--num-layers", "2", "--out", str(out)]) == 2
    assert "missing" in capsys.readouterr().err


def test_refuses_bad_requests():
    with pytest.raises(ConfigError, match="precision"):
        profile_model("gpt-tiny", [1], dtype="fp8")
    with pytest.raises(ConfigError, match="positive"):
        profile_model("gpt-tiny", [0])
    with pytest.raises(ConfigError, match="unknown --model-preset"):
        profile_model("gpt-nope", [1])
    with pytest.raises(ConfigError, match="different models"):
        a = Profile(get_preset("gpt-tiny"))
        merge_profiles([a, Profile(get_preset("bert-tiny"))])


def test_optimizer_fit_is_linear_and_positive():
    opt = profile_optimizer((1 << 12, 1 << 16), "cpu", warmup=1, reps=3)
    assert isinstance(opt, OptimizerCost) and opt.per_param_s > 0 and opt.fixed_s >= 0
    assert opt.seconds(1 << 20) > opt.seconds(1 << 12)


def test_tensor_parallel_profile_on_two_processes():
    cfg = get_preset("gpt-tiny")
    prof = profile_tensor_parallel(cfg, 2, [1], device_type="cpu", warmup=0, reps=1, optimizer=False, timeout_s=120)
    c = prof.entries[(2, 1)]
    assert c.layer.params == layer_params(cfg, 2) and c.tied_params == tied_params(cfg, 2)
    assert c.head.params == head_params(cfg, 2)
    assert c.costs().layer.tp_allreduce_forward_bytes == 0  # included in the measured times (the schema's rule)


def test_auto_plan_profiles_once_then_reuses(tmp_path):
    cfg = get_preset("gpt-tiny")
    path = tmp_path / "auto.json"
    kw = dict(precision="fp32", max_micro_batch_size=2, warmup=0, reps=1)
    first = auto_plan_details(cfg, 4, 16, None, path, "cpu", **kw)
    assert isinstance(first, AutoPlan) and first.profiled_here and path.is_file()
    c = first.choice
    assert isinstance(c, PlanChoice) and c.t * c.d * c.w == 4 and c.b in SIZES
    assert c.schedule in ("2bw", "flush", "gpipe")
    assert c.b * first.num_micro_batches * c.w == 16
    best = first.result.best.candidate
    assert (best.tensor_parallel, best.pipeline_parallel, best.data_parallel) == (c.t, c.d, c.w)
    again = auto_plan_details(cfg, 4, 16, None, path, "cpu", **kw)
    assert not again.profiled_here and again.choice == c  # same file, same search, same answer
    t, d, w, b, recompute, schedule, split, zero, policy, context, _ = auto_plan(cfg, 4, 16, "aws-p3.16xlarge", path,
                                                                                 "cpu", **kw)
    assert t * d * w * context == 4 and (split is None or (len(split) == d and sum(split) == cfg.num_layers))
    assert "auto-plan:" in first.describe()


def test_host_cluster_on_cpu():
    cl = host_cluster(torch.device("cpu"), 4)
    assert cl.usable_memory_bytes > 0 and cl.devices_per_server == 4


def _plan_in_job(path: str) -> tuple:
    from megatron_2bw.planner.auto_plan import auto_plan_on_rank0

    cfg = get_preset("gpt-tiny")
    choice = auto_plan_on_rank0(cfg, 4, 16, None, path, "cpu", precision="fp32", max_micro_batch_size=2, warmup=0,
                                reps=1)
    try:
        auto_plan_on_rank0(cfg, 7, 16, None, path, "cpu", precision="fp32")  # 7 GPUs: no t, w or 4-layer split fits
        failed = None
    except ConfigError as exc:
        failed = str(exc)
    return tuple(choice), failed


def test_auto_plan_in_a_distributed_job_agrees_on_every_rank(tmp_path):
    from multiproc import run_workers

    path = str(tmp_path / "job.json")
    (a, fa), (b, fb) = run_workers(_plan_in_job, 2, path, timeout=120)
    assert a == b and len(a) == len(PlanChoice._fields)
    assert fa == fb and "no layout" in fa  # rank 0's error, raised on every rank


def test_simulate_tool_reads_a_profile(tiny, tmp_path, capsys):
    path = tmp_path / "tiny.json"
    tiny.write(path)
    sim = _tool("simulate")
    cpu = ["--cluster", "cpu-host"]  # a CPU profile prices a CPU cluster (an H200 one is refused)
    assert sim.main(["--schedule", "flush", "--d", "2", "--m", "4", "--b", "2", "--profile", str(path), *cpu,
                     "--recompute", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] > 0 and out["costs_source"].startswith(f"profile {path}")
    assert out["micro_batch_size"] == 2 and len(out["peak_bytes"]) == 2
    assert sim.main(["--schedule", "flush", "--d", "2", "--m", "4", "--b", "8", "--profile", str(path), *cpu]) == 2
    assert "no b=8" in capsys.readouterr().err
