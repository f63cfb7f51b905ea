"""Checkpoints: Megatron's layout, atomic writes, clear errors, and bitwise resume.

A run resumed from iteration k logs exactly the losses of the run that was never stopped, for
PipeDream-2BW (the restart after the kill test, GPT, (d, w) = (2, 2)) and PipeDream-Flush (BERT,
(d, w) = (2, 2)), on CPU in fp32: compared with ``==``, not approximately.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from e2e import bert_flush_run, corpus, gpt_2bw_killed, gpt_2bw_run, read_metrics, torchrun, train_losses  # noqa: F401

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.errors import ConfigError


def _evals(records):
    return {(r["iteration"], r["split"]): r["loss"] for r in records if r["type"] == "eval"}


def test_2bw_resume_is_bitwise(gpt_2bw_run, gpt_2bw_killed):  # noqa: F811
    straight = train_losses(gpt_2bw_run.metrics)
    resumed = train_losses(gpt_2bw_killed.metrics)
    assert sorted(resumed) == list(range(10, 30)), gpt_2bw_killed.restarted.describe()
    assert resumed == {k: straight[k] for k in resumed}
    assert _evals(gpt_2bw_killed.metrics) == {k: v for k, v in _evals(gpt_2bw_run.metrics).items() if k[0] >= 10}


def test_flush_resume_is_bitwise(bert_flush_run, tmp_path):  # noqa: F811
    load = str(tmp_path / "ckpt")
    shutil.copytree(bert_flush_run.save, load)
    with open(os.path.join(load, ck.TRACKER), "w") as f:
        f.write("20\n")
    metrics = str(tmp_path / "resumed.jsonl")
    res = torchrun(bert_flush_run.script, [*bert_flush_run.args, "--load", load, "--metrics-file", metrics])
    assert res.returncode == 0, res.describe()
    assert "resumed from iteration 20" in res.stderr
    straight, resumed = train_losses(bert_flush_run.metrics), train_losses(read_metrics(metrics))
    assert sorted(resumed) == list(range(20, 30))
    assert resumed == {k: straight[k] for k in resumed}


# ------------------------------------------------------------------ in-process unit tests
def test_megatron_names():
    assert ck.rank_dir_name(1, 0, 1) == "mp_rank_01"
    assert ck.rank_dir_name(0, 3, 4) == "mp_rank_00_003"
    assert ck.checkpoint_path("/c", 100, 1, 2, 4) == "/c/iter_0000100/mp_rank_01_002/model_optim_rng.pt"


def test_atomic_save_leaves_old_checkpoint_on_crash(tmp_path, monkeypatch):
    root = str(tmp_path)
    path5 = ck.checkpoint_path(root, 5, 0, 0, 1)
    ck.atomic_torch_save({"x": torch.ones(3)}, path5)
    ck.write_tracker(root, 5)
    path10 = ck.checkpoint_path(root, 10, 0, 0, 1)

    def crash(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.atomic_torch_save({"x": torch.zeros(3)}, path10)
    assert not os.path.exists(path10) and os.listdir(os.path.dirname(path10)) == []
    assert ck.read_tracker(root) == 5  # the pointer still names the complete checkpoint


def test_tracker_and_lookup_errors(tmp_path):
    root = str(tmp_path / "c")
    assert ck.find_checkpoint(root, save=root) is None  # auto-resume: first run of a job
    with pytest.raises(ConfigError, match="does not exist"):
        ck.find_checkpoint(root, save=None)
    os.makedirs(root)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        ck.find_checkpoint(root, save=None)
    with open(os.path.join(root, ck.TRACKER), "w") as f:
        f.write("release\n")
    with pytest.raises(ConfigError, match="does not hold an iteration number"):
        ck.find_checkpoint(root, save=None)
    ck.write_tracker(root, 7)
    assert ck.find_checkpoint(root, save=None) == 7
    with pytest.raises(ConfigError, match="names iteration 7 but .* is missing"):
        ck.load_rank_file(root, 7, 1, 1, 0, 0)


def test_corrupt_and_foreign_layout_files(tmp_path):
    root = str(tmp_path)
    path = ck.checkpoint_path(root, 3, 0, 0, 2)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"\x00not a checkpoint")
    os.makedirs(os.path.dirname(ck.checkpoint_path(root, 3, 0, 1, 2)))
    with open(ck.checkpoint_path(root, 3, 0, 1, 2), "wb") as f:
        f.write(b"x")
    ck.write_tracker(root, 3)
    with pytest.raises(ConfigError, match="is corrupt or unreadable"):
        ck.load_rank_file(root, 3, 1, 2, 0, 0)
    with pytest.raises(ConfigError, match=r"saved with layout t=1 d=2 .* this run uses t=2 d=2"):
        ck.load_rank_file(root, 3, 2, 2, 1, 0)
    ck.atomic_torch_save({"format": 1, "stage": {}, "iteration": 3, "layout": {"t": 1, "d": 2}}, path)
    os.remove(ck.checkpoint_path(root, 3, 0, 1, 2))
    with pytest.raises(ConfigError, match="checkpoint file .*mp_rank_00_001.* is missing"):
        ck.load_rank_file(root, 3, 1, 2, 0, 1)


def test_exit_interval_saves_and_stops(corpus, tmp_path):  # noqa: F811
    """One process (no torchrun): --exit-interval 4 saves iteration 4 and ends the run there."""
    from e2e import PY, REPO, run, train_args

    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    args = train_args(corpus, preset="gpt-tiny", iters=10, extra=("--exit-interval", "4", "--save", save,
                                                                   "--metrics-file", metrics, "--log-interval", "2"))
    res = run([PY, os.path.join(REPO, "pretrain_gpt.py"), *args], timeout=120)
    assert res.returncode == 0, res.describe()
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows if r["type"] == "train"] == [0, 1, 2, 3]
    assert rows[-1]["type"] == "end" and rows[-1]["reason"] == "exit_interval"
    assert ck.read_tracker(save) == 4 and sorted(os.listdir(os.path.join(save, "iter_0000004"))) == [
        "manifest.json", "mp_rank_00"]
    sd = ck.load_rank_file(save, 4, 1, 1, 0, 0)
    assert sd["data"]["consumed_train_samples"] == 32 and sd["stage"]["step"] == 4
    assert sd["stage"]["older"] is not None and set(sd["rng"]) >= {"torch_cpu", "tracker", "numpy", "python"}
    assert sd["layout"] == {"t": 1, "d": 1, "w": 1, "tp_rank": 0, "pp_rank": 0, "schedule": "2bw", "split": None}
