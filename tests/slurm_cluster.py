"""A real SLURM cluster for the tests: two nodes (``slurmd -N n1``, ``-N n2``) on this host, started by
``scripts/slurm_test_cluster.sh`` in a temporary directory and stopped after the session (by the daemons'
pids). Where that is not possible (not root, no packages and no apt), the tests are skipped with the
script's one-line reason. Jobs are submitted with ``sbatch`` as users submit them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
import time

import pytest
from e2e import REPO, clean_env, once

SCRIPT = os.path.join(REPO, "scripts", "slurm_test_cluster.sh")
CANNOT = 3  # the script's "not possible here" status


@dataclasses.dataclass
class Cluster:
    dir: str
    install_s: float  # apt-get install (0 when the packages were there)
    start_s: float  # munged + slurmctld + 2 slurmd until sinfo shows both idle
    config: object = None  # pytest's config: say() writes past the output capture

    def say(self, line: str) -> None:
        """One line in the test log even when pytest captures output (the job ids and states, the costs)."""
        capman = self.config.pluginmanager.getplugin("capturemanager") if self.config is not None else None
        with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
            print(line, flush=True)

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment that reaches this cluster (sbatch exports it to the job)."""
        env = clean_env(**extra)
        env["SLURM_CONF"] = os.path.join(self.dir, "slurm.conf")
        return env

    def cmd(self, *args: str, timeout: float = 30) -> str:
        res = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{' '.join(args)}: {res.stderr}"
        return res.stdout

    def sbatch(self, script: str, *options: str, env: dict[str, str]) -> int:
        """Submit ``scripts/<script>`` with sbatch ``options`` (CPU overrides) and the job's settings ``env``."""
        full = self.env(**env)
        res = subprocess.run(["sbatch", "--parsable", *options, os.path.join(REPO, "scripts", script)], env=full,
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return int(res.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job`` as key -> value."""
        text = self.cmd("scontrol", "show", "job", str(job))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_done(self, job: int, timeout: float) -> dict[str, str]:
        """Wait until ``job`` has ended (not pending, running, requeued or completing); print its id and state."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info["JobState"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING",
                                        "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED"):
                self.say(f"\nSLURM job {job} ({info['JobName']}): {info['JobState']} exit {info['ExitCode']} "
                         f"restarts {info['Restarts']}")
                return info
            if time.monotonic() > deadline:
                self.cmd("scancel", str(job))
                raise AssertionError(f"SLURM job {job} still {info['JobState']} after {timeout} s")
            time.sleep(0.3)


def _run_script(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=600)
    return res, time.monotonic() - t0


def _skip_or_fail(res: subprocess.CompletedProcess) -> None:
    if res.returncode == CANNOT:
        pytest.skip("no SLURM test cluster: " + (res.stderr.strip().splitlines() or ["?"])[-1])
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="session")
@once
def slurm_cluster(request) -> Cluster:
    """The two-node cluster, started once a session (install and start-up times are printed)."""
    if os.geteuid() != 0:
        pytest.skip("no SLURM test cluster: not root (its daemons run as root, and apt-get needs root)")
    res, install_s = _run_script("--install-only")
    _skip_or_fail(res)
    d = tempfile.mkdtemp(prefix="slurm_cluster_")
    res, start_s = _run_script("start", d)
    cluster = Cluster(d, install_s, start_s, request.config)
    request.session.config.add_cleanup(lambda: _stop(cluster))
    _skip_or_fail(res)
    cluster.say(f"\nSLURM test cluster: install {install_s:.1f} s, daemons up and idle in {start_s:.1f} s ({d})")
    return cluster


def _stop(cluster: Cluster) -> None:
    """Cancel what is left, wait for it, then end the daemons by their pids."""
    env = cluster.env()
    subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        res = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
        if res.returncode != 0 or not res.stdout.strip():
            break
        time.sleep(0.5)
    _run_script("stop", cluster.dir)
