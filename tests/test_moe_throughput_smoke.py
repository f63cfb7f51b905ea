"""Smoke test of ``benchmarks/moe_throughput.py`` (issues 42/43, "Speed"): one tiny round of its smallest cell
(d = 2, EP = 1) through the benchmark's own code, the JSON fields, and every ratio recomputed from the raw records
of one round; the all-to-all clock against the dispatcher's calls at EP = 2. Timings are not checked."""

from __future__ import annotations

import json
import os
import sys

import pytest
from multiproc import run_workers

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import moe_throughput  # noqa: E402
import moe_throughput_worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("forked_bench_workers")  # conftest.py: workers forked, not spawned


def test_moe_throughput_quick(tmp_path):
    out = tmp_path / "moe.json"
    assert moe_throughput.main(["--quick", "--json", str(out)]) == 0
    with open(out) as f:
        data = json.load(f)
    rows, recs = data["results"], data["per_cell"]["d=2 ep=1"]["records"]
    assert {(r["variant"], r["system"]) for r in rows} == {(v, s) for v in ("moe", "dense")
                                                           for s in ("single", "2bw", "flush")}
    by = {(r["round"], r["system"], r["split"]): r for r in recs}
    for r in rows:
        assert r["rounds"] == [0] and r["samples_per_sec"] > 0 and r["m"] == 2
        assert r["tokens_per_sec"] == pytest.approx(16 * r["samples_per_sec"])  # --quick: seq 16
        own = by[0, r["system"], r["variant"]]  # this row's segment of round 0: m x EP x b = 4 samples a step
        assert r["samples_per_sec"] == pytest.approx(own["steady_steps"] * 4 / own["steady_s"])
        # both ratios are taken between segments of the same round
        single, dense = by[0, "single", r["variant"]], by[0, r["system"], "dense"]
        assert r["speedup_vs_single"] == pytest.approx(single["steady_s"] / own["steady_s"]
                                                       * own["steady_steps"] / single["steady_steps"])
        assert r["moe_vs_dense"] == pytest.approx(dense["steady_s"] / own["steady_s"]
                                                  * own["steady_steps"] / dense["steady_steps"])
        assert r["planner_step_s"] > 0 and r["planner_tokens_per_sec"] > 0
        if r["system"] == "single":
            assert r["speedup_vs_single"] == 1.0 and r["a2a_share"] is None and r["balance_ceiling"] == 1.0
            continue
        assert r["d"] == 2 and r["processes"] == 2
        assert r["a2a_share"] == 0.0 and r["a2a_ms_per_step"] == 0.0  # EP = 1: the dispatcher sends nothing
        assert 1.0 <= r["balance_ceiling"] <= 2.0 and len(r["stage_compute_ms_per_microbatch"]) == 2
        assert r["balance_ceiling"] == pytest.approx(sum(r["stage_compute_ms_per_microbatch"])
                                                     / max(r["stage_compute_ms_per_microbatch"]))
        assert len(r["bubble_per_process"]) == 2
    two = next(r for r in rows if r["system"] == "2bw" and r["variant"] == "moe")
    flush = next(r for r in rows if r["system"] == "flush" and r["variant"] == "moe")
    assert two["ideal_vs_single"] == 2.0 and flush["ideal_vs_single"] == pytest.approx(2 * 2 / 3)
    # the planner's speed-up is its single process's simulated step over the pipeline's, both from its profile
    plan = data["planner_step_s"]
    assert two["planner_speedup_vs_single"] == pytest.approx(plan["single ep=1"] / plan["2bw d=2 ep=1"])
    assert two["ratio_vs_flush"] == pytest.approx(two["samples_per_sec"] / flush["samples_per_sec"])  # one round
    # the results are a function of the saved records: summarized again, the same numbers
    again = tmp_path / "again.json"
    assert moe_throughput.main(["--from-json", str(out), "--json", str(again)]) == 0
    with open(again) as f:
        assert json.load(f)["results"] == rows


def _clocked_dispatch(_):
    """Two EP ranks: the alltoall dispatcher's dispatch and combine (forward and backward) under the clock."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.moe.dispatcher import make_dispatcher

    moe_throughput_worker.A2AClock.install()
    clock = moe_throughput_worker.A2AClock
    disp = make_dispatcher("alltoall", 4, dist.group.WORLD)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    routing = torch.zeros(6, 4, dtype=torch.bool)
    routing[torch.arange(6), torch.randint(0, 4, (6,), generator=g)] = True
    probs = routing.float()
    calls0 = clock.calls
    rows, counts, handle = disp.dispatch(x, routing, probs)
    y = disp.combine(rows * 2.0, handle)
    y.sum().backward()
    same, grad = torch.allclose(y, 2.0 * x), torch.allclose(x.grad, torch.full_like(x, 2.0))
    return clock.calls - calls0, clock.seconds, same, grad


def test_a2a_clock_counts_the_dispatchers_collectives():
    for calls, seconds, same, grad in run_workers(_clocked_dispatch, 2, None, timeout=120):
        # counts + rows in dispatch, rows in combine, and each rows exchange once more in backward
        assert calls == 5 and seconds > 0.0
        assert same and grad  # the clock wraps the collective without changing what it moves
