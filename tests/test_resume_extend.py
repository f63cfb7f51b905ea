"""Raising --train-iters on resume extends the run, as in Megatron (issue 19, item 3).

A run of 4 iterations resumed with ``--train-iters 8`` logs, step for step and bitwise, the losses of an
uninterrupted 8-iteration run with the same learning-rate schedule (the sample order of the steps already
trained does not depend on ``--train-iters``); with the schedule lengths at their defaults (``--lr-decay-iters``
= ``--train-iters``) the resume is accepted and logged; lowering ``--train-iters`` is still refused.
"""

from __future__ import annotations

import os

from ckpt_runs import _ckpt_data, gpt_args  # noqa: F401
from e2e import PY, REPO, read_metrics, run, train_losses

SCRIPT = os.path.join(REPO, "pretrain_gpt.py")
SCHEDULE = ("--lr-decay-style", "linear", "--lr-decay-iters", "8", "--lr-warmup-iters", "1", "--min-lr", "1e-3")


def _train(iters: int, save: str, metrics: str, *extra: str):
    return run([PY, SCRIPT, *gpt_args(iters=iters), *extra, "--save", save, "--load", save, "--save-interval", "4",
                "--metrics-file", metrics], timeout=300)


def test_raised_train_iters_continues_as_the_longer_run(tmp_path):
    ref_save, ref_m = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    ref = _train(8, ref_save, ref_m, *SCHEDULE)
    assert ref.returncode == 0, ref.describe()
    save, m1, m2 = str(tmp_path / "ckpt"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    first = _train(4, save, m1, *SCHEDULE)
    assert first.returncode == 0, first.describe()
    again = _train(8, save, m2, *SCHEDULE)
    assert again.returncode == 0, again.describe()
    assert "resumed from iteration 4" in again.stderr and "with the run extended: --train-iters 4 -> 8" in again.stderr
    want = train_losses(read_metrics(ref_m))
    got = {**train_losses(read_metrics(m1)), **train_losses(read_metrics(m2))}
    assert sorted(got) == list(range(8)) and got == want  # every step, bitwise


def test_schedule_lengths_that_follow_train_iters_are_accepted_and_lowering_is_refused(tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    warm = ("--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.25")
    first = _train(4, save, metrics, *warm)
    assert first.returncode == 0, first.describe()
    ok = run([PY, SCRIPT, *gpt_args(iters=40), *warm, "--save", save, "--load", save, "--validate-only"])
    assert ok.returncode == 0 and "resuming from iteration 4" in ok.stdout + ok.stderr, ok.describe()
    assert "with the run extended: --train-iters 4 -> 40; --lr-decay-iters 4 -> 40; --lr-warmup-iters 1 -> 10" \
        in ok.stderr, ok.describe()
    lower = run([PY, SCRIPT, *gpt_args(iters=3), *warm, "--save", save, "--load", save, "--validate-only"])
    assert lower.returncode == 2 and "changed settings: --train-iters 4 -> 3" in lower.stderr, lower.describe()
    other = run([PY, SCRIPT, *gpt_args(iters=40), "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
                 "--save", save, "--load", save, "--validate-only"])  # a warm-up that no fraction explains
    assert other.returncode == 2 and "--lr-warmup-iters 1 -> 3" in other.stderr, other.describe()
    assert "--train-iters" not in other.stderr.split("changed settings:")[1].split("(")[0], other.describe()
