"""Smoke test of the MoE + 2BW convergence study (benchmarks/convergence_moe.py, issue 43): two 2-step trainer
runs of the smallest cell through the study's own code path, and the pairing of every ratio with its Flush
row on hand-made rows. Losses are not judged here (2 steps); the ratios, the expert load read from the log and
the summary are checked against values recomputed here from the trainer's own files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

import convergence_moe as cm  # noqa: E402
import report_moe  # noqa: E402

ROW_KEYS = ("model", "optimizer", "pipeline", "regime", "seed", "final_valid_loss", "flush_final_valid_loss",
            "valid_loss_ratio_vs_flush", "expert_load", "parameters", "active_parameters", "steps", "d")


def _moe_lines(log: str) -> list[dict[str, float]]:
    """The trainer's ``moe:`` lines as {name: value} (split here by hand, not with the study's regex)."""
    out = []
    for line in open(log, encoding="utf-8"):
        if line.startswith("moe: "):
            fields = [p.split(": ") for p in line.strip().split(" | ")[1:]]
            out.append({k: float(v) for k, v in fields} | {"iteration": int(line.split()[2])})
    return out


def test_moe_study_two_steps(tmp_path, study_data_dir):
    js = tmp_path / "moe.json"
    cmd = [sys.executable, os.path.join(BENCH, "convergence_moe.py"), "--max-iters", "2", "--eval-iters", "1",
           "--models", "moe", "--optimizers", "adamw", "--pipelines", "flush", "2bw", "--regimes", "aggressive",
           "--seeds", "7", "--data-dir", study_data_dir, "--vocab", "500", "--corpus-mb", "0.3",
           "--out-dir", str(tmp_path / "runs"), "--json", str(js)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(js.read_text())
    assert data["complete"] is True
    by = {r["pipeline"]: r for r in data["rows"]}
    assert set(by) == {"flush", "2bw"}
    for r in by.values():
        assert all(k in r for k in ROW_KEYS), r.keys()
        assert (r["model"], r["optimizer"], r["regime"], r["seed"], r["steps"], r["d"]) == \
            ("moe", "adamw", "aggressive", 7, 2, 1)
        records = [json.loads(x) for x in open(os.path.join(ROOT, r["metrics_file"]), encoding="utf-8")]
        assert r["final_valid_loss"] == [x["loss"] for x in records if x.get("split") == "valid"][-1]
        # 6 of 8 experts idle per token: 2 layers x 6 x (two 64 x 128 matrices, no biases)
        assert r["parameters"] - r["active_parameters"] == 2 * 6 * 2 * 64 * 128
        lines = _moe_lines(os.path.join(ROOT, r["log_file"]))
        # a line per --log-interval 1, the last printed at the final evaluation (its step's forwards all ran)
        assert [x["iteration"] for x in lines] == r["expert_load"]["step"] == [1, 2]
        for layer in ("0", "1"):
            got = r["expert_load"]["max_over_mean"][layer]
            assert got == [x[f"tokens_per_expert_max_over_mean layer {layer}"] for x in lines]
            assert 1.0 <= got[0] <= 4.0  # top-2 of 8, dropless: an expert gets at most every token, 4x the mean
    flush, tbw = by["flush"]["final_valid_loss"], by["2bw"]["final_valid_loss"]
    assert by["2bw"]["flush_final_valid_loss"] == flush
    assert by["2bw"]["valid_loss_ratio_vs_flush"] == pytest.approx(tbw / flush, rel=1e-12)
    assert by["flush"]["valid_loss_ratio_vs_flush"] == 1.0
    # report.py's section builds from this JSON (the ratio row, the figure of the load)
    block = "\n".join(report_moe.moe_section(data, None, os.path.join(ROOT, "docs", "benchmarks.md"), str(js)))
    assert f"| aggressive | moe | adamw | 2BW | {tbw:.4f} | {tbw / flush:.4f} |" in block
    assert report_moe.plot_expert_load(data, str(tmp_path / "load.png"))


def _rows() -> list[dict]:
    """Every cell of the study on two seeds with distinct made-up losses: flush 5 + a small offset per cell."""
    rows = []
    for i, (m, o, g, s) in enumerate((m, o, g, s) for m in cm.MODELS for o in cm.OPTIMIZERS
                                     for g in cm.MOE_REGIMES for s in (1, 2)):
        base = 5.0 + 0.01 * i
        gap = {"adamw": 0.04, "muon": 0.004}[o]
        for p, loss in (("flush", base), ("2bw", base + gap), ("2bw-ef", base + gap / 4)):
            rows.append(dict(model=m, optimizer=o, pipeline=p, regime=g, seed=s, final_valid_loss=loss))
    return rows


def test_ratios_pair_with_their_own_flush():
    rows = _rows()
    rows.reverse()  # the Flush row comes after the row it is paired with: pairing is by key, not by order
    out = cm.summarize(rows)
    for r in rows:
        flush = 5.0 + 0.01 * (cm.MODELS.index(r["model"]) * 8 + cm.OPTIMIZERS.index(r["optimizer"]) * 4
                              + list(cm.MOE_REGIMES).index(r["regime"]) * 2 + (r["seed"] - 1))
        assert r["flush_final_valid_loss"] == pytest.approx(flush, abs=1e-12)
        assert r["valid_loss_ratio_vs_flush"] == pytest.approx(r["final_valid_loss"] / flush, rel=1e-12)
    cell = next(s for s in out["summary"] if (s["model"], s["optimizer"], s["pipeline"], s["regime"])
                == ("moe", "muon", "2bw-ef", "paper"))
    ratios = [1 + 0.001 / (5.0 + 0.01 * (8 + 4 + 2)), 1 + 0.001 / (5.0 + 0.01 * 15)]
    assert cell["valid_loss_ratio_per_seed"] == pytest.approx(ratios, rel=1e-12)
    assert cell["valid_loss_ratio_mean"] == pytest.approx(sum(ratios) / 2, rel=1e-12)
    assert cell["valid_loss_ratio_spread"] == pytest.approx(ratios[0] - ratios[1], rel=1e-9)
    assert out["flush_seed_spread"]["moe/muon/paper"] == pytest.approx(0.01 / 5.145, rel=1e-12)
    signs = cm.signs(out["summary"])
    assert len(signs) == 4 and all(e["muon_gap_smaller"] for e in signs)
    for e in signs:  # ef's loss is a quarter of 2BW's gap above Flush: it recovers about 3/4 of it
        assert e["adamw_ef_recovered"] == pytest.approx(0.75, abs=2e-3)
        assert e["muon_ef_recovered"] == pytest.approx(0.75, abs=2e-3)
    got = cm.aim(out["summary"], list(cm.MOE_REGIMES))
    assert got["met"] is True and got["met_by_every_seed"] is True  # Muon + ef: 1.0002 of Flush
    assert cm.aim(out["summary"][:3], list(cm.MOE_REGIMES))["met"] is None  # a regime missing: not judged
