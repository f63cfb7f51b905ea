"""The pruned search (``search(..., top=K, keep=...)``, what ``tools/plan.py`` runs) against the exhaustive one:
the same best plan, the same first K of the ranking and the same best plan of each selector, on a few jobs
that exercise every axis (every schedule, recomputation policies, sequence parallelism, the distributed
optimizer, uneven splits), with far fewer candidates priced."""

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.report import paper_model
from megatron_2bw.planner.search import FINER_RECOMPUTE, PlanRequest, search

V100 = load_cluster("aws-p3.16xlarge")
AXES = dict(recompute_policies=FINER_RECOMPUTE, sequence_parallel_options=(False, True))
KEEP = {"t=1": lambda c: c.tensor_parallel == 1, "flush": lambda c: c.schedule == "flush",
        "no pipeline": lambda c: c.pipeline_parallel == 1}
JOBS = {
    "gpt-1.3b, 16 V100": PlanRequest(paper_model("gpt-1.3b"), V100, 16, 256, memory_margin=0.1, **AXES),
    "gpt-355m, 8 V100, no margin": PlanRequest(paper_model("gpt-355m"), V100, 8, 64, **AXES),
    "gpt 16x2048, 16 H100, bf16": PlanRequest(ModelConfig("gpt", 16, 2048, 16, 2048, 2048, 50257),
                                              load_cluster("dgx-h100"), 16, 128, "bf16", memory_margin=0.1, **AXES),
    "gpt-1.3b, 16 V100, even stages": PlanRequest(paper_model("gpt-1.3b"), V100, 16, 256, balance_stages=False,
                                                  **AXES),
}


@pytest.mark.parametrize("name", JOBS)
def test_pruned_search_answers_as_the_exhaustive_one(name):
    req = JOBS[name]
    full = search(req)
    for top in (1, 10):
        pruned = search(req, top=top, keep=KEEP)
        assert pruned.best == full.best
        assert list(pruned.ranked) == list(full.ranked[:top])
        for label, pick in KEEP.items():
            assert pruned.best_of[label] == next((e for e in full.ranked if pick(e.candidate)), None), label
        assert pruned.considered == full.considered == pruned.priced + pruned.pruned
        assert pruned.priced < full.priced / 3, (pruned.priced, full.priced)  # what it is for
    print(f"\n{name}: priced {pruned.priced} of {pruned.considered} (exhaustive: {full.priced}); best "
          f"{full.best.samples_per_sec:.1f}/s")


def test_keep_alone_and_every_plan():
    """``top=0`` with selectors: only their best plans; a ``top`` past the feasible count: the whole ranking."""
    req = JOBS["gpt-355m, 8 V100, no margin"]
    full = search(req, keep=KEEP)
    only = search(req, top=0, keep=KEEP)
    assert only.ranked == () and only.best_of == full.best_of and all(only.best_of.values())
    every = search(req, top=10**6)
    assert every.ranked == full.ranked and every.num_fit == full.num_fit == len(full.ranked)


def test_nothing_fits_says_the_same():
    req = PlanRequest(paper_model("gpt-3.8b"), V100, 1, 8)
    with pytest.raises(ConfigError) as full:
        search(req)
    with pytest.raises(ConfigError) as pruned:
        search(req, top=10, keep=KEEP)
    assert str(pruned.value) == str(full.value) and "nothing fits" in str(full.value)


def test_speed_benchmark_smoke(tmp_path):
    """``benchmarks/planner_speed.py`` at its smallest: one size, one round, and its exhaustive timing; the JSON's
    counts are the search's (never its timings: those are the benchmark's to measure)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "speed.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "planner_speed.py"), "--sizes", "8",
                           "--rounds", "1", "--cases", "0", "--exhaustive-sizes", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    pruned, full = runs
    assert (pruned["exhaustive"], full["exhaustive"]) == (False, True) and pruned["num_gpus"] == full["num_gpus"] == 8
    assert pruned["considered"] == full["considered"] == pruned["priced"] + pruned["pruned"]
    assert pruned["priced"] < full["priced"] and pruned["best"] == full["best"]
    assert pruned["cpu_seconds_median"] > 0 and pruned["wall_seconds_median"] > 0
