"""Every layout (t, d, w) trains exactly like the single-process run, for every schedule.

Flush and GPipe must equal the vanilla single-process run; 2BW must equal the single-process
2BW run (its d = 1 reference, itself checked against plain PyTorch in test_2bw_semantics.py).
"""

import pytest
from multiproc import run_workers
from pipeline_harness import matching_shard, train_tiny

SCHEDULES = ("2bw", "flush", "gpipe")
LAYOUTS = [
    (t, d, w) for t in (1, 2) for d in (1, 2, 4) for w in (1, 2) if t * d * w <= 8 and t * d * w > 1
]
KW = dict(steps=6, lr=1e-3)


@pytest.fixture(scope="module")
def reference():
    return {s: train_tiny(s, **KW) for s in SCHEDULES}


def _all_schedules(layout):
    return {s: train_tiny(s, layout=layout, **KW) for s in SCHEDULES}


def compare(outs: list[dict], ref: dict) -> tuple[float, float]:
    """Largest loss and parameter differences of a layout's ranks against the reference."""
    last = [o for o in outs if o["last"]]
    dloss = max(abs(a - b) for o in last for a, b in zip(o["losses"], ref["losses"]))
    dparam = 0.0
    seen = set()
    for o in outs:
        for name, p in o["params"].items():
            want = matching_shard(ref["params"][name], p, o["coords"][0], o["t"])
            dparam = max(dparam, (want - p).abs().max().item())
            seen.add(name)
    assert seen == set(ref["params"]), "layout does not cover every parameter of the model"
    return dloss, dparam


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "t{}d{}w{}".format(*l))
def test_layout_matches_single_process(layout, reference):
    t, d, w = layout
    outs = run_workers(_all_schedules, t * d * w, layout, timeout=240)
    for s in SCHEDULES:
        dloss, dparam = compare([o[s] for o in outs], reference[s])
        assert dloss < 2e-5, (s, dloss)
        assert dparam < 1e-4, (s, dparam)  # Adam, lr 1e-3, 6 steps; SGD agrees to 1e-8
        for o in outs:
            st = o[s]["stats"]
            r = o[s]["coords"][2]
            bound = o[s]["m"] if s == "gpipe" else min(d - r, o[s]["m"])
            assert st["max_inflight"] <= bound
            assert st["weight_versions"] == (2 if s == "2bw" else 1)
            assert st["max_live_versions"] <= 2


def test_2bw_and_flush_agree_at_step_0_and_differ_after(reference):
    a, b = reference["2bw"]["losses"], reference["flush"]["losses"]
    assert a[0] == b[0]
    assert all(abs(x - y) > 1e-6 for x, y in zip(a[1:], b[1:])), (a, b)


def _segmented(layout):
    return {seg: train_tiny("2bw", layout=layout, segments=seg, **KW) for seg in ((6,), (2, 1, 3))}


def test_draining_at_boundaries_changes_no_work():
    """2BW drained after steps 2 and 3 (as for evaluation or a checkpoint) trains bitwise the same."""
    for o in run_workers(_segmented, 2, (1, 2, 1)):
        a, b = o[(6,)], o[(2, 1, 3)]
        assert a["losses"] == b["losses"]
        assert all(a["params"][k].equal(b["params"][k]) for k in a["params"])
