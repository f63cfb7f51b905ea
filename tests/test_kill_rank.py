"""A rank dies mid-training (fault injection): the whole job ends within 60 s with messages naming
what happened, no process is left behind, and a restart with --load resumes from the last
complete checkpoint (bitwise equality of that resume is checked in test_checkpoint_resume.py)."""

from __future__ import annotations

import os

from e2e import KILL_ITER, KILL_RANK, corpus, gpt_2bw_killed, gpt_2bw_run  # noqa: F401


def test_killed_rank_ends_the_job_quickly(gpt_2bw_killed):  # noqa: F811
    res = gpt_2bw_killed.killed
    assert res.returncode != 0, res.describe()
    died = res.first_time("fault injection")
    assert died is not None, res.describe()
    assert res.seconds - died < 60, f"job took {res.seconds - died:.1f}s to end after the fault"
    assert f"error: rank {KILL_RANK}: fault injection" in res.stderr
    assert f"exiting at iteration {KILL_ITER}" in res.stderr
    # the peers say why they stop, and torchrun names the failed rank
    assert "lost contact with a peer process" in res.stderr or "SIGTERM" in res.stderr, res.describe()
    assert "rank      : 1" in res.stderr or "local_rank: 1" in res.stderr, res.describe()
    assert gpt_2bw_killed.stragglers == []


def test_restart_resumes_from_last_complete_checkpoint(gpt_2bw_killed):  # noqa: F811
    res = gpt_2bw_killed.restarted
    assert res.returncode == 0, res.describe()
    assert "resumed from iteration 10" in res.stderr
    start = [r for r in gpt_2bw_killed.metrics if r["type"] == "start"]
    assert start[0]["resumed_from"] == 10
    train = [r["iteration"] for r in gpt_2bw_killed.metrics if r["type"] == "train"]
    assert train == list(range(10, 30))
    assert open(os.path.join(gpt_2bw_killed.save, "latest_checkpointed_iteration.txt")).read().strip() == "30"
