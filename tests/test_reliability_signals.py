"""--exit-signal-handler and --exit-duration-in-mins: a signal is recorded, not acted on; every rank agrees at
the same boundary; a real process saves and exits 0 on SIGTERM/SIGUSR1/SIGINT, and exits at once on a second Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.errors import ConfigError
from megatron_2bw.training.signals import (
    EXIT_INTERRUPTED,
    ExitDuration,
    ExitSignalHandler,
    agree_any,
    exit_reason,
    parse_signal,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_signal():
    assert parse_signal("SIGUSR1") is signal.SIGUSR1
    assert parse_signal("usr1") is signal.SIGUSR1
    assert parse_signal(str(int(signal.SIGTERM))) is signal.SIGTERM
    with pytest.raises(ConfigError, match="--exit-signal 'SIGFOO' is not a signal name"):
        parse_signal("SIGFOO")


def test_exit_duration_with_a_fake_clock():
    now = [100.0]
    d = ExitDuration(2.5, clock=lambda: now[0])
    now[0] += 149.0
    assert not d.expired()
    now[0] += 1.0
    assert d.expired()
    assert not ExitDuration(None).expired()
    with pytest.raises(ConfigError, match="--exit-duration-in-mins must be positive"):
        ExitDuration(0)


def test_handler_records_and_restores():
    before = signal.getsignal(signal.SIGUSR1)
    lines: list[str] = []
    with ExitSignalHandler((signal.SIGTERM, signal.SIGUSR1), announce=lines.append) as h:
        assert not h.should_exit()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert h.should_exit() and h.received == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still the first is reported
        time.sleep(0.05)
        assert h.received == "SIGUSR1" and h.count == 2
    assert signal.getsignal(signal.SIGUSR1) is before
    assert len(lines) == 1 and lines[0].startswith("received SIGUSR1: saving a checkpoint at the next step boundary")


# ------------------------------------------------------------------ a real process with a toy loop
_TOY = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {repo!r})
    from megatron_2bw.training.signals import ExitSignalHandler, exit_reason
    h = ExitSignalHandler((signal.SIGTERM, signal.SIGUSR1)).install()
    print("ready", flush=True)
    step = 0
    while step < 10000:
        time.sleep(0.01)          # a step
        step += 1
        if step % {every} == 0 and exit_reason(h, None):   # a drained boundary
            print(f"saved at {{step}} after {{h.received}}", flush=True)
            sys.exit(0)
    sys.exit(1)
""")


def _toy(tmp_path, every: int = 5) -> subprocess.Popen:
    script = tmp_path / "toy.py"
    script.write_text(_TOY.format(repo=REPO, every=every))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_saves_at_the_next_boundary_and_exits_0(tmp_path, sig):
    proc = _toy(tmp_path)
    time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    step = int(out.split()[2])
    assert step % 5 == 0 and out.strip().endswith(sig.name)
    assert err.strip() == f"received {sig.name}: saving a checkpoint at the next step boundary, then exiting " \
                          "(press Ctrl-C again to exit at once without saving)"
    assert "Traceback" not in err


def test_second_ctrl_c_exits_at_once_in_one_line(tmp_path):
    proc = _toy(tmp_path, every=300)  # boundaries 3 s apart: the second Ctrl-C comes before the save
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # two signals in one instant are one to Python (a flag, not a counter)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_INTERRUPTED and "saved at" not in out
    assert err.strip().splitlines() == [
        "received SIGINT: saving a checkpoint at the next step boundary, then exiting "
        "(press Ctrl-C again to exit at once without saving)",
        "error: rank 0: second SIGINT: exiting now without saving"]


# ------------------------------------------------------------------ agreement over 4 processes
def _agree(signal_rank: int, late_rank: int) -> list[tuple[int, str | None]]:
    rank = dist.get_rank()
    now = [0.0]
    h = ExitSignalHandler((signal.SIGTERM, signal.SIGUSR1), announce=lambda line: None).install()
    duration = ExitDuration(1.0, start=0.0, clock=lambda: now[0])
    seen = []
    for boundary in range(8):
        if rank == signal_rank and boundary == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
        if rank == late_rank and boundary == 5:
            now[0] = 61.0  # only this rank's clock passed the duration
        seen.append((boundary, exit_reason(h, duration)))
        seen.append((boundary, "any" if agree_any(rank == late_rank and boundary >= 6) else None))
    h.restore()
    return seen


def test_all_ranks_agree_at_the_same_boundary():
    outs = run_workers(_agree, 4, 2, 1, timeout=120)
    assert all(o == outs[0] for o in outs), outs
    reasons = [r for b, r in outs[0][0::2]]
    anys = [r for b, r in outs[0][1::2]]
    # independent reference: the signal on rank 2 at boundary 3 wins over the duration from boundary 5 on
    assert reasons == [None, None, None, "signal", "signal", "signal", "signal", "signal"]
    assert anys == [None] * 6 + ["any", "any"]


def _duration_only(late_rank: int) -> list[str | None]:
    now = [0.0]
    duration = ExitDuration(1.0, start=0.0, clock=lambda: now[0])
    out = []
    for boundary in range(4):
        if dist.get_rank() == late_rank and boundary == 2:
            now[0] = 60.0
        out.append(exit_reason(None, duration))
    return out


def test_duration_on_one_rank_stops_everyone():
    outs = run_workers(_duration_only, 4, 3, timeout=120)
    assert outs == [[None, None, "duration", "duration"]] * 4
