"""The scripts/slurm_*.sbatch jobs under a real SLURM (slurmctld + two slurmd on this host, tests/slurm_cluster.py),
submitted with sbatch as users submit them, with CPU overrides only (--gpus-per-node=0, tiny models):

- slurm_gpt_2bw.sbatch on 2 nodes (c10d rendezvous on n1, t=1 d=2 w=2): the reference run;
- kill -9 of a worker on the second node: torchrun restarts both nodes from the last checkpoint; then, in the
  same job, a preemption (scancel --signal=USR1 --batch): a checkpoint at the signalled step, the job requeues
  itself and resumes; every loss equals the reference's; the job log holds no traceback;
- scancel JOB (SIGTERM to every step): a checkpoint, and a job that ends; slurm_bert_2bw.sbatch on 1 node;
- a start-up error that only the workers see (VALIDATE=0): one error line, exit status 2 (not 137, "Killed").
Each prints its SLURM job id and exit state."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from e2e import REPO, corpus, read_metrics, train_losses  # noqa: F401
from slurm_cluster import Cluster, slurm_cluster  # noqa: F401

ITERS = 120  # a few seconds of training: room to act on a running job
JOB_TIMEOUT = 300
CPU = ("--gpus-per-node=0",)


def job_env(corpus, save, **over: str) -> dict[str, str]:  # noqa: F811
    """The jobs' settings for a tiny CPU run (every loss logged), as environment variables the scripts read."""
    env = dict(
        REPO=REPO, CPU_PROCS_PER_NODE="2", MODEL_ARGS="--model-preset gpt-tiny", PRECISION_ARGS="", EXTRA_ARGS="",
        TP="1", PP="2", MICRO_BATCH="2", GLOBAL_BATCH="8", TRAIN_ITERS=str(ITERS), LR="3e-3", MIN_LR="1e-4",
        WARMUP_ITERS="3", DATA_PATH=corpus.prefix, SPLIT="90,5,5", SAVE=str(save), SAVE_INTERVAL="1000",
        TOKENIZER_ARGS=f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {corpus.model}",
        LOG_INTERVAL="1", EVAL_INTERVAL="100000", EVAL_ITERS="1", DEVICE="cpu", STALL_TIMEOUT_S="120",
    )
    env.update(over)
    return env


def out_opts(tmp_path) -> tuple[str, ...]:
    return (*CPU, f"--output={tmp_path}/%x-%j.out", f"--chdir={tmp_path}")


def job_log(tmp_path, name: str, job: int) -> str:
    return open(os.path.join(tmp_path, f"{name}-{job}.out"), encoding="utf-8").read()


def train_records(save) -> list[dict]:
    return [r for r in read_metrics(os.path.join(save, "metrics.jsonl")) if r["type"] == "train"]


def schedule(save) -> str:
    return read_metrics(os.path.join(save, "metrics.jsonl"))[0]["schedule"]


def wait_iteration(save, it: int, job: int, cluster: Cluster, timeout: float = JOB_TIMEOUT) -> int:
    """Wait until the job has logged iteration ``it`` (0-based); the last logged iteration."""
    path, deadline = os.path.join(save, "metrics.jsonl"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            done = [r["iteration"] for r in train_records(save)]
            if done and done[-1] >= it:
                return done[-1]
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), cluster.job(job)
        time.sleep(0.05)
    raise AssertionError(f"job {job}: no iteration {it} after {timeout} s")


def wait_restart(save, job: int, cluster: Cluster, timeout: float = JOB_TIMEOUT) -> None:
    """Wait until the metrics show a step logged again (a restarted attempt)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        its = [r["iteration"] for r in train_records(save)]
        if any(b <= a for a, b in zip(its, its[1:])):
            return
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), cluster.job(job)
        time.sleep(0.05)
    raise AssertionError(f"job {job}: no restart after {timeout} s")


def latest(save) -> int:
    try:
        return int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    except OSError:
        return 0


def assert_clean(log: str) -> None:
    assert "Traceback" not in log and "SignalException" not in log, log[-4000:]


@pytest.fixture(scope="module")
def reference(slurm_cluster, corpus, tmp_path_factory):  # noqa: F811
    """slurm_gpt_2bw.sbatch on 2 nodes, uninterrupted: the losses the interrupted jobs must reproduce."""
    tmp = tmp_path_factory.mktemp("slurm_ref")
    save = tmp / "ckpt"
    job = slurm_cluster.sbatch("slurm_gpt_2bw.sbatch", "--nodes=2", *out_opts(tmp), env=job_env(corpus, save))
    info = slurm_cluster.wait_done(job, JOB_TIMEOUT)
    return job, info, job_log(tmp, "gpt-2bw", job), save


def test_two_node_gpt_2bw_job(reference):
    job, info, log, save = reference
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), log[-3000:]
    assert "slurm_launch: 2 node(s) x 2 process(es), rendezvous n1:" in log
    assert "layout t=1 d=2 w=2 (4 processes" in log
    recs = train_records(save)
    assert [r["iteration"] for r in recs] == list(range(ITERS)) and schedule(save) == "2bw"
    assert sorted(os.listdir(save / f"iter_{ITERS:07d}")) == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001"]
    assert_clean(log)


def _saved_iterations(log: str) -> list[int]:
    return [int(line.split("from iteration")[1].split()[0]) for line in log.splitlines()
            if "successfully saved checkpoint from iteration" in line]


def _workers_of(job: int, node_rank: int) -> list[int]:
    """Trainer processes of ``job`` on the node with torchrun's GROUP_RANK ``node_rank``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (env.get(b"SLURM_JOB_ID") == str(job).encode() and env.get(b"GROUP_RANK") == str(node_rank).encode()
                and b"pretrain_gpt.py" in cmd and b"RANK" in env and b"torch.distributed.run" not in cmd):
            out.append(int(pid))
    return out


def test_worker_kill_and_preemption_resume_exactly(slurm_cluster, corpus, reference, tmp_path):  # noqa: F811
    """One 2-node job: kill -9 of a worker on the second node -> torchrun restarts both nodes from the last
    checkpoint (every 10 iterations); then scancel --signal=USR1 --batch (what --signal=B:USR1@300 does) -> a
    checkpoint at the signalled step, the job requeues itself and resumes there. Every loss equals the
    uninterrupted job's."""
    save = tmp_path / "ckpt"
    job = slurm_cluster.sbatch("slurm_gpt_2bw.sbatch", "--nodes=2", *out_opts(tmp_path),
                               env=job_env(corpus, save, SAVE_INTERVAL="10"))
    wait_iteration(save, 1, job, slurm_cluster)
    victims = _workers_of(job, 1)
    assert len(victims) == 2, victims
    wait_iteration(save, 12, job, slurm_cluster)
    ckpt = latest(save)
    os.kill(victims[0], signal.SIGKILL)
    wait_restart(save, job, slurm_cluster)  # the restarted attempt logs again from its checkpoint ...
    its = [r["iteration"] for r in train_records(save)]
    resumed = its[[i for i in range(1, len(its)) if its[i] <= its[i - 1]][0]]
    seen = wait_iteration(save, resumed + 6, job, slurm_cluster)
    slurm_cluster.cmd("scancel", "--signal=USR1", "--batch", str(job))
    info = slurm_cluster.wait_done(job, JOB_TIMEOUT)
    log = job_log(tmp_path, "gpt-2bw", job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    its = [r["iteration"] for r in train_records(save)]
    back = [i for i in range(1, len(its)) if its[i] <= its[i - 1]]
    assert len(back) == 1 and ckpt >= 10 and resumed % 10 == 0 and resumed >= ckpt, (its, ckpt)  # one restart ...
    assert f"resumed from iteration {resumed}" in log  # ... of rank 0 on the first node too
    # the preemption's checkpoint (rank 0 names the signal, or its peers' when theirs arrived first)
    step = int(re.search(r"exiting at iteration (\d+) after (SIGUSR1|an exit signal on another rank)", log).group(1))
    assert seen < step < ITERS and step in _saved_iterations(log), log[-4000:]
    assert f"slurm_launch: checkpoint at iteration {step} of {ITERS}: requeueing job {job}" in log
    assert f"resuming from iteration {step}" in log  # the requeued job's validation pass
    # after the restart each step once: stopped at step, resumed there
    assert its[back[0]:] == list(range(resumed, ITERS))
    ref = train_losses(train_records(reference[3]))
    assert all(r["loss"] == ref[r["iteration"]] for r in train_records(save))
    assert_clean(log)


def test_scancel_saves_and_ends_the_job_and_bert_trains_on_one_node(slurm_cluster, corpus, tmp_path):  # noqa: F811
    """scancel JOB: SIGTERM to every step; the trainers save and the job ends (CANCELLED). Meanwhile
    slurm_bert_2bw.sbatch trains on the other node to its end."""
    save, bert_save = tmp_path / "ckpt", tmp_path / "bert"
    job = slurm_cluster.sbatch("slurm_gpt_flush.sbatch", "--nodes=1", *out_opts(tmp_path), env=job_env(corpus, save))
    bert = slurm_cluster.sbatch("slurm_bert_2bw.sbatch", "--nodes=1", *out_opts(tmp_path),
                                env=job_env(corpus, bert_save, MODEL_ARGS="--model-preset bert-tiny", TRAIN_ITERS="20"))
    seen = wait_iteration(save, 5, job, slurm_cluster)
    slurm_cluster.cmd("scancel", str(job))
    t0 = time.monotonic()
    info = slurm_cluster.wait_done(job, JOB_TIMEOUT)
    log = job_log(tmp_path, "gpt-flush", job)
    assert info["JobState"] == "CANCELLED" and time.monotonic() - t0 < 30, log[-3000:]  # before KillWait's SIGKILL
    assert seen < latest(save) < ITERS and _saved_iterations(log) == [latest(save)], log[-3000:]
    assert f"exiting at iteration {latest(save)} after SIGTERM" in log and ": requeueing job" not in log
    assert "slurm_launch: stopped by SIGTERM (scancel, the time limit or a preemption): not requeueing" in log
    assert schedule(save) == "flush"
    info = slurm_cluster.wait_done(bert, JOB_TIMEOUT)
    blog = job_log(tmp_path, "bert-2bw", bert)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), blog[-3000:]
    recs = train_records(bert_save)
    assert [r["iteration"] for r in recs] == list(range(20)) and schedule(bert_save) == "2bw"
    assert latest(bert_save) == 20 and "layout t=1 d=2 w=1 (2 processes" in blog


def test_startup_error_under_torchrun_is_one_line_and_exit_2(slurm_cluster, corpus, tmp_path):  # noqa: F811
    """A flag error that only the trainers see (the launch's --validate-only pass switched off): one error
    line for the job and exit status 2, which SLURM users do not read as a kill (137) or an OOM."""
    save = tmp_path / "ckpt"
    job = slurm_cluster.sbatch("slurm_gpt_2bw.sbatch", "--nodes=1", *out_opts(tmp_path),
                               env=job_env(corpus, save, VALIDATE="0", DATA_PATH=str(tmp_path / "missing")))
    info = slurm_cluster.wait_done(job, JOB_TIMEOUT)
    log = job_log(tmp_path, "gpt-2bw", job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--data-path" in errors[0] and "missing" in errors[0], log[-3000:]
    assert "Killed" not in log and "Signal" not in log and "signal 2" not in log, log[-3000:]
    assert_clean(log)
