"""tools/checkpoint_util.py on a trainer checkpoint: a t=2, d=2 PipeDream-2BW checkpoint resharded to t=1, d=1
and to t=1, d=4 (optimizer state and 2BW's older version moved with the weights) gives the same validation
loss and continues training with the same losses as the run that was never resharded (fp32)."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest
import torch
from ckpt_runs import _ckpt_data, gpt_args, tp2_pp2_run, train  # noqa: F401
from e2e import REPO, read_metrics, train_losses

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint.trainer_reshard import read_trainer_checkpoint

TOOL = os.path.join(REPO, "tools", "checkpoint_util.py")
START, END = 5, 10
TOL = 1e-5  # fp32; tensor-parallel reductions sum in another order


def _at_start(tp2_pp2_run, tmp_path) -> str:  # noqa: F811
    src = str(tmp_path / "src")
    shutil.copytree(tp2_pp2_run.save, src)
    ck.write_tracker(src, START)
    return src


@functools.cache
def _tool():
    """tools/checkpoint_util.py loaded once into this process; its ``main`` runs the command line's code."""
    spec = importlib.util.spec_from_file_location("checkpoint_util", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reshard(src: str, dst: str, *flags: str) -> None:
    assert _tool().main(["--load-dir", src, "--save-dir", dst, *flags]) == 0, (src, dst, flags)


def _valid_loss(load: str, t: int, d: int, tmp_path, name: str) -> float:
    metrics = str(tmp_path / f"{name}.jsonl")
    res = train([*gpt_args(iters=END, t=t, d=d), "--load", load, "--skip-train", "--metrics-file", metrics],
                nproc=t * d)
    assert res.returncode == 0, res.describe()
    return next(r["loss"] for r in read_metrics(metrics) if r["type"] == "eval" and r["split"] == "valid")


def _continue(load: str, t: int, d: int, tmp_path, name: str) -> dict[int, float]:
    metrics = str(tmp_path / f"{name}.jsonl")
    res = train([*gpt_args(iters=END, t=t, d=d), "--load", load, "--metrics-file", metrics], nproc=t * d)
    assert res.returncode == 0, res.describe()
    assert f"resumed from iteration {START}" in res.stderr
    return train_losses(read_metrics(metrics))


@pytest.fixture(scope="module")
def valid_before(tp2_pp2_run, tmp_path_factory) -> float:  # noqa: F811
    """The validation loss of the original checkpoint at START (t=2, d=2): one launch for both targets."""
    tmp = tmp_path_factory.mktemp("valid_before")
    return _valid_loss(_at_start(tp2_pp2_run, tmp), 2, 2, tmp, "valid_before")


@pytest.mark.parametrize("t,d", [(1, 1), (1, 4)])
def test_resharded_checkpoint_evaluates_and_trains_like_the_original(tp2_pp2_run, valid_before,  # noqa: F811
                                                                     tmp_path, t, d):
    src = _at_start(tp2_pp2_run, tmp_path)
    dst = str(tmp_path / f"t{t}d{d}")
    _reshard(src, dst, "--target-tensor-parallel-size", str(t), "--target-pipeline-parallel-size", str(d))
    before = read_trainer_checkpoint(src)
    after = read_trainer_checkpoint(dst)
    assert sorted(after.families) == sorted(before.families) == ["model", "older", "optimizer.exp_avg",
                                                                  "optimizer.exp_avg_sq"]
    for fam, full in before.families.items():  # every per-parameter tensor moved exactly
        assert all(torch.equal(full[n], after.families[fam][n]) for n in full), fam
    assert float(before.families["optimizer.exp_avg_sq"]["3.attn.qkv.weight"].abs().sum()) > 0
    valid_after = _valid_loss(dst, t, d, tmp_path, "valid_after")
    straight = train_losses(tp2_pp2_run.metrics)
    resumed = _continue(dst, t, d, tmp_path, "continued")
    assert sorted(resumed) == list(range(START, END))
    worst = max(abs(resumed[i] - straight[i]) for i in resumed)
    print(f"t={t} d={d}: validation {valid_after!r} vs {valid_before!r}; worst loss difference {worst:.3g}")
    assert abs(valid_after - valid_before) < TOL
    assert worst < TOL, (resumed, straight)
    assert len({round(v, 3) for v in resumed.values()}) > 1  # the loss moves: a real curve


def test_schedule_conversion_keeps_the_newest_version(tp2_pp2_run, tmp_path):  # noqa: F811
    """2BW -> flush keeps ``model`` (W(step)) and drops the older version; flush -> 2BW starts both equal."""
    src = _at_start(tp2_pp2_run, tmp_path)
    flush, back = str(tmp_path / "flush"), str(tmp_path / "back")
    _reshard(src, flush, "--target-schedule", "flush")
    _reshard(flush, back, "--target-schedule", "2bw", "--target-tensor-parallel-size", "2")
    before, mid, after = (read_trainer_checkpoint(p) for p in (src, flush, back))
    assert "older" in before.families and "older" not in mid.families and "older" not in after.families
    assert mid.first["layout"]["schedule"] == "flush" and after.first["layout"]["schedule"] == "2bw"
    for fam in ("model", "optimizer.exp_avg"):
        assert all(torch.equal(v, after.families[fam][n]) for n, v in before.families[fam].items())
    assert any(not torch.equal(v, before.families["model"][n]) for n, v in before.families["older"].items())
