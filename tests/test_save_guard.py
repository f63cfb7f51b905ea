"""Nothing in --save is overwritten silently, and a stop signal is a clean stop (issue 19, items 2, 3 and 6).

- ``--save`` over another run without ``--load``: one ``error:`` line, exit 2, every file of the old run
  byte for byte as it was (the pointer file included); ``--overwrite-save`` starts over after deleting it;
- a checkpoint save below the pointer file's iteration is refused before a byte is written;
- two jobs on one ``--save``: the second is refused with one line (through ``scripts/run_local.sh`` and
  directly), the first finishes with its checkpoints intact; the lock's stale cases are taken over;
- ranks that read different resume iterations are told apart (4 gloo processes);
- SIGTERM to ``scripts/run_local.sh`` saves and exits 0 without a traceback; SIGHUP to a plain trainer
  (no flag: the handler is on by default) does the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist
from ckpt_runs import _ckpt_data, gpt_args, one_rank_run  # noqa: F401
from e2e import PY, REPO, clean_env, read_metrics, run, start
from multiproc import run_workers

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint import manifest, save_guard
from megatron_2bw.errors import ConfigError
from megatron_2bw.training.session import resume_disagreement

SCRIPT = os.path.join(REPO, "pretrain_gpt.py")


def _digest(root: str) -> dict[str, str]:
    """Every file under ``root`` (the lock excepted) -> SHA-256 of its bytes."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n != save_guard.LOCK:
                p = os.path.join(d, n)
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------ --save over another run
def test_save_over_another_run_is_refused_and_nothing_moves(one_rank_run, tmp_path):  # noqa: F811
    save = str(tmp_path / "ckpt")
    shutil.copytree(one_rank_run.save, save)
    before = _digest(save)
    assert ck.read_tracker(save) == 4
    res = run([PY, SCRIPT, *gpt_args(iters=4), "--save", save, "--save-interval", "2"], timeout=300)
    assert res.returncode == 2, res.describe()
    errors = _error_lines(res.stderr)
    assert errors == [f"error: --save {save} already holds checkpoints (iterations 2, 4; "
                      f"latest_checkpointed_iteration.txt at 4) and this run starts from scratch (no --load): its "
                      "saves would overwrite them and move latest_checkpointed_iteration.txt backwards; pass --load "
                      f"{save} to resume that run, give another --save, or --overwrite-save to delete them and start "
                      "over"], res.describe()
    assert "Traceback" not in res.output
    assert _digest(save) == before and ck.read_tracker(save) == 4  # the pointer and every byte unchanged
    assert not os.path.exists(os.path.join(save, save_guard.LOCK))  # released on the refusal

    # --overwrite-save: starts over in the same place; the new run's checkpoints are the only ones
    metrics = str(tmp_path / "m.jsonl")
    res = run([PY, SCRIPT, *gpt_args(iters=4), "--save", save, "--save-interval", "4", "--overwrite-save",
               "--metrics-file", metrics], timeout=300)
    assert res.returncode == 0, res.describe()
    assert "--overwrite-save: removed the checkpoints in" in res.stderr
    assert ck.read_tracker(save) == 4 and manifest.list_iterations(save) == [4]  # iter_0000002 went with the old run
    again = {r["iteration"]: r["loss"] for r in read_metrics(metrics) if r["type"] == "train"}
    ref = {r["iteration"]: r["loss"] for r in one_rank_run.metrics if r["type"] == "train"}
    assert again == ref and len(ref) == 4  # a fresh start: the original run's steps again, bitwise


def test_fresh_start_rules(tmp_path):
    save = str(tmp_path / "s")
    os.makedirs(os.path.join(save, "iter_0000010", "mp_rank_00"))
    assert save_guard.saved_checkpoints(save) is None  # a save killed before its first file: not a checkpoint
    open(os.path.join(save, "iter_0000010", "mp_rank_00", "model_optim_rng.pt"), "wb").close()
    assert save_guard.saved_checkpoints(save) == "iterations 10"
    assert save_guard.check_fresh_start(save, save, True, False) is False  # --load = --save resumes
    with pytest.raises(ConfigError, match="--finetune starts a new run at iteration 0"):
        save_guard.check_fresh_start(save, save, False, False)
    with pytest.raises(ConfigError, match=r"resumes from --load /elsewhere, another directory"):
        save_guard.check_fresh_start(save, "/elsewhere", False, False)
    with pytest.raises(ConfigError, match="would delete the checkpoints of --load"):
        save_guard.check_fresh_start(save, save, False, True)
    assert save_guard.check_fresh_start(save, None, False, True) is True
    save_guard.clear_checkpoints(save)
    assert save_guard.saved_checkpoints(save) is None
    assert save_guard.check_fresh_start(str(tmp_path / "empty"), None, False, False) is False
    # the same directory through a symlink is the same directory
    os.symlink(save, str(tmp_path / "link"))
    assert save_guard.same_dir(save, str(tmp_path / "link"))
    # --load through the link, --save the directory: auto-resume's first run, not "--load holds no checkpoint"
    assert ck.find_checkpoint(str(tmp_path / "link"), save) is None


def test_non_utf8_pointer_is_one_line(tmp_path):
    with open(os.path.join(tmp_path, ck.TRACKER), "wb") as f:
        f.write(b"\xff\xfe2\x000")
    with pytest.raises(ConfigError, match=r"latest_checkpointed_iteration.txt does not hold an iteration number "
                                          r"\(not UTF-8 text"):
        ck.find_checkpoint(str(tmp_path), str(tmp_path))


def test_dangling_save_or_load_symlink_is_named(tmp_path):
    from megatron_2bw.training.supervision import check_load_path, check_save_dir

    link = str(tmp_path / "save")
    os.symlink(str(tmp_path / "gone" / "ckpt"), link)
    for check, flag in ((check_save_dir, "--save"), (check_load_path, "--load")):
        with pytest.raises(ConfigError, match=rf"{flag} {link} is a symbolic link to .*gone/ckpt, which does not "
                                              "exist"):
            check(link)


class _Rank0:
    rank = tp_rank = pp_rank = dp_rank = 0
    d = 1


def test_a_save_below_the_pointer_is_refused_before_writing(tmp_path):
    root = str(tmp_path)
    ck.write_tracker(root, 60)
    called = []
    with pytest.raises(ConfigError, match=r"latest_checkpointed_iteration.txt names iteration 60, newer than this "
                                          r"save of iteration 20: another job writes into this --save"):
        ck.save(root, 20, _Rank0(), lambda: called.append(1) or {"layout": {}})
    assert not os.path.exists(ck.iteration_dir(root, 20)) and ck.read_tracker(root) == 60


# ------------------------------------------------------------------ the lock
def test_lock_refuses_a_live_holder_and_takes_over_stale_ones(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    save = str(tmp_path)
    path = os.path.join(save, save_guard.LOCK)
    lock = save_guard.acquire(save)
    held = json.load(open(path))
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    with pytest.raises(ConfigError, match=rf"--save {save} is in use by another job \(host {socket.gethostname()}, "
                                          rf"pid {os.getpid()}, since .*; lock {path}\)"):
        save_guard.acquire(save)
    with pytest.raises(ConfigError, match="is in use by another job"):
        save_guard.check_lock(save)
    lock.release()
    assert not os.path.exists(path)

    def plant(**kw):
        rec = {"host": socket.gethostname(), "pid": os.getpid(), "start": save_guard._start_ticks(os.getpid()),
               "job": None, "time": "then", **kw}
        with open(path, "w") as f:
            json.dump(rec, f)

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    plant(pid=int(dead.stdout))  # a dead pid on this host
    save_guard.check_lock(save)
    save_guard.acquire(save).release()
    assert "pid %s is no longer running" % dead.stdout.strip() in caplog.text
    plant(start=-1)  # our pid, but another process's start time: a reused pid
    save_guard.acquire(save).release()
    assert "now belongs to another process" in caplog.text
    plant(host="elsewhere.example")  # another host: cannot be checked, refused
    with pytest.raises(ConfigError, match="host elsewhere.example"):
        save_guard.acquire(save)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    plant(host="elsewhere.example", job="job-7")  # the same job (a restart on another host): taken over
    assert save_guard.acquire(save).record["job"] == "job-7"
    plant(job="job-7")  # the same job id but a live process here: still refused
    with pytest.raises(ConfigError, match="is in use by another job"):
        save_guard.acquire(save)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv-id names no job
    assert save_guard.job_id() is None


def test_two_jobs_on_one_save(tmp_path):
    """Job A trains; job B on the same --save is refused with one line (through run_local.sh's validation and
    directly), and A finishes with every checkpoint verified against its manifest."""
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "a.jsonl")
    a_args = [*gpt_args(iters=100000), "--save", save, "--load", save, "--save-interval", "50",
              "--metrics-file", metrics]
    job_a = start([PY, SCRIPT, *a_args])
    job_a.wait_for("successfully saved checkpoint from iteration")
    b_args = [*gpt_args(iters=100000), "--save", save, "--load", save, "--save-interval", "50"]
    direct = run([PY, SCRIPT, *b_args], timeout=300)
    via_script = run(["bash", "scripts/run_local.sh", "pretrain_gpt.py", *b_args],
                     env=clean_env(NGPU="0", NPROC="1", PYTHON=PY), timeout=300)
    os.kill(job_a.pid, signal.SIGTERM)  # A stops cleanly: saves and exits 0
    res_a = job_a.finish()
    assert res_a.returncode == 0, res_a.describe()
    saved = [r["completed_iterations"] for r in read_metrics(metrics) if r["type"] == "checkpoint"]
    want = f"error: --save {save} is in use by another job (host {socket.gethostname()}, pid {job_a.pid}, since "
    for res in (direct, via_script):
        assert res.returncode == 2, res.describe()
        errors = _error_lines(res.stderr)
        assert len(errors) == 1 and errors[0].startswith(want), res.describe()
        assert "Traceback" not in res.output
    assert "run_local:" not in via_script.stderr  # refused before torchrun started
    assert ck.read_tracker(save) == saved[-1] and manifest.list_iterations(save) == saved  # only A wrote here
    for it in saved:
        manifest.verify(ck.iteration_dir(save, it))  # every shard as job A wrote it
    assert not os.path.exists(os.path.join(save, save_guard.LOCK))  # A released its lock


def _disagree(its: list) -> object:
    return resume_disagreement(its[dist.get_rank()])


def test_ranks_that_read_different_iterations_are_told_apart():
    assert run_workers(_disagree, 4, [15, 15, 15, 15], timeout=120) == [None] * 4
    assert run_workers(_disagree, 4, [15, 20, 15, 15], timeout=120) == [(15, 20)] * 4
    assert run_workers(_disagree, 4, [None, 20, 20, 20], timeout=120) == [(None, 20)] * 4


# ------------------------------------------------------------------ graceful stop
def test_sigterm_to_run_local_saves_and_exits_0_without_a_traceback(tmp_path):
    save = str(tmp_path / "ckpt")
    args = [*gpt_args(iters=2000), "--save", save, "--load", save, "--save-interval", "1000", "--log-interval", "1"]
    job = start(["bash", "scripts/run_local.sh", "pretrain_gpt.py", *args],
                env=clean_env(NGPU="0", NPROC="2", PYTHON=PY, SHUTDOWN_TIMEOUT="60"))
    job.wait_for("iteration        3/")
    os.kill(job.pid, signal.SIGTERM)
    res = job.finish()
    assert res.returncode == 0, res.describe()
    assert "Traceback" not in res.output and "SignalException" not in res.output, res.describe()
    stopped = ck.read_tracker(save)
    assert 3 <= stopped < 2000 and f"exiting at iteration {stopped} after SIGTERM" in res.stderr, res.describe()
    manifest.verify(ck.iteration_dir(save, stopped))


def test_sighup_saves_by_default(tmp_path):
    save = str(tmp_path / "ckpt")
    job = start([PY, SCRIPT, *gpt_args(iters=2000), "--save", save, "--save-interval", "1000", "--log-interval", "1"])
    job.wait_for("iteration        3/")
    os.kill(job.pid, signal.SIGHUP)
    res = job.finish()
    assert res.returncode == 0, res.describe()
    stopped = ck.read_tracker(save)
    assert "received SIGHUP: saving a checkpoint at the next step boundary" in res.stderr
    assert f"exiting at iteration {stopped} after SIGHUP" in res.stderr and stopped >= 3, res.describe()
