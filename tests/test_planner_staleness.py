"""The staleness column: none for synchronous schedules, the measured loss ratios for 2BW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_2bw.planner.memory_model import Candidate
from megatron_2bw.planner.staleness import measured, staleness

ROOT = Path(__file__).resolve().parent.parent


def test_summary_matches_the_measurement():
    """staleness.json is docs/data/convergence_optimizers.json's per-(optimizer, mode) means, recomputed here
    (keys: the mode for AdamW, muon/<mode> for Muon)."""
    runs = json.loads((ROOT / "docs/data/convergence_optimizers.json").read_text())["results"]
    for regime, summary in measured()["regimes"].items():
        for key, ratio in summary["valid_loss_ratio_vs_flush"].items():
            opt, mode = key.split("/") if "/" in key else ("adamw", key)
            mine = [r for r in runs if r["regime"] == regime and r["schedule"] == "2bw" and r["compensation"] == mode
                    and r.get("optimizer", "adamw") == opt]
            assert mine, (regime, key)
            assert ratio == pytest.approx(sum(r["valid_loss_ratio_vs_flush"] for r in mine) / len(mine), abs=1e-4)
            times = [r["time_vs_flush_at_this_loss"] for r in mine if r["time_vs_flush_at_this_loss"] is not None]
            want = sum(times) / len(times) if times else None
            assert summary["time_vs_flush_to_2bw_final_loss"][key] == (pytest.approx(want, abs=1e-3) if times else None)


def test_synchronous_schedules_cost_nothing():
    for sched in ("flush", "gpipe"):
        s = staleness(Candidate(1, 4, 1, 1, 8, False, sched))
        assert s.stale_steps == 0 and s.text == "none" and s.to_json() == {"stale_steps": 0}
    assert staleness(Candidate(1, 1, 8, 1, 8, False, "flush")).text == "none"  # one stage: no pipeline


def test_2bw_shows_the_measured_ratios():
    s = staleness(Candidate(1, 4, 1, 1, 8, False, "2bw"))
    assert s.stale_steps == 1
    assert s.valid_loss_ratio["paper"] == pytest.approx(1.0271, abs=1e-4)
    assert s.valid_loss_ratio["aggressive"] == pytest.approx(1.0915, abs=1e-4)
    assert s.text == "+2.7..9.1%*"  # 1.0271 and 1.0915
    assert "gpt-demo" in s.to_json()["measured_on"]
    assert s.to_json()["time_vs_flush_to_2bw_final_loss"] == {"paper": pytest.approx(1.622, abs=1e-3),
                                                              "aggressive": pytest.approx(2.559, abs=1e-3)}
    assert staleness(Candidate(1, 4, 1, 1, 8, False, "2bw"), "predict").text == "+0.8..6.3%*"


def _plan():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tool_plan", ROOT / "tools" / "plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SHAPE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
         "--num-gpus", "8", "--global-batch-size", "64", "--cluster", "dgx-h100", "--precision", "bf16"]


def test_plan_cli_staleness_schedules_and_recompute(capsys):
    plan = _plan()
    assert plan.main([*SHAPE, "--json", "--exhaustive"]) == 0  # every plan priced: each schedule is in "ranked"
    out = json.loads(capsys.readouterr().out)
    by_sched = {r["schedule"]: r["staleness"] for r in out["ranked"] if r["pipeline_parallel"] > 1}
    assert by_sched["flush"] == {"stale_steps": 0} and by_sched["2bw"]["stale_steps"] == 1
    assert {r["recompute_policy"] for r in out["ranked"]} >= {None, "uniform1"}  # searched by default
    assert plan.main([*SHAPE, "--json", "--schedules", "flush,gpipe", "--no-finer-recompute"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["schedule"] for r in out["ranked"]} <= {"flush", "gpipe"}
    assert {r["recompute_policy"] for r in out["ranked"]} == {None}
    assert plan.main([*SHAPE, "--top", "40"]) == 0
    text = capsys.readouterr().out
    assert "staleness" in text and "+2.7..9.1%*" in text and "gpt-demo" in text


def test_plan_cli_bad_schedules(capsys):
    assert _plan().main([*SHAPE, "--schedules", "pipedream"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "choose among" in err and err.count("\n") == 1


def test_the_column_reads_the_mode_and_optimizer_a_candidate_trains_with():
    """auto resolves as the trainer does: Muon -> muon/ef; Adam in bf16 -> predict, but none with the distributed
    optimizer (which refuses predict) and in fp32; a mode never measured with Muon shows Muon's plain 2BW."""
    table = {r: v["valid_loss_ratio_vs_flush"] for r, v in measured()["regimes"].items()}
    two = Candidate(1, 4, 1, 1, 8, False, "2bw")
    zero = Candidate(1, 4, 2, 1, 8, False, "2bw", distributed_optimizer=True)

    def ratios(c, *args):
        return staleness(c, *args).valid_loss_ratio

    assert ratios(two, "auto", "muon", "bf16") == {r: t["muon/ef"] for r, t in table.items()}
    assert ratios(two, "auto", "adam", "bf16") == {r: t["predict"] for r, t in table.items()}
    assert (ratios(zero, "auto", "adam", "bf16") == ratios(two, "auto", "adam", "fp32")
            == {r: t["none"] for r, t in table.items()})
    assert ratios(two, "predict", "muon") == {r: t["muon/none"] for r, t in table.items()}
    assert staleness(Candidate(1, 4, 1, 1, 8, False, "flush"), "auto", "muon").text == "none"
