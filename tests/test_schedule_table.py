"""benchmarks/schedule_table.py: docs/planner.md's measured-throughput table, from docs/data."""

from __future__ import annotations

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import schedule_table  # noqa: E402


def _write(path, date, results):
    path.write_text(json.dumps({"machine": {"date_utc": date}, "results": results}))


def test_newest_run_per_schedule_against_its_own_flush(tmp_path):
    _write(tmp_path / "throughput.json", "2026-11-01T00:00:00Z", [
        {"system": "flush", "d": 2, "m": 4, "samples_per_sec": 10.0},
        {"system": "flush", "d": 2, "m": 16, "samples_per_sec": 16.0},
        {"system": "2bw", "d": 2, "m": 16, "samples_per_sec": 25.0},
        {"system": "gpipe", "d": 2, "m": 4, "samples_per_sec": 9.0, "ratio_vs_torch_1f1b": 1.01},
        {"system": "zb-h1", "d": 2, "m": 4, "samples_per_sec": 11.0},
        {"system": "zb-h1", "d": 2, "m": 16, "samples_per_sec": 20.0, "torch_counterpart": "torch_interleaved_zb",
         "ratio_vs_torch_counterpart": 1.05, "bubble_per_stage": [0.1, 0.05], "ideal_bubble": 0.02}])
    _write(tmp_path / "throughput_new.json", "2026-12-01T00:00:00Z", [
        {"system": "flush", "d": 2, "m": 4, "samples_per_sec": 20.0},
        {"system": "2bw", "d": 2, "m": 4, "samples_per_sec": 26.0},
        {"system": "zb-h1", "d": 2, "m": 4, "samples_per_sec": 25.0, "torch_counterpart": "torch_interleaved_zb",
         "ratio_vs_torch_counterpart": 0.98, "bubble_per_stage": [0.234, 0.0891], "ideal_bubble": 0.0625,
         "ratio_vs_2bw": 0.951, "ceiling_vs_2bw": 0.962},
        {"system": "zb-h1", "d": 2, "m": 4, "samples_per_sec": 99.0, "split": "balanced"},  # not comparable
        {"system": "zb-h1", "d": 2, "m": 8, "samples_per_sec": 30.0, "model": "head-heavy"}])
    rows = schedule_table.schedule_rows(str(tmp_path), ("flush", "gpipe", "zb-h1", "zb-v"))
    assert rows == [
        ["`flush`", "2", "4", "1", "20.00", "1.000", "-", "-", "0.769", "-", "throughput_new.json (2026-12-01)"],
        ["`flush`", "2", "16", "1", "16.00", "1.000", "-", "-", "0.640", "-", "throughput.json (2026-11-01)"],
        ["`gpipe`", "2", "4", "1", "9.00", "0.900", "1.010", "-", "-", "-", "throughput.json (2026-11-01)"],
        # m = 4 from the newer run, m = 16 from the only run that measured it, each against its own flush and
        # 2BW (the median of the same-round ratios where the run recorded it, else the ratio of the medians)
        ["`zb-h1`", "2", "4", "1", "25.00", "1.250", "-", "0.980 (torch_interleaved_zb)", "0.951 (0.962)",
         "0.23 / 0.09 (0.062)", "throughput_new.json (2026-12-01)"],
        ["`zb-h1`", "2", "16", "1", "20.00", "1.250", "-", "1.050 (torch_interleaved_zb)", "0.800",
         "0.10 / 0.05 (0.020)", "throughput.json (2026-11-01)"],
        ["`zb-v`", "-", "-", "-", "not measured yet", "-", "-", "-", "-", "-", "-"],
    ]


def test_another_clipping_is_a_row_of_its_own(tmp_path):
    """A run at another --clip does not replace the default regime's row; it sits beside it, against the flush and
    2BW of its own run."""
    _write(tmp_path / "throughput.json", "2026-11-01T00:00:00Z", [
        {"system": "2bw", "d": 2, "m": 4, "samples_per_sec": 20.0},
        {"system": "zb-h2+pv", "d": 2, "m": 4, "samples_per_sec": 17.0, "ratio_vs_2bw": 0.85}])
    (tmp_path / "throughput_stable.json").write_text(json.dumps({
        "machine": {"date_utc": "2026-12-01T00:00:00Z"}, "config": {"clip": 5.0},
        "results": [{"system": "2bw", "d": 2, "m": 4, "samples_per_sec": 21.0},
                    {"system": "zb-h2+pv", "d": 2, "m": 4, "samples_per_sec": 20.5, "ratio_vs_2bw": 0.97}]}))
    rows = schedule_table.schedule_rows(str(tmp_path), ("zb-h2+pv",))
    assert [(r[3], r[4], r[8]) for r in rows] == [("1", "17.00", "0.850"), ("5", "20.50", "0.970")]


def test_document_rewritten_in_place_and_checked(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{schedule_table.BEGIN}\nold\n{schedule_table.END}\nafter\n")
    _write(tmp_path / "throughput.json", "2026-12-01T00:00:00Z",
           [{"system": "flush", "d": 2, "m": 4, "samples_per_sec": 10.0}])
    args = ["--doc", str(doc), "--json-dir", str(tmp_path)]
    assert schedule_table.main([*args, "--check"]) == 1
    assert schedule_table.main(args) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "| `flush` | 2 | 4 | 1 | 10.00 |" in text
    assert schedule_table.main([*args, "--check"]) == 0
    doc.write_text("no markers\n")
    assert schedule_table.main(args) == 2


def test_committed_planner_doc_is_current():
    """docs/planner.md section 9's table is what docs/data gives (rerun the script after a benchmark)."""
    assert schedule_table.main(["--check"]) == 0
