"""Mixed precision done right in every schedule: unscale, inf/NaN skip and global-norm clipping."""

import math

import torch
from multiproc import run_workers
from pipeline_harness import train_tiny


def _precisions(layout):
    out = {}
    for dtype in ("bf16", "fp16"):
        out[dtype] = train_tiny("2bw", layout=layout, dtype=dtype, steps=8, lr=3e-3, clip=1.0)
    out["fp32"] = train_tiny("2bw", layout=layout, steps=8, lr=3e-3, clip=1.0)
    return out


def test_bf16_and_fp16_2bw_train_without_nan_and_track_fp32():
    outs = run_workers(_precisions, 2, (1, 2, 1))
    last = outs[1]
    ref = last["fp32"]["losses"]
    for dtype in ("bf16", "fp16"):
        losses = last[dtype]["losses"]
        assert all(math.isfinite(x) for x in losses), (dtype, losses)
        assert not any(last[dtype]["skipped"]), dtype
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.05, (dtype, losses, ref)
    assert last["fp16"]["scales"][0] == 2.0**12  # dynamic loss scaling was in use


def _clipped(layout, schedule):
    return train_tiny(schedule, layout=layout, optimizer="sgd", lr=1.0, clip=0.05, weight_decay=0.0, steps=3)


def test_clipping_is_active_in_2bw_with_the_global_norm():
    """Norm across stages equals the single-process norm; the applied update has norm lr * clip."""
    single = _clipped(None, "2bw")
    outs = run_workers(_clipped, 2, (1, 2, 1), "2bw")
    for o in outs:  # every stage sees the same global norm, equal to the single-process one
        torch.testing.assert_close(torch.tensor(o["norms"]), torch.tensor(single["norms"]), rtol=1e-5, atol=0)
    assert all(n > 0.05 for n in single["norms"])  # so clipping engaged every step
    # Update of step 2 (W(3) - W(2)) is lr * clip in norm: rebuild W(2) from a 2-step run.
    two = train_tiny("2bw", optimizer="sgd", lr=1.0, clip=0.05, weight_decay=0.0, steps=2)
    sq = sum((single["params"][k] - two["params"][k]).double().square().sum() for k in single["params"])
    assert math.sqrt(sq) == pytest_approx(1.0 * 0.05, rel=1e-4)


def pytest_approx(x, rel):
    import pytest

    return pytest.approx(x, rel=rel)


def _inject(layout, dtype):
    # rank 0 (first stage, first replica) poisons its gradient of step 2
    return train_tiny("2bw", layout=layout, dtype=dtype, steps=5, lr=3e-3, clip=1.0, inject_inf=(0, 2))


def test_injected_inf_skips_the_step_on_every_rank():
    for dtype in ("fp16", "fp32"):
        outs = run_workers(_inject, 4, (1, 2, 2), dtype)
        for o in outs:
            assert o["skipped"] == [False, False, True, False, False], (dtype, o["coords"], o["skipped"])
            assert all(math.isfinite(x) for x in (o["losses"] or []))
            for p in o["params"].values():
                assert torch.isfinite(p).all()
        if dtype == "fp16":  # the dynamic scale backs off once, the same on every rank. In 2BW step 3
            # already runs backward (with its scale fixed) when step 2's overflow is known: step 4 gets it.
            assert all(o["scales"] == [2.0**12] * 4 + [2.0**11] for o in outs), [o["scales"] for o in outs]
        # replicas stay identical after the skip
        by_stage = {}
        for o in outs:
            by_stage.setdefault(o["coords"][2], []).append(o["params"])
        for replicas in by_stage.values():
            for k in replicas[0]:
                assert torch.equal(replicas[0][k], replicas[1][k])
