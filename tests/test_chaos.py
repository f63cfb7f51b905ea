"""Chaos: a PipeDream-2BW job (4 processes, d=2, w=2) that loses ranks or is preempted still ends
with exactly the weights of the uninterrupted run (``gpt_2bw_run``, 30 steps).

- Under ``torchrun --max-restarts 3`` a rank is killed at 3 random steps, one per launch attempt
  (the fault plan names the attempt by ``$TORCHELASTIC_RESTART_COUNT``, so a restarted job is not
  killed again at the same step); torchrun restarts the job, which resumes from its last checkpoint
  (saved every 4 steps).
- SIGTERM to the launcher (as a SLURM preemption reaches it) with ``--exit-signal-handler``: the
  workers save at the next step boundary and exit 0; a relaunch finishes the run.
Both end bitwise equal to the uninterrupted run: every parameter, both weight versions, the
optimizer state and every logged loss.
"""

from __future__ import annotations

import os
import random
import re
import signal

from e2e import clean_env, corpus, gpt_2bw_run, read_metrics, start, torchrun, torchrun_cmd, train_losses  # noqa: F401
from test_trainer_wiring import same_checkpoint, tracker

from megatron_2bw.faults import KILL_PLAN_ENV

SEED = 20261130  # the kill plan's random steps and ranks; printed on failure
CHAOS_TIMEOUT = 600


def kill_plan(seed: int, attempts: int = 3, iters: int = 30) -> list[tuple[int, int, int]]:
    """(attempt, rank, step): 3 distinct random steps in increasing order, a random rank each."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, iters - 1), attempts))
    return [(a, rng.randrange(4), s) for a, s in enumerate(steps)]


def resumed_losses(metrics: str) -> dict[int, float]:
    """Each step's loss from the last attempt that logged it (a killed attempt may log steps it never saved)."""
    out: dict[int, float] = {}
    for r in read_metrics(metrics):
        if r["type"] == "train":
            out[r["iteration"]] = r["loss"]
    return out


def test_ranks_killed_at_random_steps_under_max_restarts_end_bitwise(gpt_2bw_run, tmp_path):  # noqa: F811
    plan = kill_plan(SEED)
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    env = clean_env(**{KILL_PLAN_ENV: ",".join(f"{a}:{r}:{s}" for a, r, s in plan)})
    args = [*gpt_2bw_run.args, "--save", save, "--load", save, "--save-interval", "4", "--metrics-file", metrics]
    cmd = torchrun_cmd(gpt_2bw_run.script, args, launcher=("--standalone", "--max-restarts", "3"))
    res = start(cmd, env=env).finish(CHAOS_TIMEOUT)
    why = f"plan {plan}\n{res.describe()}"
    assert res.returncode == 0, why
    for _, rank, step in plan:
        assert f"error: rank {rank}: fault injection (kill rank {rank} at iteration {step})" in res.stderr, why
    starts = [r for r in read_metrics(metrics) if r["type"] == "start"]
    assert len(starts) == 4, why  # the first launch and three restarts
    assert [s["resumed_from"] for s in starts[1:]] == [(step // 4) * 4 or None for _, _, step in plan], why
    assert tracker(save) == 30
    assert resumed_losses(metrics) == train_losses(gpt_2bw_run.metrics), why
    assert same_checkpoint(save, gpt_2bw_run.save, 30, t=1, d=2), why


def test_sigterm_to_the_launcher_saves_and_a_relaunch_ends_bitwise(gpt_2bw_run, tmp_path):  # noqa: F811
    save, m1, m2 = str(tmp_path / "ckpt"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    args = [*gpt_2bw_run.args, "--save", save, "--save-interval", "10", "--log-interval", "2", "--exit-signal-handler"]
    job = start(torchrun_cmd(gpt_2bw_run.script, [*args, "--metrics-file", m1]))
    job.wait_for("iteration        4/")
    os.kill(job.pid, signal.SIGTERM)  # torchrun forwards SIGTERM to every worker
    res = job.finish()
    stopped = tracker(save)
    assert 4 <= stopped < 30, res.describe()
    assert re.search(rf"exiting at iteration {stopped} after SIGTERM", res.stderr), res.describe()
    end = [r for r in read_metrics(m1) if r["type"] == "end"]
    assert end and end[0]["reason"] == "signal" and end[0]["completed_iterations"] == stopped
    again = torchrun(gpt_2bw_run.script, [*args, "--load", save, "--metrics-file", m2])  # a plain relaunch
    assert again.returncode == 0, again.describe()
    assert f"resumed from iteration {stopped}" in again.stderr
    got = {**train_losses(read_metrics(m1)), **train_losses(read_metrics(m2))}
    assert got == train_losses(gpt_2bw_run.metrics)
    assert same_checkpoint(save, gpt_2bw_run.save, 30, t=1, d=2)
