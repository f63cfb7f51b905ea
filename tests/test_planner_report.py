"""Output: the flags of the best configuration, JSON, the paper's comparisons, and the CLI."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_2bw.cli import model_config, parse_args
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.report import (
    BASELINES,
    PAPER_MAX_MODEL_DEPTH,
    PAPER_MAX_MODEL_PARAMETERS,
    format_paper_comparison,
    max_model_size,
    paper_comparison,
    paper_model,
    plan_json,
    pretrain_command,
)
from megatron_2bw.planner.search import PlanRequest, default_costs, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tool_plan", os.path.join(ROOT, "tools", "plan.py"))
plan = importlib.util.module_from_spec(_spec)  # loaded by path: tools/ never goes on sys.path
_spec.loader.exec_module(plan)

V100 = load_cluster("aws-p3.16xlarge")
BEST_FIELDS = {"tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch_size", "recompute",
               "schedule", "samples_per_sec", "memory_bytes_per_gpu"}


@pytest.fixture(scope="module")
def result_2p2b():
    return search(PlanRequest(paper_model("gpt-2.2b"), V100, 64, 512))


def test_pretrain_flags(result_2p2b):
    best = result_2p2b.best
    argv = pretrain_command(best, result_2p2b.request)
    assert argv[0] == "pretrain_gpt.py"
    args = parse_args([*argv[1:], "--train-iters", "1", "--lr", "1e-3"], "gpt")  # the trainer's parser
    c = best.candidate
    assert ((args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
            == (c.tensor_parallel, c.pipeline_parallel))
    assert (args.micro_batch_size, args.global_batch_size) == (c.micro_batch_size, 512)
    assert args.pipeline_schedule == c.schedule and args.recompute_activations == c.recompute and args.fp16
    m = model_config(args, "gpt")  # the trainer's model of these flags: the paper's, dropout 0.1 included
    assert m == replace(paper_model("gpt-2.2b"), vocab_size=m.vocab_size) and m.hidden_dropout == 0.1


def test_json_has_best_and_every_feasible(result_2p2b):
    data = json.loads(json.dumps(plan_json(result_2p2b)))
    assert BEST_FIELDS <= set(data["best"])
    assert len(data["ranked"]) == len(result_2p2b.ranked)
    assert all(BEST_FIELDS <= set(r) for r in data["ranked"])
    assert data["best"]["samples_per_sec"] == data["ranked"][0]["samples_per_sec"]
    assert "analytic estimate" in data["costs_source"]


def test_paper_comparison_table():
    rows = paper_comparison()
    table = format_paper_comparison(rows)
    print("\n" + table)
    assert len(rows) == 5
    for r in rows:
        assert r.best["2BW"] is not None
        scenario = f"{r.model_name} N={r.num_gpus} B={r.global_batch_size}"
        line = [x for x in table.splitlines() if x.startswith(scenario)][-1]  # its row of the speed-up table
        for system in BASELINES:
            ratio = r.ratio(system)
            if ratio is not None:
                assert ratio >= 1.0, (r.model_name, r.num_gpus, r.global_batch_size, system, ratio)
                assert f"{ratio:.2f}x" in line
    # The paper's trend: Flush closes in on 2BW as the batch (and so m) grows.
    by = {(r.model_name, r.num_gpus, r.global_batch_size): r for r in rows}
    assert by[("gpt-2.2b", 64, 2048)].ratio("PipeDream-Flush") < by[("gpt-2.2b", 64, 512)].ratio("PipeDream-Flush")


def test_max_model_grows_with_depth_and_matches_the_paper():
    rows = max_model_size(paper_model("gpt-3.8b"), V100, 64, [1, 4, 16, 64])
    sizes = [r.num_parameters for r in rows]
    print("\n" + ", ".join(f"d={r.pipeline_parallel}: {r.num_parameters / 1e9:.1f}B" for r in rows))
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    assert 15e9 <= sizes[-1] <= 60e9  # the paper: about 30B at d = 64
    assert all(r.memory_bytes_per_gpu <= V100.usable_memory_bytes for r in rows)


def test_cli_table_and_json(capsys):
    assert plan.main(["--model-preset", "gpt-2.2b", "--num-gpus", "64", "--global-batch-size", "512",
                      "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "analytic estimate" in out and "pretrain_gpt.py" in out and "--pipeline-schedule" in out
    assert plan.main(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
                      "--vocab-size", "8000", "--num-gpus", "8", "--global-batch-size", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert BEST_FIELDS <= set(data["best"]) and data["ranked"]


def test_cli_profile(tmp_path, capsys):
    req = PlanRequest(paper_model("gpt-355m"), V100, 8, 64)
    profile = tmp_path / "profile.json"
    data = default_costs(req).to_json()
    data["source"] = "unit test"
    profile.write_text(json.dumps(data))
    assert plan.main(["--model-preset", "gpt-355m", "--num-gpus", "8", "--global-batch-size", "64",
                      "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "profile" in out and "unit test" in out and "analytic" not in out


@pytest.mark.parametrize("argv, match", [
    (["--model-preset", "nope", "--num-gpus", "8", "--global-batch-size", "8"], "unknown --model-preset"),
    (["--model-preset", "gpt-355m", "--num-gpus", "8", "--global-batch-size", "8", "--cluster", "nope"],
     "unknown --cluster"),
    (["--model-preset", "gpt-355m", "--num-gpus", "8", "--global-batch-size", "8", "--profile", "/no/file.json"],
     "does not exist"),
    (["--model-preset", "gpt-355m", "--num-gpus", "0", "--global-batch-size", "8"], "must be positive"),
    (["--model-preset", "gpt-3.8b", "--num-gpus", "1", "--global-batch-size", "8"], "nothing fits"),
    (["--model-preset", "gpt-355m", "--num-gpus", "8"], "--global-batch-size is required"),
    (["--num-gpus", "8", "--global-batch-size", "8"], "give --model-preset"),
    (["--no-such-flag"], "unrecognized"),
])
def test_cli_errors(argv, match, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_cli_paper_flags_and_subprocess(capsys):
    assert plan.main(["--max-model", "--model-preset", "gpt-3.8b", "--num-gpus", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    deepest = next(r for r in rows if r["schedule"] == "2bw" and r["pipeline_parallel"] == PAPER_MAX_MODEL_DEPTH)
    assert 0.5 <= deepest["num_parameters"] / PAPER_MAX_MODEL_PARAMETERS <= 2  # the paper: about 30B at d = 64
    assert deepest["num_layers"] % PAPER_MAX_MODEL_DEPTH == 0
    # Run as a script from another directory: the installed package serves its imports.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--paper-comparison", "--json"],
                          cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    scenarios = json.loads(proc.stdout)
    assert len(scenarios) == 5
    for s in scenarios:
        assert set(s["speedup_2bw"]) == set(BASELINES)
        assert all(x is None or x >= 1.0 for x in s["speedup_2bw"].values()), s


# ---- issue 19: the memory margin, tokens/s and MFU ------------------------------------------------
H200_8B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "14336",
           "--seq-length", "4096", "--vocab-size", "128256", "--num-gpus", "64", "--cluster", "dgx-h200",
           "--precision", "bf16", "--global-batch-size", "512", "--json"]


def test_memory_margin_tokens_and_mfu(capsys):
    runs = {}
    for margin in (None, "0", "25%"):
        # --exhaustive: every plan that fits in "ranked" and "feasible" (by default only the --top ones are priced)
        assert plan.main(H200_8B + ["--exhaustive"] + ([] if margin is None else ["--memory-margin", margin])) == 0
        runs[margin] = json.loads(capsys.readouterr().out)
    usable = load_cluster("dgx-h200").usable_memory_bytes
    for margin, frac in ((None, 0.10), ("0", 0.0), ("25%", 0.25)):
        out = runs[margin]
        assert out["memory_margin"] == pytest.approx(frac)
        assert all(r["memory_bytes_per_gpu"] <= (1 - frac) * usable for r in out["ranked"])
    # without a margin some plans fill more than 90% (the newcomer's 137.23 of 137.9 GiB); the default drops them
    assert any(r["memory_bytes_per_gpu"] > 0.9 * usable for r in runs["0"]["ranked"])
    assert runs[None]["feasible"] < runs["0"]["feasible"]
    best = runs[None]["best"]
    assert best["tokens_per_sec"] == pytest.approx(best["samples_per_sec"] * 4096, rel=1e-3)
    # Megatron-LM's closed form without recomputation (MFU counts model FLOPs only) with the FFN as given (14336,
    # not 4h: config/arith.py), the vocabulary padded to a multiple of 128 (128256 = 1002 * 128 already is): per
    # layer and token 2 x 3 x (QKV 3h^2 + projection h^2 + attention 2sh + MLP 2hf), the logits 2 x 3 x hV
    L, h, s, V, f = 32, 4096, 4096, 128256, 14336
    per_sample = 6 * s * (L * (4 * h * h + 2 * s * h + 2 * h * f) + h * V)
    peak = load_cluster("dgx-h200").peak("bf16")
    assert best["mfu"] == pytest.approx(best["samples_per_sec"] * per_sample / (64 * peak), abs=1e-4)
    assert 0 < best["mfu"] < 1


def test_memory_margin_in_the_table_and_refused_out_of_range(capsys):
    assert plan.main([a for a in H200_8B if a != "--json"] + ["--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "plans keep 10% free (--memory-margin): at most 124.1 GiB" in out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    assert "tokens/s" in header and "MFU" in header
    assert plan.main(H200_8B + ["--memory-margin", "100%"]) == 2
    assert "--memory-margin must be in [0, 1)" in capsys.readouterr().err


def test_async_save_host_copy_in_the_table_and_json(capsys):
    """``--async-save``: the table's save-host column and the JSON's ``async_save_host_bytes_per_gpu`` are the
    host copy of what the rank writes: every weight version (fp16: 2 B), the fp32 master (4 B) and Adam's
    moments (8 B) of its 1/w share of the largest stage; host memory, so the device's GiB/GPU are unchanged."""
    small = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
             "--vocab-size", "8000", "--num-gpus", "8", "--global-batch-size", "32", "--schedules", "2bw,flush"]
    runs = {}
    for flag in ([], ["--async-save"]):
        assert plan.main(small + flag + ["--json"]) == 0
        runs[bool(flag)] = json.loads(capsys.readouterr().out)
    plain, saving = runs[False], runs[True]
    assert [r["memory_bytes_per_gpu"] for r in plain["ranked"]] == [r["memory_bytes_per_gpu"] for r in saving["ranked"]]
    assert all(r["async_save_host_bytes_per_gpu"] == 0 for r in plain["ranked"])
    args = plan.build_parser().parse_args(small + ["--async-save"])
    result = search(plan.plan_request(args, plan.model_from_args(args), load_cluster(args.cluster)), top=args.top)
    assert len(result.ranked) == len(saving["ranked"]) > 0
    for ev, row in zip(result.ranked, saving["ranked"]):
        c = ev.candidate
        versions = 2 if c.schedule == "2bw" and c.pipeline_parallel > 1 else 1
        want = max(-(-s.params // c.data_parallel) * (versions * 2 + 4 + 8) for s in ev.memory)
        assert row["async_save_host_bytes_per_gpu"] == want > 0, (c, row)
    assert plan.main(small + ["--async-save", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("rank"))
    col = header.index("save-host") + len("save-host")
    first = out[out.index(header) + 1]
    assert float(first[col - 9:col]) == pytest.approx(saving["ranked"][0]["async_save_host_bytes_per_gpu"] / 2**30,
                                                     abs=0.006)
    assert any(line.startswith("save-host: GiB of host (CPU) memory") for line in out)
    assert plan.main(small + ["--top", "1"]) == 0
    assert "save-host" not in capsys.readouterr().out
