"""Smoke test of the benchmarks: each CPU benchmark runs with its tiniest settings and writes the
JSON schema its README documents. Timings are not checked (the CI machine is shared and noisy)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
# benchmarks/ is a directory of scripts, not a package: they import their sibling ``common``, and the
# processes they spawn import the script's module by name, so the directory itself goes on the path.
sys.path.insert(0, BENCH)

import gpu  # noqa: E402
import memory  # noqa: E402
import pipeline_throughput  # noqa: E402
import throughput_summary  # noqa: E402
import throughput_systems  # noqa: E402

from megatron_2bw.tensor_parallel.gemm import SEAM_NODE  # noqa: E402

pytestmark = pytest.mark.usefixtures("forked_bench_workers")  # conftest.py: workers forked, not spawned


def _load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_pipeline_throughput_quick(tmp_path):
    out = tmp_path / "throughput.json"
    assert pipeline_throughput.main(["--quick", "--json", str(out)]) == 0
    data = _load(out)
    assert {"results", "machine", "config"} <= set(data)
    rows = data["results"]
    skipped = {k.split()[0] for where in data["skipped"].values() for k in where}
    # every registry schedule and every torch system is measured unless it says why it cannot run
    assert {r["system"] for r in rows} == set(pipeline_throughput.SYSTEMS) - skipped
    assert {"2bw", "flush", "gpipe", "torch_1f1b", "torch_interleaved_1f1b", "torch_zbv"} <= {r["system"] for r in rows}
    for r in rows:
        for key in ("system", "d", "m", "samples_per_sec", "speedup_vs_single", "ratio_vs_torch_1f1b"):
            assert key in r, key
        assert r["samples_per_sec"] > 0
        assert r["d"] == (1 if r["system"] in ("single", "engine_d1") else 2)
        assert r["m"] == 4
        if r["d"] == 2:  # each stage's measured bubble over its steady window, beside the schedule's ideal
            assert len(r["bubble_per_stage"]) == 2 and all(0.0 <= x <= 1.0 for x in r["bubble_per_stage"]), r
            assert 0.0 <= r["ideal_bubble"] < 1.0
    flush = next(r for r in rows if r["system"] == "flush")
    assert flush["ideal_bubble"] == pytest.approx(1 / 5) and flush["torch_counterpart"] == "torch_1f1b"
    assert len(flush["idle_wait_per_stage"]) == 2  # ours: the executor's receive and update waits too
    # the ceiling against 2BW: 2BW's busiest rank's compute over flush's, same round, times 1 - flush's ideal
    two = next(r for r in rows if r["system"] == "2bw")
    assert two["ceiling_vs_2bw"] is None and flush["ceiling_vs_2bw_per_round"] == [flush["ceiling_vs_2bw"]]
    assert flush["ceiling_vs_2bw"] == pytest.approx(
        max(two["compute_ms_per_microbatch_per_stage"]) / max(flush["compute_ms_per_microbatch_per_stage"]) * 0.8)
    single = next(r for r in rows if r["system"] == "single")
    assert single["speedup_vs_single"] == pytest.approx(1.0)
    t1 = next(r for r in rows if r["system"] == "torch_1f1b")
    assert t1["ratio_vs_torch_1f1b"] == pytest.approx(1.0)
    assert "4" in data["executor_overhead_d1_pct"]
    assert data["machine"]["torch_threads_per_process"] == 1


def test_memory_quick(tmp_path):
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--json", str(out)]) == 0
    rows = _load(out)["results"]
    want = {(s, rc) for s in memory.SCHEDULES for rc in (False, True)}
    assert {(r["schedule"], r["recompute"]) for r in rows} == want
    for r in rows:
        assert r["d"] == 2 and r["stage"] in (0, 1)
        assert r["weight_versions"] == (2 if r["schedule"] == "2bw" else 1)
        assert r["measured_weight_bytes"] == r["paper_weight_bytes"]
        assert r["measured_stash_bytes"] > 0
        assert r["max_inflight"] == r["expected_inflight"]
        for key in ("paper_activation_bytes", "exact_activation_bytes", "A_input_bytes", "A_stage_bytes"):
            assert r[key] > 0, key


def test_gpu_skips_or_runs_tiny(tmp_path):
    out = tmp_path / "gpu.json"
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: run benchmarks/gpu.py by hand")
    assert gpu.main(["--json", str(out)]) == 0
    assert _load(out)["skipped"] is True
    assert gpu.main(["--allow-cpu", "--steps", "1", "--warmup", "1", "--json", str(out)]) == 0
    rows = _load(out)["results"]
    assert {r["system"] for r in rows} == {"engine_flush_d1", "engine_2bw_d1", "plain"}
    assert all(r["tokens_per_sec"] > 0 for r in rows)
    from megatron_2bw.config.arith import flops_per_step
    from megatron_2bw.config.presets import get_preset

    for r in rows:  # the trainer's FLOP formula (review S3/B1)
        fps = flops_per_step(get_preset(r["model"]), r["micro_batch"] * r["m"])
        assert r["model_tflops_per_sec"] == pytest.approx(r["steps"] * fps / r["seconds"] / 1e12, rel=1e-9)


def test_stale_rule_reference_quick(tmp_path):
    """The plain-PyTorch 1-stale reference runs on any indexed dataset; the two rules start identical."""
    import numpy as np
    import stale_rule_reference

    from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

    prefix = str(tmp_path / "toks")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16) as b:
        for _ in range(20):
            b.add_item(rng.integers(0, 100, 50))
            b.end_document()
        b.finalize(index_file_path(prefix))
    out = tmp_path / "stale.json"
    args = ["--quick", "--data", prefix, "--vocab", "100", "--lr", "1e-3", "--json", str(out)]
    assert stale_rule_reference.main(args) == 0
    (row,) = _load(out)["results"]
    assert row["lr"] == 1e-3
    plain, stale = row["plain"]["final_valid_loss"], row["stale"]["final_valid_loss"]
    assert 0 < plain < 10 and 0 < stale < 10 and plain != stale  # the stale rule really differs
    assert row["valid_loss_ratio_stale_over_plain"] == pytest.approx(stale / plain)
    with pytest.raises(SystemExit, match="no indexed dataset"):
        stale_rule_reference.main(["--quick", "--data", str(tmp_path / "missing")])


def test_memory_states_quick(tmp_path):
    """Weights, gradients, master and Adam state of real stages at w = 2 (one 2-process launch): each
    equal to the closed form within 2%, the distributed optimizer's shards padded to ceil(N/2)."""
    out = tmp_path / "states.json"
    assert memory.main(["--states", "--quick", "--w", "2", "--json", str(out)]) == 0
    data = _load(out)
    rows = data["states"]
    assert {(r["precision"], r["distributed_optimizer"]) for r in rows} == {
        (p, z) for p in ("fp32", "bf16") for z in (False, True)}
    assert data["within_2_percent"] and data["largest_rel_diff"]["formula"] <= 0.02
    for r in rows:
        n, half = r["numel"], r["precision"] == "bf16"
        shard = -(-n // 2) if r["distributed_optimizer"] else n
        assert r["optimizer_state"] == 8 * shard and r["master"] == (4 * shard if half else 0)
        assert r["grads"] == (2 if r["schedule"] == "2bw" else 1) * 4 * n  # fp32 gradients, bf16 included
    assert any(r["numel"] % 2 for r in rows)  # an odd N: the last shard is padded


def test_memory_sequence_parallel_quick(tmp_path):
    """The SP stash at t = 2, d = 2 (one 4-process launch, attention and hidden dropout on: torch's CPU math
    path and its dtype-sized masks): each stage's stash with and without --sequence-parallel, and what it saves,
    within 10% of the planner's (measured: within 2%)."""
    out = tmp_path / "sp.json"
    assert memory.main(["--sequence-parallel", "--quick", "--dropout", "0.1", "--json", str(out)]) == 0
    rows = _load(out)["sequence_parallel"]
    assert {(r["stage"], r["sequence_parallel"]) for r in rows} == {
        (k, sp) for k in (0, 1) for sp in (False, True, "saving")}
    for r in rows:
        assert r["t"] == 2 and r["d"] == 2 and r["measured_stash_bytes"] > 0
        assert abs(r["measured_over_planner"] - 1) <= 0.10, r
    on = {r["stage"]: r["measured_stash_bytes"] for r in rows if r["sequence_parallel"] is True}
    off = {r["stage"]: r["measured_stash_bytes"] for r in rows if r["sequence_parallel"] is False}
    assert all(on[k] < 0.85 * off[k] for k in on)  # SP stashes less on every stage


def test_gpu_check_cpu_form(tmp_path, capsys):
    """``benchmarks/gpu_check.py --allow-cpu``: the acceptance script's code runs on the CPU (tiny model) and
    says which checks need a GPU; its JSON goes where --out says."""
    import gpu_check
    import torch

    from megatron_2bw.config.arith import flops_per_step
    from megatron_2bw.config.presets import get_preset

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check.py runs its GPU form there (by hand, not in CI)")
    out = tmp_path / "out" / "gpu_check.json"
    t0 = time.perf_counter()
    rc = gpu_check.main(["--allow-cpu", "--out", str(out)])
    assert time.perf_counter() - t0 < 120  # the CPU form stays CI-sized
    data = _load(out)
    assert data["complete"] and os.listdir(tmp_path / "out") == ["gpu_check.json"]  # no temporary left beside it
    repo = os.path.dirname(BENCH)
    assert not os.path.abspath(gpu_check.DEFAULT_OUT).startswith(repo + os.sep)  # never the repository by default
    checks = {c["check"]: c for c in data["checks"]}
    failed = {k for k, c in checks.items() if c["status"] == gpu_check.FAIL}
    assert rc == (1 if failed else 0) and data["ok"] == (not failed)
    assert not failed, {k: checks[k]["detail"] for k in failed}  # the fp16 large-gradient step too (S1's fp32 norms)
    needs = {k for k, c in checks.items() if c["status"] == gpu_check.NEEDS_GPU}
    assert needs == {"checkpoint save device memory gpt-tiny bf16", "checkpoint resume device memory gpt-tiny bf16",
                     "d=2 w=1 2bw+distopt", "d=2 w=1 2bw+distopt CUDA_DEVICE_MAX_CONNECTIONS=1",
                     "queue probe CUDA_DEVICE_MAX_CONNECTIONS=unset", "queue probe CUDA_DEVICE_MAX_CONNECTIONS=1",
                     "async staging pinned exact", "allocator retry sync PYTORCH_CUDA_ALLOC_CONF=unset",
                     "allocator retry sync PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                     "prefetch h2d gpt-tiny b=2 s=64", "compute on fewer SMs", "update wait gpu backlog",
                     "tied embedding d=2 last stage", "reserve outside the allocator",
                     "d=2 settle rule cost"}
    assert checks["environment"]["torch"] == torch.__version__
    sdpa = [c for k, c in checks.items() if k.startswith("sdpa ")]
    assert len(sdpa) == 2 * 2 * 2 * 3 and all(c["kernel"] for c in sdpa)  # shapes x masks x dtypes x backends
    refused = {c["check"] for c in sdpa if c["refused"]}
    assert "sdpa llama-gqa mask bf16 fused" in refused and "sdpa gpt-mha mask bf16 fused" not in refused
    assert checks["trainer torch_dist async save and resume"]["detail"].startswith("not run in the CPU form")
    for model in ("gpt-tiny", "llama-tiny"):  # N11: split backward equals the whole one; what took the fused path
        row = checks[f"split backward {model} fp32"]
        assert row["status"] == gpu_check.PASS and row["max_rel_diff"] <= 1e-5
        # the linear layers' GEMMs are the seam's node (tensor_parallel/gemm.py), not aten's mm/addmm
        assert row["tally"].get(f"{SEAM_NODE} fused", 0) > 0 and sum(row["tally"].values()) > 0
    for schedule in ("flush", "2bw"):  # the trainer's configuration: fp32 gradients, saved-tensor hooks on
        row = checks[f"trainer stage gpt-tiny fp32 {schedule}"]
        assert row["status"] == gpu_check.PASS and row["grads"] == "fp32" and row["planner_GiB"] > 0
    assert "not checked on this machine (need a GPU): " in capsys.readouterr().out
    trains = [c for k, c in checks.items() if k.startswith("train gpt-tiny fp32 ")]
    assert {c["check"].split()[-1] for c in trains} == {"plain", "engine_flush_d1", "engine_2bw_d1"}
    fps = flops_per_step(get_preset("gpt-tiny"), 2 * 2)  # b = 2, m = 2 on the CPU
    for c in trains:
        steps_per_s = c["tokens_per_sec"] / (2 * 2 * get_preset("gpt-tiny").seq_length)
        assert c["tflops_per_device"] == pytest.approx(steps_per_s * fps / 1e12, rel=1e-9)
    assert checks["recompute replay gpt-tiny fp32"]["status"] == gpu_check.PASS
    assert checks["checkpoint resume gpt-tiny bf16"]["status"] == gpu_check.PASS
    # P4: the prefetching provider's batches equal the direct ones, every one after the first served ahead
    assert checks["prefetch batches gpt-tiny b=2 s=64"]["detail"].startswith("12 microbatches with prefetch == without")
    assert checks["update wait gpu backlog"]["steps"]["0.0"]["update_wait_s"] >= 0  # P3: the code ran


def test_gpu_check_training_rows_hold_the_budget(monkeypatch):
    """Review 3 G12: a training row checks the budget before each of its systems (a 1.3B system runs about a
    minute), so the script ends within a system of ``--budget-s``; a system past it is one info row, not run."""
    import gpu_check
    import torch

    from megatron_2bw.fused import select_kernels

    ran = []
    monkeypatch.setattr(gpu_check.gpu, "run_plain", lambda *a, **k: ran.append("plain"))
    monkeypatch.setattr(gpu_check.gpu, "run_engine", lambda *a, **k: ran.append("engine"))
    rows = gpu_check.check_training("gpt-tiny", "fp32", torch.device("cpu"), 1, 1, 2, select_kernels("auto", "cpu"),
                                    None, deadline=time.perf_counter() - 1)
    assert not ran and [r["status"] for r in rows] == ["info"] * 3
    assert all("budget is spent" in r["detail"] for r in rows)
    assert gpu_check.BUDGET_S + 60 <= 420  # a system or a section past the budget still ends within the call


def test_gpu_check_settle_cost_worker_on_the_cpu():
    """The device script's G6 row unwires the settle rule in its worker, not in the library: on gloo (where the rule
    does nothing) the losses are the same bitwise with and without it, and each rank times every update."""
    import gpu_check

    from megatron_2bw.local_workers import run_workers

    got = {settle: run_workers(gpu_check._d2_worker, 2, 1, 3, "gpt-tiny", settle, False, timeout=300)
           for settle in (True, False)}
    for settle, ranks in got.items():
        assert all(len(times) == 3 and times == sorted(times) for _, times in ranks), settle
        assert len(ranks[-1][0]) == 3 and all(math.isfinite(x) for x in ranks[-1][0])  # the last stage's losses
    assert got[True][-1][0] == got[False][-1][0]


def test_moe_shared_overlap_quick(tmp_path):
    """The shared-expert overlap benchmark at tiny sizes: its schema, every time positive, one ratio per round."""
    import moe_shared_overlap

    out = tmp_path / "mso.json"
    assert moe_shared_overlap.main(["--tokens", "64", "--hidden", "32", "--moe-ffn-hidden-size", "32",
                                    "--moe-shared-expert-intermediate-size", "64", "--calls", "2", "--rounds", "2",
                                    "--json", str(out)]) == 0
    data = _load(out)
    assert len(data["speedup_per_round"]) == 2 and data["speedup"] > 0
    assert data["with_s"] > 0 and data["without_s"] > 0 and data["alltoall_s_per_call"] > 0
    assert data["shared_s_per_call"] > 0 and data["config"]["ep"] == 2


def test_muon_throughput_quick(tmp_path):
    """Muon vs AdamW (update, 2BW step at d = 2) and the t = 2 gather vs distributed Newton-Schulz: the schema,
    and the two TP variants compute the same orthogonalization (to bf16 precision)."""
    import muon_throughput

    out = tmp_path / "muon.json"
    assert muon_throughput.main(["--preset", "gpt-tiny", "--seq", "16", "--reps", "1", "--steps", "1", "--rounds", "1",
                                 "--m", "2", "--json", str(out)]) == 0
    data = _load(out)
    assert {(r["stage"], r["optimizer"]) for r in data["update"]} == {(s, o) for s in (0, 1) for o in ("adam", "muon")}
    assert all(r["update_s"] > 0 for r in data["update"]) and set(data["step_s_2bw_d2"]) == {"adam", "muon"}
    muon = [r for r in data["update"] if r["optimizer"] == "muon"]
    adam = [r for r in data["update"] if r["optimizer"] == "adam"]
    assert all(m["state_bytes"] < a["state_bytes"] for m, a in zip(muon, adam))  # no second moment on the matrices
    tp = data["tp2_one_layer"]
    assert {"gather", "distributed", "allgather_only", "local"} <= set(tp)
    assert tp["max_rel_diff_gather_vs_distributed"] < 0.1


def test_init_memory_quick(tmp_path):
    import init_memory

    out = tmp_path / "init.json"
    assert init_memory.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["d1 cpu-init", "t2 rank0 per-partition"]
    whole, shard = rows
    assert 0.4 < shard["params"] / whole["params"] < 0.6  # a tensor rank builds about half the model
    assert all(r["host_peak_added_bytes"] > 0 and r["buffer_bytes"] > 0 for r in rows)


def test_benchmarks_doc_answers_from_every_saved_run():
    """docs/benchmarks.md opens with the user's questions, each figure beside its stage-split ceiling and its JSON;
    a target an older run missed and a newer one meets is judged by the newer (issue 19)."""
    import answers

    data = os.path.join(os.path.dirname(BENCH), "docs", "data")
    rows, facts = answers.speed_rows(data, lambda name: name)
    files = {fct["file"] for fct in facts}
    assert files == {"throughput.json", "throughput_split.json", "throughput_split_m4.json"}
    with open(os.path.join(data, "throughput.json")) as fh:
        old = json.load(fh)
    cap = old["per_d"]["2"]["balance_ceiling_vs_single"]
    first = next(fct for fct in facts if fct["file"] == "throughput.json" and fct["m"] == 4)
    assert first["ceiling"] == pytest.approx(cap) and 1.8 < cap < 1.85  # the split's 1.83x, not 2.0
    verdicts = answers.newest_verdicts(facts, 1.8)
    m4 = next(v for v in verdicts if v.startswith("- gpt-4x256, uniform split, m = 4:"))
    assert "**meets**" in m4 and "throughput_split.json" in m4  # 1.635 in throughput.json, 1.816 later
    text = answers.answers_section(data, lambda name: f"data/{name}")
    for question in ("How much faster than Flush and torch?", "At what memory?", "At what loss?"):
        assert f"### {question}" in text
    for name in ("log_interval.json", "memory_states.json", "convergence_regimes.json", "memory.json"):
        assert f"(data/{name})" in text


def test_checkpoint_io_quick(tmp_path):
    """Every format saves and resumes the same state (the benchmark's own check), and the state's
    arithmetic matches the buffers: Flush, bf16 weights with an fp32 master, plain SGD = 6 B/param."""
    import checkpoint_io

    out = tmp_path / "ckpt.json"
    assert checkpoint_io.main(["--quick", "--schedule", "flush", "--optimizer", "sgd", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["rank"], r["format"]) for r in data["rows"]] == [(r, f) for r in (0, 1) for f in checkpoint_io.FORMATS]
    assert all(r["resume_matches_save"] for r in data["rows"])
    for rank in data["ranks"]:
        st = rank["state"]
        assert st["state_bytes_per_param"] == 6 and st["state_bytes"] == 6 * st["params"]
    # the first stage writes all it holds: its async host copy is its state, byte for byte
    first = next(r for r in data["rows"] if r["rank"] == 0 and r["format"] == "torch_dist_async")
    assert first["staging_over_state"] == 1.0


def test_ceiling_vs_2bw_is_the_compute_ratio_less_the_ideal_bubble():
    """zb-v's rank 0 computing 80 ms per microbatch where 2BW's busiest stage computes 77, with its ideal 0.04
    bubble at d = 2, m = 4: at best 77/80 * 0.96 of 2BW, whatever the executor does."""
    assert throughput_summary.ceiling_vs_2bw([80.0, 72.0], [68.0, 77.0], 0.04) == pytest.approx(77 / 80 * 0.96)
    assert throughput_summary.ceiling_vs_2bw([80.0, 72.0], None, 0.04) is None
    assert throughput_summary.ceiling_vs_2bw([80.0, None], [68.0, 77.0], 0.04) is None


def test_pipeline_throughput_pairs_each_schedule_with_torchs_counterpart():
    order = throughput_systems.paired_order(throughput_systems.SYSTEMS)
    assert sorted(order) == sorted(throughput_systems.SYSTEMS)
    for ours, twin in throughput_systems.COUNTERPART.items():
        if ours in order and twin in order:
            assert order.index(twin) == order.index(ours) + 1, (ours, twin)
    entries = [(s, "uniform") for s in order]
    even, odd = (throughput_systems.round_order(entries, r) for r in (0, 1))
    assert even == entries
    i = order.index("zb-v")
    assert [s for s, _ in odd[i:i + 2]] == ["torch_zbv", "zb-v"]  # torch's first in odd rounds
    assert sorted(odd) == sorted(entries)


def _regenerate(tmp_path, doc_text: str) -> tuple[str, str]:
    """docs/data and ``doc_text`` copied under ``tmp_path/docs``, the document rebuilt there from the JSON;
    returns (rebuilt text, the copy's data path)."""
    import shutil

    import report

    docs = tmp_path / "docs"
    shutil.copytree(os.path.join(os.path.dirname(BENCH), "docs", "data"), docs / "data")
    (docs / "benchmarks.md").write_text(doc_text)
    assert report.main(["--from-json", str(docs / "data"), "--doc", str(docs / "benchmarks.md"),
                        "--img-dir", str(docs / "img")]) == 0
    return (docs / "benchmarks.md").read_text(), str(docs / "data")


def test_benchmarks_doc_is_what_the_report_rebuilds(tmp_path):
    """docs/benchmarks.md equals ``report.py --from-json docs/data``'s rebuild of it (but the date and the data
    directory's path): every figure comes from a saved JSON, and what was measured by hand stands in kept
    blocks, which a rebuild carries over (a hand edit anywhere else would be lost by the next rebuild)."""
    import kept_notes

    path = os.path.join(os.path.dirname(BENCH), "docs", "benchmarks.md")
    with open(path) as fh:
        committed = fh.read()
    rebuilt, data = _regenerate(tmp_path, committed)
    norm = lambda text: re.sub(r" on \d{4}-\d\d-\d\d \d\d:\d\d UTC", " on DATE", text.replace(data, "docs/data"))  # noqa: E731
    assert norm(rebuilt).splitlines() == norm(committed).splitlines()
    assert [name for _, name, _ in kept_notes.extract(committed)] == ["moe-throughput", "moe-shared-overlap",
                                                                       "memory-context-parallel",
                                                                       "moe-2bw-reading", "ef-published"]


def test_kept_blocks_survive_rebuilds_and_splices(tmp_path):
    """A kept block goes back to the end of the section it stood in, after a full rebuild and after
    ``--convergence-only``'s splice of section 3; one whose section is gone goes to the end; an unclosed block
    stops the rebuild with its name."""
    import kept_notes
    import report

    base, _ = _regenerate(tmp_path / "a", "")
    assert not kept_notes.extract(base)  # the header names the markers, inside a line
    note2 = "<!-- kept: mine -->\n### A hand measurement\n\n42 MiB.\n<!-- /kept -->"
    note9 = "<!-- kept: lost -->\ngone section\n<!-- /kept -->"
    at = base.index("## 3. Convergence")
    doc = base[:at] + note2 + "\n\n" + base[at:] + "\n## 9. Old\n\n" + note9 + "\n"
    rebuilt, data = _regenerate(tmp_path / "b", doc)
    assert rebuilt.index("## 2. Memory") < rebuilt.index(note2) < rebuilt.index("## 3. Convergence")
    assert rebuilt.rstrip().endswith(note9) and "## 9. Old" not in rebuilt
    target = tmp_path / "b" / "docs" / "benchmarks.md"
    assert report.main(["--from-json", data, "--doc", str(target), "--img-dir", str(tmp_path / "b" / "docs" / "img"),
                        "--convergence-only"]) == 0
    spliced = target.read_text()
    assert spliced.count(note2) == 1 and spliced.count(note9) == 1
    kept = [b for _, _, b in kept_notes.extract(spliced)]
    target.write_text(spliced + "\n<!-- kept: open -->\nno end\n")
    with pytest.raises(ValueError, match="kept block 'open' has no"):
        report.main(["--from-json", data, "--doc", str(target), "--img-dir", str(tmp_path / "b" / "docs" / "img")])
    assert kept_notes.extract(target.read_text().rsplit("\n<!-- kept: open", 1)[0]) and kept == [note2, note9]
