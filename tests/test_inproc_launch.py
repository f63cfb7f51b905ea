"""The tests' in-process launcher (tests/inproc.py) against the real torchrun: the same run gives bitwise the
same losses and the same log lines (timings aside); a rank's failure is status 1 with its output kept; a hang
is killed at the timeout and fails; the one-process form (``e2e.run`` of a tool) keeps the process's status, its
environment and the limits a test sets."""

from __future__ import annotations

import errno
import os
import re
import signal
import textwrap

import inproc
import pytest
from e2e import clean_env, corpus, read_metrics, torchrun, torchrun_cmd, train_args, train_losses  # noqa: F401

# fields that measure time (or the clock), not the run
TIMING = [re.compile(p) for p in (
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", r"\(ms\): [\d.]+", r"samples/s: [\d.]+", r"tokens/s: \d+",
    r"TFLOP/s/device: [\d.]+", r"bubble:( s\d [\d.]+)+", r"elapsed [\d:]+ \| remaining [\d:]+ \| [\d.]+ it/s")]


TIMED_KEYS = {"time", "seconds", "samples_per_sec", "tokens_per_sec", "tflops_per_device", "bubble"}


def _untimed(record):
    """A metrics record without what measures time (recursively)."""
    if isinstance(record, dict):
        return {k: _untimed(v) for k, v in record.items() if k not in TIMED_KEYS and not k.endswith("_s")}
    if isinstance(record, list):
        return [_untimed(v) for v in record]
    return record


def _masked(lines: list[tuple[float, str]]) -> list[str]:
    out = []
    for _, line in lines:
        for pat in TIMING:
            line = pat.sub("<t>", line)
        out.append(line)
    return sorted(out)  # ranks write concurrently: the order between ranks is the scheduler's


def test_in_process_run_equals_torchrun(corpus, tmp_path):  # noqa: F811
    """GPT, 2BW, (d, w) = (2, 2) on 4 ranks, 10 steps: every loss bitwise, every line but the timings."""
    args = train_args(corpus, preset="gpt-tiny", d=2, schedule="2bw", iters=10, extra=("--log-interval", "2"))
    runs = {}
    metrics = str(tmp_path / "metrics.jsonl")  # the same command line, so the same recorded config
    for real in (True, False):
        res = torchrun("pretrain_gpt.py", [*args, "--metrics-file", metrics], real=real)
        assert res.returncode == 0, res.describe()
        runs[real] = (res, read_metrics(metrics))
        os.remove(metrics)
    (real, real_m), (fast, fast_m) = runs[True], runs[False]
    assert train_losses(fast_m) == train_losses(real_m) and len(train_losses(real_m)) == 10
    assert [_untimed(r) for r in fast_m] == [_untimed(r) for r in real_m]
    assert _masked(fast.lines) == _masked(real.lines), (fast.output, real.output)
    assert "lm loss:" in fast.stderr and fast.stdout == real.stdout
    assert fast.cmd == real.cmd == torchrun_cmd("pretrain_gpt.py", [*args, "--metrics-file", metrics])


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "entry.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_failed_rank_is_status_1_with_its_output(tmp_path):
    """Rank 1 exits 3 after a line on each stream: status 1 (torchrun's), both lines kept, the env torchrun's."""
    script = _script(tmp_path, """
        import os, sys
        print("out", os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], sys.argv[1:])
        print("err", os.environ["RANK"], os.environ["TORCHELASTIC_RUN_ID"] != "", file=sys.stderr)
        sys.exit(3 if os.environ["RANK"] == "1" else 0)
    """)
    res = inproc.launch(script, ["--x"], nproc=2, env=clean_env(), timeout=60, cmd=["entry"])
    assert res.returncode == 1, res.describe()
    assert sorted(res.stdout.splitlines()) == ["out 0 2 0 ['--x']", "out 1 2 1 ['--x']"]
    assert sorted(res.stderr.splitlines()) == ["err 0 True", "err 1 True"]


def test_hang_is_killed_and_fails(tmp_path):
    """A rank that never ends: the launch fails at its timeout and no rank survives it."""
    pid_file = tmp_path / "pid"
    script = _script(tmp_path, f"""
        import os, time
        open({str(pid_file)!r} + os.environ["RANK"], "w").write(str(os.getpid()))
        time.sleep(600)
    """)
    with pytest.raises(pytest.fail.Exception, match="hang"):
        inproc.launch(script, [], nproc=2, env=clean_env(), timeout=5, cmd=["entry"])
    for rank in (0, 1):
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_one_process_form_keeps_status_environment_path_and_limits(tmp_path):
    """``e2e.run`` of a tool: the process's own status (3; a signal as subprocess reports it), exactly the given
    environment (no launcher variables), the script's folder first on ``sys.path``, and ``ulimit -f``/umask
    applied inside it (a write past the limit is EFBIG, a new file 0o600 under umask 077)."""
    script = _script(tmp_path, """
        import os, sys
        print(sys.argv[1:], sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "RANK" in os.environ,
              os.environ["ONLY_HERE"], os.getcwd())
        open("small", "w").write("x")
        print(oct(os.stat("small").st_mode & 0o777))
        try:
            open("big", "wb").write(b"x" * 20000)
        except OSError as e:
            print("refused", e.errno)
        sys.exit(3)
    """)
    res = inproc.run_script(["python", script, "--a"], env=clean_env(ONLY_HERE="yes"), timeout=60, cwd=str(tmp_path),
                            fsize=10000, umask=0o077)
    assert res.returncode == 3, res.describe()
    assert res.stdout.splitlines() == [f"['--a'] True False yes {tmp_path}", "0o600", f"refused {errno.EFBIG}"]
    killed = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert inproc.run_script(["python", killed], env=clean_env(), timeout=60).returncode == -signal.SIGTERM
