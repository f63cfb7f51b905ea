"""Smoke tests of benchmarks/convergence.py (--quick: two seeds x two real 10-step trainer runs) and of
benchmarks/report.py --from-json (markdown and plots from small fake JSON files). Losses and
timings are not judged here: the quick model is too small and the machine is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _run(cmd, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[1]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_convergence_quick(tmp_path, study_data_dir):
    js, png = tmp_path / "conv.json", tmp_path / "conv.png"
    seeds = [1234, 7]
    _run([sys.executable, os.path.join(BENCH, "convergence.py"), "--quick", "--json", str(js), "--png", str(png),
          "--seeds", *map(str, seeds), "--out-dir", str(tmp_path / "runs"), "--data-dir", study_data_dir],
         timeout=150)
    data = json.loads(js.read_text())
    assert png.is_file() and png.stat().st_size > 1000
    assert {r["schedule"] for r in data["runs"]} == {"2bw", "flush"}
    assert sorted((r["seed"], r["schedule"]) for r in data["runs"]) == [(s, k) for s in sorted(seeds)
                                                                         for k in ("2bw", "flush")]
    for r in data["runs"]:
        for key in ("schedule", "seed", "final_valid_loss", "final_train_loss", "steps", "seconds", "time_to_loss"):
            assert key in r, key
        assert r["steps"] == 10
        assert r["seconds"] > 0
        assert 0 < r["final_valid_loss"] < 20 and 0 < r["final_train_loss"] < 20
        assert set(r["time_to_loss"]) == {"target", "seconds", "step"}
        assert len(r["curve"]["step"]) == 10 and r["valid"]["step"] == [5, 10]
    # every reported loss is the trainer's own, read back from the metrics file it wrote
    valid_of = {}
    for r in data["runs"]:
        records = [json.loads(line) for line in open(os.path.join(ROOT, r["metrics_file"]), encoding="utf-8")]
        train = [x["loss"] for x in records if x["type"] == "train"]
        valid = [x["loss"] for x in records if x["type"] == "eval" and x["split"] == "valid"]
        assert len(train) == r["steps"] and r["curve"]["train_loss"] == train
        assert r["final_valid_loss"] == valid[-1]
        valid_of[(r["seed"], r["schedule"])] = valid[-1]
    ratios = [valid_of[(s, "2bw")] / valid_of[(s, "flush")] for s in seeds]
    assert data["valid_loss_ratio_per_seed"] == pytest.approx(ratios, rel=1e-12)
    assert data["valid_loss_ratio_2bw_over_flush"] == pytest.approx(sum(ratios) / 2, rel=1e-12)
    flush = [valid_of[(s, "flush")] for s in seeds]
    assert data["flush_seed_spread"] == pytest.approx(abs(flush[0] - flush[1]) / (sum(flush) / 2), rel=1e-12)
    assert data["flush_seed_spread"] > 0  # different seeds: different initialization, data order and validation draw
    for seed in seeds:  # the target is defined on the same seed's flush run, so flush always reaches it
        by = {r["schedule"]: r for r in data["runs"] if r["seed"] == seed}
        assert by["flush"]["time_to_loss"]["step"] is not None
        assert by["2bw"]["time_to_loss"]["target"] == by["flush"]["time_to_loss"]["target"]
    assert data["lr_sweep"][0]["valid_loss_ratio_2bw_over_flush"] == pytest.approx(ratios[0], rel=1e-12)  # first seed
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["d"] == 2 and cfg["seeds"] == seeds and cfg["seed"] == seeds[0]
    assert cfg["valid_sequences"] == cfg["eval_iters"] * cfg["global_batch"]


def _fake_jsons(d):
    machine = {"cpu": "Fake CPU @ 1 GHz", "logical_cpus": 2, "cpus_usable": 2, "loadavg_at_start": [0.1, 0.2, 0.3],
               "platform": "Linux", "python": "3.12.0", "torch": "2.x", "torch_threads_per_process": 1,
               "date_utc": "2025-01-01T00:00:00Z", "elapsed_s": 12.0}
    results = []
    sps = {"single": 10.0, "engine_d1": 9.8, "2bw": 19.0, "flush": 15.0, "gpipe": 14.5, "torch_1f1b": 14.0,
           "torch_gpipe": 14.0}
    ideal = {"single": 1.0, "engine_d1": 1.0, "2bw": 2.0}
    for m in (4, 8):
        for s, v in sps.items():
            row = dict(system=s, d=1 if s in ("single", "engine_d1") else 2, m=m, samples_per_sec=v,
                       speedup_vs_single=v / 10.0, ratio_vs_torch_1f1b=v / 14.0,
                       ideal_vs_single=ideal.get(s, 2 * m / (m + 1)), ideal_vs_torch_1f1b=1.25,
                       wall_speedup_vs_single=v / 10.5, speedup_vs_single_min=v / 11, speedup_vs_single_max=v / 9,
                       speedup_vs_single_per_round=[v / 10.0], ratio_vs_torch_1f1b_per_round=[v / 14.0], rounds=1,
                       foreign_load_cpus=0.1, quiet_rounds=1, quiet_speedup_vs_single=v / 10.0,
                       quiet_ratio_vs_torch_1f1b=v / 14.0, compared_in_world_d=2)
            if s == "engine_d1":
                row["overhead_vs_single_pct"] = 2.0
            results.append(row)
    (d / "throughput.json").write_text(json.dumps({
        "results": results, "machine": machine, "executor_overhead_d1_pct": {"4": 2.0, "8": 2.0},
        "config": {"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                             "vocab_size": 256}, "micro_batch": 2, "d": [2], "m": [4, 8], "rounds": 1, "quick": True},
        "per_d": {"2": {"stage_compute_ms_per_microbatch": [5.0, 6.0], "balance_ceiling_vs_single": 1.83,
                        "foreign_load_cpus_per_round": [0.1], "waiting_ranks_cpu_share": 0.01, "records": []}}}))
    mem = []
    for s in ("2bw", "flush", "gpipe"):
        for rc in (False, True):
            for st in (0, 1):
                mem.append(dict(d=2, m=4, schedule=s, recompute=rc, stage=st, weight_versions=2 if s == "2bw" else 1,
                                max_inflight=2 - st, expected_inflight=2 - st, measured_weight_bytes=2**20,
                                paper_weight_bytes=2**20, measured_stash_bytes=3 * 2**20,
                                paper_activation_bytes=4 * 2**20, exact_activation_bytes=3 * 2**20,
                                A_input_bytes=2**18, A_stage_bytes=2**20, W_version_bytes=2**19,
                                measured_over_exact=1.0, measured_over_paper=0.75))
    (d / "memory.json").write_text(json.dumps({"results": mem, "machine": machine,
                                               "config": {"model": {"num_layers": 4, "hidden_size": 64,
                                                                    "seq_length": 32},
                                                          "micro_batch": 2, "steps": 2, "precision": "fp32"}}))
    runs = []
    for seed, s, end in ((1234, "2bw", 5.05), (1234, "flush", 5.0), (5678, "2bw", 5.151), (5678, "flush", 5.1)):
        losses = [6.0 - 0.1 * i for i in range(10)]
        runs.append(dict(schedule=s, seed=seed, final_valid_loss=end, final_train_loss=5.2, steps=10, seconds=1.0,
                         wall_seconds=5.0, samples_per_sec_median=40.0, foreign_load_cpus=0.1,
                         time_to_loss={"target": 5.46, "step": 7, "seconds": 0.7},
                         curve={"step": list(range(1, 11)), "seconds": [0.1 * i for i in range(1, 11)],
                                "train_loss": losses, "train_loss_smoothed": losses},
                         valid={"step": [5, 10], "loss": [5.5, end], "seconds": [0.5, 1.0]}))
    (d / "convergence.json").write_text(json.dumps({
        "lr_sweep": [{"lr": lr, "min_lr": lr / 10, "valid_loss_ratio_2bw_over_flush": 1.01,
                      "runs": [dict(r, curve={"step": r["curve"]["step"],
                                              "train_loss_smoothed": r["curve"]["train_loss"]})
                               for r in runs[:2]]} for lr in (1e-3, 2e-3)],
        "runs": runs, "valid_loss_ratio_2bw_over_flush": 1.01, "valid_loss_ratio_per_seed": [1.01, 1.01],
        "flush_seed_spread": 0.1 / 5.05,
        "seed_noise": {"seeds": [1234, 5678], "valid_loss_ratio_mean": 1.01, "ratio_spread": 0.0,
                       "per_seed": [{"seed": 1234, "final_valid_loss": {"2bw": 5.05, "flush": 5.0},
                                     "valid_loss_ratio_2bw_over_flush": 1.01},
                                    {"seed": 5678, "final_valid_loss": {"2bw": 5.151, "flush": 5.1},
                                     "valid_loss_ratio_2bw_over_flush": 1.01}],
                       "mean_final_valid_loss": {"2bw": 5.1005, "flush": 5.05}, "flush_seed_spread": 0.1 / 5.05,
                       "2bw_seed_spread": 0.101 / 5.1005, "gap_above_noise": False},
        "exploration": [{"label": "fake short warm-up", "global_batch": 4, "iters": 10, "warmup": 1, "lr": 2e-3,
                         "seed": 1234, "valid_sequences": 8, "valid_2bw": 5.3, "valid_flush": 5.0,
                         "note": "fake miss"}],
        "train_time_speedup_2bw_vs_flush": 1.2,
        "time_to_loss_speedup_2bw_vs_flush": 1.1, "machine": machine,
        "config": {"preset": "gpt-tiny", "seq": 32, "micro_batch": 2, "m": 2, "global_batch": 4, "iters": 10,
                   "eval_interval": 5, "eval_iters": 2, "log_interval": 5, "lr": 2e-3, "min_lr": 2e-4, "warmup": 2,
                   "weight_decay": 0.01, "clip_grad": 1.0, "precision": "fp32", "seed": 1234, "data": "x",
                   "vocab": 500, "smooth_window": 3, "target_factor": 1.05, "quick": True, "seeds": [1234, 5678],
                   "valid_sequences": 8}}))
    (d / "gpu.json").write_text(json.dumps({
        "skipped": False, "machine": dict(machine, device="NVIDIA H200", peak_bf16_flops=989e12),
        "config": {"m": 4, "steps": 8, "warmup": 3, "kernels": "torch", "flops_per_token": "6N + 12 L s h"},
        "results": [dict(model="gpt-355m", system="plain", params=355_000_000, micro_batch=8, m=4, seq=512,
                         dtype="bf16", tokens_per_sec=60000.0, model_tflops_per_sec=140.0, mfu=0.14,
                         peak_memory_GiB=20.0),
                    dict(model="gpt-1.3b", system="plain", error="out of memory: fake")]}))


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row (separator rows left out)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_report_from_json(tmp_path):
    jd = tmp_path / "json"
    jd.mkdir()
    _fake_jsons(jd)
    doc, img = tmp_path / "bench.md", tmp_path / "img"
    _run([sys.executable, os.path.join(BENCH, "report.py"), "--from-json", str(jd), "--doc", str(doc),
          "--img-dir", str(img)], timeout=60)
    text = doc.read_text()
    rows = _table_rows(text)
    first = {r[0]: r for r in rows}
    # inputs passed through: the machine, the GPU device and its failed model
    assert "Fake CPU @ 1 GHz" in first["throughput"] and "NVIDIA H200" in text
    assert first["gpt-1.3b"][-1] == "out of memory: fake"
    # ratios the report derives, against the same division done here on the fake inputs
    gpipe = [r for r in rows if r[0].startswith("GPipe (ours) vs torch ScheduleGPipe, m=")]
    assert [r[2] for r in gpipe] == [f"{14.5 / 14.0:.3f}"] * 2
    for seed, v2, vf in ((1234, 5.05, 5.0), (5678, 5.151, 5.1)):  # per-seed final valid losses and their ratio
        assert [str(seed), f"{v2:.4f}", f"{vf:.4f}", f"{v2 / vf:.4f}"] in rows
    assert ["mean", f"{(5.05 + 5.151) / 2:.4f}", f"{(5.0 + 5.1) / 2:.4f}", "1.0100"] in rows
    assert f"{0.1 / 5.05:.4f}" in [r[2] for r in rows if len(r) > 2]  # the Flush seed-to-seed spread
    for lr in ("0.001", "0.002 (above)"):  # the learning-rate sweep, both rates
        assert first[lr][2:5] == ["5.0500", "5.0000", "1.0100"]
    explored = first["fake short warm-up"]
    assert explored[7:11] == ["5.3000", "5.0000", f"{5.3 / 5.0:.4f}", "**FAIL**"]  # 1.06 misses the 1.01 target
    gpu = first["gpt-355m"]
    assert gpu[5:9] == ["60000", "140.0", "0.140", "20.0"]  # the GPU benchmark's numbers, as it measured them
    conv = text[text.index("## 3. Convergence"):text.index("## 4.")]
    assert "**FAIL**" in conv  # only the exploration row that misses 1%
    rest = text.replace(conv, "")
    assert "**pass**" in rest and "**FAIL**" not in rest  # every other fake number meets its target
    for name in ("throughput", "memory", "convergence"):
        assert (img / f"{name}.png").is_file(), name
        assert f"img/{name}.png" in text, name
    assert (img / "convergence_lr.png").is_file() and "img/convergence_lr.png" in text


def test_report_from_json_missing_pieces(tmp_path):
    jd = tmp_path / "json"
    jd.mkdir()
    _fake_jsons(jd)
    os.remove(jd / "throughput.json")
    os.remove(jd / "gpu.json")
    (jd / "status.json").write_text(json.dumps({"throughput": {"ok": False, "error": "exit status 1: boom",
                                                               "log": "x.log"}}))
    doc = tmp_path / "bench.md"
    _run([sys.executable, os.path.join(BENCH, "report.py"), "--from-json", str(jd), "--doc", str(doc)], timeout=60)
    text = doc.read_text()
    assert "`throughput` failed (exit status 1: boom)" in text
    assert "Not run here: no GPU JSON" in text
    assert "Convergence" in text
