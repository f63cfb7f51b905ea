"""The reliability and logging modules, wired into the real trainer (one process, tiny GPT, CPU).

Each test runs ``pretrain_gpt.py`` in a subprocess and checks what a user sees against an
independent record of the same run: the metrics file, the checkpoint files, an uninterrupted run.
- SIGTERM with ``--exit-signal-handler --save``: saved at the next boundary, exit 0, and a relaunch
  ends with the weights, optimizer state and losses of the uninterrupted run, bitwise;
- Ctrl-C: saves too, and prints no traceback;
- ``--lr 1e4`` and an fp16 constant loss scale that overflows every step: one ``error:`` line,
  exit 3, the last good checkpoint kept;
- the training, validation and checkpoint lines parse with Megatron-style regular expressions
  and carry the metrics file's numbers, numbered from 1;
- ``--wandb-project`` (offline) and ``--tensorboard-dir`` record the metrics file's losses.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal

import pytest
import torch
from e2e import PY, REPO, clean_env, corpus, read_metrics, run, start, train_args, train_losses  # noqa: F401
from test_log_format import MEGATRON, VALID, grab

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.faults import POISON_ENV
from megatron_2bw.training.health import EXIT_UNHEALTHY

SCRIPT = os.path.join(REPO, "pretrain_gpt.py")
ITERS = 120


def gpt_args(corpus, iters: int = ITERS, *extra: str) -> list[str]:  # noqa: F811
    """One process, flush (d=1): logs every 5 steps, evaluates every 40."""
    return [*train_args(corpus, preset="gpt-tiny", schedule="flush", iters=iters, micro=2, global_batch=4),
            "--log-interval", "5", "--eval-interval", "40", *extra]


SAVE_EVERY_40 = ("--save-interval", "40")


def same_tree(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


# What differs between two runs' files of the same state: the write time, the file and the paths in the flags,
# and the host RNG streams (start-up of a resumed run draws differently before restoring them).
NOT_STATE = ("time", "args", "config", "rng", "path")


def same_checkpoint(root_a: str, root_b: str, iteration: int, t: int = 1, d: int = 1) -> bool:
    """Whether two runs' checkpoints at ``iteration`` hold the same weights, optimizer state, step and data position."""
    for tp in range(t):
        for pp in range(d):
            a = ck.load_rank_file(root_a, iteration, t, d, tp, pp)
            b = ck.load_rank_file(root_b, iteration, t, d, tp, pp)
            keep = lambda sd: {k: v for k, v in sd.items() if k not in NOT_STATE}  # noqa: E731
            if not same_tree(keep(a), keep(b)):
                return False
    return True


def tracker(save: str) -> int:
    with open(os.path.join(save, ck.TRACKER)) as f:
        return int(f.read().strip())


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):  # noqa: F811
    """The uninterrupted run: the reference of the resume tests and the source of the log-line test."""
    out = tmp_path_factory.mktemp("straight")
    save, metrics = str(out / "ckpt"), str(out / "m.jsonl")
    res = run([PY, SCRIPT, *gpt_args(corpus, ITERS, *SAVE_EVERY_40), "--save", save, "--metrics-file", metrics])
    assert res.returncode == 0, res.describe()
    return res, read_metrics(metrics), save


def interrupt_and_resume(corpus, tmp_path, sig: signal.Signals, straight):  # noqa: F811
    """Send ``sig`` after iteration 10 is logged; the job must save, exit 0, and a relaunch end as ``straight``."""
    save, m1, m2 = str(tmp_path / "ckpt"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    job = start([PY, SCRIPT, *gpt_args(corpus, ITERS, *SAVE_EVERY_40), "--save", save, "--metrics-file", m1,
                 "--exit-signal-handler"])
    job.wait_for("iteration       10/")
    os.kill(job.pid, sig)
    res = job.finish()
    assert res.returncode == 0, res.describe()
    stopped = tracker(save)
    assert 10 <= stopped < ITERS, res.describe()
    assert re.search(rf"exiting at iteration {stopped} after {sig.name}", res.stderr), res.describe()
    end = [r for r in read_metrics(m1) if r["type"] == "end"]
    assert end[0]["reason"] == "signal" and end[0]["completed_iterations"] == stopped
    again = run([PY, SCRIPT, *gpt_args(corpus, ITERS, *SAVE_EVERY_40), "--save", save, "--load", save,
                 "--metrics-file", m2])
    assert again.returncode == 0, again.describe()
    assert f"resumed from iteration {stopped}" in again.stderr
    ref_res, ref_metrics, ref_save = straight
    ref = train_losses(ref_metrics)
    got = {**train_losses(read_metrics(m1)), **train_losses(read_metrics(m2))}
    assert got == ref  # every step's loss, before and after the interruption, bitwise
    assert same_checkpoint(save, ref_save, ITERS)
    return res


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)  # USR1: --exit-signal
def test_sigterm_saves_at_the_next_boundary_and_a_relaunch_is_bitwise(corpus, tmp_path, straight, sig):  # noqa: F811
    res = interrupt_and_resume(corpus, tmp_path, sig, straight)
    assert f"received {sig.name}: saving a checkpoint at the next step boundary" in res.stderr


def test_ctrl_c_saves_and_prints_no_traceback(corpus, tmp_path, straight):  # noqa: F811
    res = interrupt_and_resume(corpus, tmp_path, signal.SIGINT, straight)
    assert "Traceback" not in res.output and "KeyboardInterrupt" not in res.output, res.describe()


def test_exit_duration_saves_and_exits_0(corpus, tmp_path):  # noqa: F811
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    res = run([PY, SCRIPT, *gpt_args(corpus, 20000), "--save", save, "--metrics-file", metrics,
               "--exit-duration-in-mins", "0.05"])
    assert res.returncode == 0, res.describe()
    (end,) = [r for r in read_metrics(metrics) if r["type"] == "end"]
    assert end["reason"] == "duration" and tracker(save) == end["completed_iterations"] > 0
    assert res.seconds >= 3.0 and end["completed_iterations"] < 20000  # 0.05 min counted from start-up
    assert f"exiting at iteration {tracker(save)} after --exit-duration-in-mins 0.05" in res.stderr


def test_stale_temporaries_are_removed_at_start_up(corpus, tmp_path):  # noqa: F811
    save = tmp_path / "ckpt"
    (save / "iter_0000004" / "mp_rank_00").mkdir(parents=True)
    dead = 2**22 + 4321  # above Linux's largest pid: no live process has it
    stale = save / "iter_0000004" / "mp_rank_00" / f"model_optim_rng.pt.tmp.{dead}"
    stale.write_bytes(b"partial")
    res = run([PY, SCRIPT, *gpt_args(corpus, 4), "--save", str(save)])
    assert res.returncode == 0, res.describe()
    assert not stale.exists() and f"removed stale temporary {stale}" in res.stderr


def test_full_disk_for_the_metrics_file_is_one_line_naming_it(corpus):  # noqa: F811
    res = run([PY, SCRIPT, *gpt_args(corpus, 10), "--metrics-file", "/dev/full"])
    assert res.returncode == 1 and "Traceback" not in res.output, res.describe()
    assert error_lines(res.stderr) == ["error: rank 0: writing /dev/full failed: No space left on device (ENOSPC)"]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(corpus, tmp_path):  # noqa: F811
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    res = run([PY, SCRIPT, *gpt_args(corpus, 30, "--lr", "1e4", "--save-interval", "1"), "--save", save,
               "--metrics-file", metrics])
    assert res.returncode == EXIT_UNHEALTHY, res.describe()
    (line,) = error_lines(res.stderr)
    assert "training diverged" in line and "Traceback" not in res.output
    train = [r for r in read_metrics(metrics) if r["type"] == "train"]
    bad = next(r["iteration"] for r in train if r["loss"] is None or r["grad_norm"] is None)  # JSON null: non-finite
    assert train[-1]["iteration"] < 29  # stopped long before the end
    assert line.startswith(f"error: iteration {bad + 1}: ")  # 1-based, as every log line
    assert tracker(save) == bad  # the last checkpoint is the last healthy step's
    assert not os.path.exists(ck.iteration_dir(save, bad + 1))


def test_fp16_constant_scale_that_overflows_every_step_stops(corpus, tmp_path):  # noqa: F811
    """A constant scale under which every step overflows (the fault injector puts an inf into every step's
    gradient: the scale 60000 alone overflowed only through the fp16 gradient norm, gpu-review S1, fixed)."""
    metrics = str(tmp_path / "m.jsonl")
    res = run([PY, SCRIPT, *gpt_args(corpus, 30, "--fp16", "--loss-scale", "60000", "--max-skipped-steps", "3"),
               "--metrics-file", metrics], env=clean_env(**{POISON_ENV: "0:0-29"}))
    assert res.returncode == EXIT_UNHEALTHY, res.describe()
    (line,) = error_lines(res.stderr)
    assert "more than --max-skipped-steps 3" in line and "every step overflowed" in line
    train = [r for r in read_metrics(metrics) if r["type"] == "train"]
    assert all(r["skipped"] for r in train) and len(train) >= 4
    assert line.startswith("error: iteration 4: 4 consecutive steps skipped")


def test_log_lines_parse_with_megatron_regexes_and_carry_the_metrics(straight):
    res, records, _ = straight
    train = sorted((r for r in records if r["type"] == "train"), key=lambda r: r["iteration"])
    lines = [line for line in res.stderr.splitlines() if re.search(MEGATRON["timestamp"], line)]
    assert len(lines) == ITERS // 5
    for line in lines:
        it, total = (int(x) for x in grab(MEGATRON["iteration"], line))
        window = train[it - 5:it]  # records are 0-based: iterations it-5+1 .. it
        assert total == ITERS and [r["iteration"] + 1 for r in window] == list(range(it - 4, it + 1))
        assert int(grab(MEGATRON["consumed"], line)) == window[-1]["consumed_samples"] == 4 * it
        assert int(grab(MEGATRON["gbs"], line)) == 4
        loss = sum(r["loss"] for r in window) / 5
        assert grab(MEGATRON["lm"], line) == f"{loss:.6E}"
        assert float(grab(MEGATRON["lr"], line)) == pytest.approx(window[-1]["lr"], rel=1e-6)
        assert float(grab(MEGATRON["gnorm"], line)) == pytest.approx(window[-1]["grad_norm"], abs=1e-3)
        assert int(grab(MEGATRON["skipped"], line)) == 0 and int(grab(MEGATRON["nan"], line)) == 0
        assert float(grab(MEGATRON["mem_engine"], line)) > 0 and float(grab(MEGATRON["tflops"], line)) > 0
    assert len(re.findall(r"\[Rank 0\] \(after 5 iterations\) memory \(MB\)", res.stderr)) == 1
    assert len(re.findall(r" \[ETA\] \d+ of 120 iterations done ", res.stderr)) == ITERS // 5
    evals = {(r["iteration"] + 1, r["split"]): r["loss"] for r in records if r["type"] == "eval"}
    seen = {}
    for line in res.stderr.splitlines():
        if "validation loss at" in line:
            it, where = grab(VALID["at"], line)
            seen[(int(it), "test" if where and "test" in where else "valid")] = grab(VALID["lm"], line)
    assert seen == {k: f"{v:.6E}" for k, v in evals.items()}
    saved = [int(x) for x in re.findall(r"successfully saved checkpoint from iteration\s+(\d+)", res.stderr)]
    assert saved == [r["completed_iterations"] for r in records if r["type"] == "checkpoint"] == [40, 80, 120]
    (end,) = [r for r in records if r["type"] == "end"]
    # logging never drains: one drained boundary per evaluation and checkpoint (they coincide; the last is the end)
    assert end["pipeline_drains"] == len(saved)


def test_offline_wandb_and_tensorboard_record_the_losses(corpus, tmp_path):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_wandb_tb import read_wandb_records

    metrics = str(tmp_path / "m.jsonl")
    env = clean_env(**{v: str(tmp_path / v.lower()) for v in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                                               "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")})
    for v in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME"):
        env.pop(v, None)
    res = run([PY, SCRIPT, *gpt_args(corpus, 10), "--metrics-file", metrics, "--wandb-project", "m2bw-test",
               "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb"),
               "--tensorboard-dir", str(tmp_path / "tb")], env=env)
    assert res.returncode == 0, res.describe()
    want = {i + 1: loss for i, loss in train_losses(read_metrics(metrics)).items()}  # writers use 1-based steps
    assert sorted(want) == list(range(1, 11))
    (path,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    got = {}
    for rec in read_wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            values = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            if "train/loss" in values:
                got[values["_step"]] = values["train/loss"]
    assert got == want
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb.keys() == want.keys() and all(math.isclose(tb[k], want[k], rel_tol=1e-6) for k in want)  # float32


def test_missing_wandb_name_is_one_line_before_start(corpus, tmp_path):  # noqa: F811
    res = run([PY, SCRIPT, *gpt_args(corpus, 10), "--wandb-project", "p"])
    assert res.returncode == 2 and error_lines(res.stderr) == [
        "error: --wandb-project needs --wandb-exp-name (the run's name, as in Megatron)"], res.describe()


BASE = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
        "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--device", "cpu"]


@pytest.mark.parametrize("flags, message", [
    (["--exit-signal", "SIGKILL"], "--exit-signal SIGKILL cannot be handled"),
    (["--exit-signal", "nope"], "--exit-signal 'nope' is not a signal name (e.g. SIGTERM, SIGUSR1)"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be a positive number, got 0.0"),
    (["--max-skipped-steps", "0"], "--max-skipped-steps must be a positive integer (got 0)"),
    (["--stall-timeout-s", "1"], "--stall-timeout-s must be 0 (off) or at least 2 seconds (got 1.0)"),
    (["--stall-timeout-s", "inf"], "--stall-timeout-s must be finite, got inf"),
])
def test_new_flags_are_checked_before_start(flags, message):
    from megatron_2bw.cli import build_config, parse_args
    from megatron_2bw.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        build_config(parse_args([*BASE, *flags], "gpt"), "gpt", 1, cuda_available=False)
    assert str(e.value) == message


def test_new_flags_reach_the_config():
    from megatron_2bw.argv import megatron_args
    from megatron_2bw.cli import build_config, parse_args

    cfg = build_config(parse_args([*BASE, "--exit-signal-handler", "--exit-signal", "usr2", "--exit-duration-in-mins",
                                   "90", "--max-skipped-steps", "7", "--stall-timeout-s", "0", "--wandb-project", "p",
                                   "--wandb-exp-name", "n", "--wandb-save-dir", "w"], "gpt"), "gpt", 1,
                       cuda_available=False)
    tc = cfg.training
    assert (tc.exit_signal_handler, tc.exit_signal, tc.exit_duration_in_mins, tc.max_skipped_steps) == \
        (True, "SIGUSR2", 90.0, 7)
    assert cfg.system.stall_timeout_s == 0.0 and (tc.wandb_project, tc.wandb_exp_name, tc.wandb_save_dir) == \
        ("p", "n", "w")
    saved = megatron_args(cfg)  # what checkpoints record
    assert saved["exit_signal_handler"] is True and saved["max_skipped_steps"] == 7


def test_recompute_flags_reach_the_engine(corpus, tmp_path):  # noqa: F811
    """--recompute-granularity/--recompute-method change what is stashed, not what is computed."""
    runs = {}
    for name, extra in (("none", ()), ("uniform1", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                                    "--recompute-num-layers", "1"))):
        metrics = str(tmp_path / f"{name}.jsonl")
        args = [*train_args(corpus, preset="gpt-tiny", schedule="flush", iters=3, micro=2, global_batch=4),
                "--log-interval", "1", "--eval-iters", "0", "--metrics-file", metrics, *extra]
        res = run([PY, SCRIPT, *args], timeout=180)
        assert res.returncode == 0, res.describe()
        records = read_metrics(metrics)
        stash = max(st["peak_stashed_bytes"] for r in records if r["type"] == "stages" for st in r["stages"])
        runs[name] = (train_losses(records), stash)
    assert runs["uniform1"][0] == runs["none"][0]  # bitwise: the replay re-runs the same operations
    assert 0 < runs["uniform1"][1] < 0.5 * runs["none"][1], runs
