"""The exit status of a start-up error that the workers report under torchrun (launcher_errors.py): not 137
(SIGKILL, "Killed", which users read as an out-of-memory kill) but SIGUSR2's under plain torchrun, and 2 (as
--validate-only) under the project's launcher; one ``error:`` line, no traceback, no restart attempts."""

from __future__ import annotations

import os
import signal

from e2e import PY, REPO, clean_env, corpus, run, torchrun_cmd  # noqa: F401

from megatron_2bw.training.launcher_errors import agent_stop_signal


def test_agent_stop_signal_is_sigusr2_unless_torchrun_handles_it():
    assert agent_stop_signal({}) is signal.SIGUSR2
    assert agent_stop_signal({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}) is signal.SIGUSR2
    assert agent_stop_signal({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM, SIGUSR2"}) is signal.SIGKILL


def _missing_data(corpus, tmp_path) -> list[str]:  # noqa: F811
    return ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-3",
            "--device", "cpu", *corpus.data_args(), "--data-path", str(tmp_path / "missing")]


def _one_error_line(stderr: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing.idx" in errors[0], stderr
    assert "Traceback" not in stderr and "FAILED" not in stderr and "Killed" not in stderr, stderr


def test_plain_torchrun_ends_with_sigusr2_on_the_first_attempt(corpus, tmp_path):  # noqa: F811
    cmd = torchrun_cmd("pretrain_gpt.py", _missing_data(corpus, tmp_path), nproc=2,
                       launcher=("--standalone", "--max-restarts", "2"))
    res = run(cmd, env=clean_env(), timeout=120)
    assert res.returncode == -signal.SIGUSR2, res.describe()  # a shell says 140, "User defined signal 2"
    _one_error_line(res.stderr)
    assert "Sending process" not in res.stderr  # torchrun never restarted the workers


def test_graceful_torchrun_exits_2(corpus, tmp_path):  # noqa: F811
    cmd = ["bash", os.path.join(REPO, "scripts", "graceful_torchrun.sh"), PY, "-m", "torch.distributed.run",
           "--standalone", "--nproc-per-node=2", "--max-restarts", "2", os.path.join(REPO, "pretrain_gpt.py"),
           *_missing_data(corpus, tmp_path)]
    res = run(cmd, env=clean_env(), timeout=120)
    assert res.returncode == 2, res.describe()
    _one_error_line(res.stderr)
