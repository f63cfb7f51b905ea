"""Supervision through the real trainer under torchrun (2 processes, tiny GPT, CPU).

- a rank that stops (SIGSTOP) is named by the watchdog within ``--stall-timeout-s`` (plus one
  heartbeat interval), and the job ends with the watchdog's exit status instead of hanging until
  the collective timeout;
- ``kill -9`` of the launcher takes its workers with it (parent-death signal): none is left
  training on the same ``--save``.
"""

from __future__ import annotations

import os
import signal
import time

from e2e import corpus, descendants, start, torchrun_cmd, train_args  # noqa: F401

from megatron_2bw.training.watchdog import EXIT_STALLED

STALL_S = 4.0


def long_run(corpus, tmp_path, *extra: str) -> list[str]:  # noqa: F811
    """A 2-process (w=2) run long enough to act on while it trains."""
    return [*train_args(corpus, preset="gpt-tiny", schedule="flush", iters=3000, micro=2, global_batch=4),
            "--log-interval", "1", "--eval-interval", "100000", "--metrics-file", str(tmp_path / "m.jsonl"), *extra]


def worker_pids(launcher: int) -> dict[int, int]:
    """Global rank -> pid of the trainer processes under ``launcher``."""
    out = {}
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"RANK" in env and b"pretrain_gpt.py" in cmd:
            out[int(env[b"RANK"])] = pid
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_rank_is_named_within_the_stall_timeout(corpus, tmp_path):  # noqa: F811
    job = start(torchrun_cmd("pretrain_gpt.py", long_run(corpus, tmp_path, "--stall-timeout-s", str(STALL_S)),
                             nproc=2))
    job.wait_for("iteration        5/")
    pids = worker_pids(job.pid)
    assert sorted(pids) == [0, 1]
    stopped_at = time.monotonic() - job.t0
    os.kill(pids[1], signal.SIGSTOP)
    try:
        named = job.wait_for("watchdog:", timeout=60)
    finally:
        os.kill(pids[1], signal.SIGCONT)  # let torchrun's SIGTERM end it at once
    res = job.finish()
    line = next(line for _, line in res.lines if "watchdog:" in line)
    assert line.startswith("error: rank 0: watchdog: rank 1 (host ") and f"pid {pids[1]})" in line, res.describe()
    assert "stopped responding" in line and f"--stall-timeout-s {STALL_S:g}" in line
    interval = min(5.0, STALL_S / 10)
    assert STALL_S <= named - stopped_at <= STALL_S + 4 * interval + 2.0, (named - stopped_at, res.describe())
    assert f"exitcode  : {EXIT_STALLED}" in res.stderr, res.describe()


def test_workers_die_with_a_killed_launcher(corpus, tmp_path):  # noqa: F811
    job = start(torchrun_cmd("pretrain_gpt.py", long_run(corpus, tmp_path), nproc=2))
    job.wait_for("iteration        5/")
    pids = worker_pids(job.pid)
    assert sorted(pids) == [0, 1]
    os.kill(job.pid, signal.SIGKILL)  # the launcher only: the workers are in their own sessions
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.1)
    survivors = [p for p in pids.values() if alive(p)]
    job.kill()
    assert survivors == [], "workers outlived their launcher"
    job.finish()
