"""Megatron's loading and run-length flags through the trainer: --finetune, --no-load-optim, --no-load-rng,
--skip-train, --train-samples with --lr-warmup-samples / --lr-decay-samples."""

from __future__ import annotations

import math
import os

import pytest
from ckpt_runs import _ckpt_data, gpt_args, one_rank_run, train  # noqa: F401
from e2e import once, read_metrics, train_losses

from megatron_2bw.checkpoint import checkpointing as ck


def _run(args: list[str], tmp_path, name: str) -> tuple[list[dict], str]:
    metrics = str(tmp_path / f"{name}.jsonl")
    res = train([*args, "--metrics-file", metrics])
    assert res.returncode == 0, res.describe()
    return read_metrics(metrics), res.stderr


def _valid(records: list[dict]) -> float:
    return next(r["loss"] for r in records if r["type"] == "eval" and r["split"] == "valid")


def _adam_steps(save: str, iteration: int) -> int:
    return ck.load_rank_file(save, iteration, 1, 1, 0, 0)["stage"]["optimizer"]["steps"]


def test_finetune_restarts_at_zero_with_the_checkpoints_weights_and_a_fresh_optimizer(one_rank_run, tmp_path):  # noqa: F811
    load = one_rank_run.save  # iteration 4, Adam after 4 updates
    assert _adam_steps(load, 4) == 4
    resumed, _ = _run([*gpt_args(iters=4), "--load", load, "--skip-train"], tmp_path, "eval_resume")
    tuned_eval, err = _run([*gpt_args(iters=4), "--load", load, "--finetune", "--skip-train"], tmp_path, "eval_ft")
    assert "--finetune: starting from the weights of" in err
    assert _valid(tuned_eval) == _valid(resumed)  # the same weights, bitwise
    fresh, _ = _run([*gpt_args(iters=4), "--skip-train", "--load", str(tmp_path / "empty"), "--save",
                     str(tmp_path / "empty")], tmp_path, "eval_scratch")
    assert _valid(fresh) != _valid(resumed)
    save = str(tmp_path / "ft")
    tuned, _ = _run([*gpt_args(iters=2), "--load", load, "--finetune", "--save", save], tmp_path, "ft")
    assert sorted(train_losses(tuned)) == [0, 1]  # the iteration restarts at 0
    assert ck.read_tracker(save) == 2 and _adam_steps(save, 2) == 2  # a fresh optimizer: 2 updates, not 4 + 2
    assert next(r for r in tuned if r["type"] == "start")["resumed_from"] is None


def test_no_load_optim_keeps_weights_and_iteration_with_a_fresh_optimizer(one_rank_run, tmp_path):  # noqa: F811
    load = str(tmp_path / "ckpt")
    import shutil

    shutil.copytree(one_rank_run.save, load)
    ck.write_tracker(load, 2)
    records, _ = _run([*one_rank_run.args, "--load", load, "--save", load, "--no-load-optim"], tmp_path, "nlo")
    straight, got = train_losses(one_rank_run.metrics), train_losses(records)
    assert sorted(got) == [2, 3] and got[2] == straight[2]  # same weights at iteration 2
    assert _adam_steps(load, 4) == 2  # Adam restarted at iteration 2: 2 updates, not 4
    mine, theirs = (ck.load_rank_file(s, 4, 1, 1, 0, 0)["model"]["language_model"]["encoder"]
                    for s in (load, one_rank_run.save))
    w = "layers.0.self_attention.query_key_value.weight"
    assert (mine[w] - theirs[w]).abs().max() > 1e-4  # a fresh Adam state made other updates


@pytest.fixture(scope="module")
@once
def dropout_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropout")
    args = gpt_args(iters=4, extra=("--hidden-dropout", "0.3", "--attention-dropout", "0.3"))
    save, metrics = str(out / "ckpt"), str(out / "m.jsonl")
    res = train([*args, "--save", save, "--save-interval", "2", "--metrics-file", metrics])
    assert res.returncode == 0, res.describe()
    return args, save, train_losses(read_metrics(metrics))


@pytest.mark.parametrize("no_load_rng", [False, True])
def test_no_load_rng_changes_the_dropout_masks_of_a_resume(dropout_run, tmp_path, no_load_rng):
    args, save, straight = dropout_run
    load = str(tmp_path / "ckpt")
    import shutil

    shutil.copytree(save, load)
    ck.write_tracker(load, 2)
    records, _ = _run([*args, "--load", load, *(["--no-load-rng"] if no_load_rng else [])], tmp_path, "r")
    got = train_losses(records)
    assert sorted(got) == [2, 3]
    if no_load_rng:  # this run's seeds: other dropout masks, other losses
        assert got[2] != straight[2]
    else:  # the checkpoint's RNG states: bitwise the uninterrupted run
        assert got == {k: straight[k] for k in got}


def test_train_samples_sets_iterations_and_a_sample_based_lr_schedule(tmp_path):
    """--train-samples 18 at global batch 4: 18 // 4 = 4 iterations; warm-up 8 and decay 16 samples (linear)."""
    args = [a for a in gpt_args(iters=0) if a not in ("--train-iters", "0")]
    args[args.index("constant")] = "linear"
    records, _ = _run([*args, "--train-samples", "18", "--lr-warmup-samples", "8", "--lr-decay-samples", "16",
                       "--min-lr", "1e-3"], tmp_path, "samples")
    lrs = [r["lr"] for r in records if r["type"] == "train"]
    lr, lo = 1e-2, 1e-3
    n = [4 * (i + 1) for i in range(4)]  # samples consumed by each update
    expected = [lr * k / 8 if k <= 8 else lo + (lr - lo) * (1 - (k - 8) / (16 - 8)) for k in n]
    assert lrs == pytest.approx(expected, rel=1e-12) and len(lrs) == 4
    end = records[-1]
    assert end["type"] == "end" and end["completed_iterations"] == 4


def test_sample_and_iteration_flags_do_not_mix(tmp_path):
    res = train([*gpt_args(iters=4), "--train-samples", "16"])
    assert res.returncode == 2 and "give --train-iters or --train-samples, not both" in res.stderr
    res = train([*gpt_args(iters=4), "--lr-decay-samples", "16"])
    assert res.returncode == 2 and "--lr-decay-samples needs --train-samples" in res.stderr
    res = train([*gpt_args(iters=4), "--finetune"])
    assert res.returncode == 2 and "--finetune needs --load DIR" in res.stderr
    assert not os.path.exists(str(tmp_path / "x"))


@pytest.fixture(scope="module")
@once
def bf16_run(tmp_path_factory):
    """bf16 weights with an fp32 master (the GPU precision): 3 steps, checkpoints at 2 and 3."""
    out = tmp_path_factory.mktemp("bf16")
    args = [*gpt_args(iters=3), "--bf16"]
    save, metrics = str(out / "ckpt"), str(out / "m.jsonl")
    res = train([*args, "--save", save, "--save-interval", "2", "--metrics-file", metrics])
    assert res.returncode == 0, res.describe()
    return args, save, train_losses(read_metrics(metrics))


@pytest.mark.parametrize("mode", ["--finetune", "--no-load-optim"])
def test_bf16_finetune_and_no_load_optim_start_and_train(bf16_run, tmp_path, mode):
    """The fp32 master is set from the loaded bf16 weights (review C2: a TypeError at start-up before)."""
    import shutil

    args, saved, straight = bf16_run
    load, save = str(tmp_path / "ckpt"), str(tmp_path / "out")
    shutil.copytree(saved, load)
    ck.write_tracker(load, 2)
    records, _ = _run([*args, "--load", load, mode, "--save", save], tmp_path, "tuned")
    got = train_losses(records)
    assert all(math.isfinite(v) for v in got.values()), got
    if mode == "--finetune":  # restarts at iteration 0 with a fresh optimizer: 3 updates
        assert sorted(got) == [0, 1, 2] and _adam_steps(save, 3) == 3
        evals = [_run([*args, "--load", load, *extra, "--skip-train"], tmp_path, f"e{i}")[0]
                 for i, extra in enumerate(([], ["--finetune"]))]
        assert _valid(evals[0]) == _valid(evals[1])  # the checkpoint's weights, bitwise
    else:  # iteration 2 on the checkpoint's weights: the uninterrupted run's loss, bitwise; Adam restarted
        assert sorted(got) == [2] and got[2] == straight[2]
        assert _adam_steps(save, 3) == 1
