"""Workers die with their launcher (kill -9 of the parent); --save/--load checked at start-up; a full disk is one
line naming the file and the errno text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_2bw.checkpoint.manifest import ChecksumWriter
from megatron_2bw.errors import ConfigError
from megatron_2bw.training.supervision import check_load_path, check_save_dir, describe_save_failure, os_error_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The "launcher": starts a worker and waits. The worker arms (or not) the parent-death signal, reports its pid.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}])
time.sleep(600)
"""
_CHILD = """
import os, sys, time
sys.path.insert(0, {repo!r})
from megatron_2bw.training.supervision import install_parent_death_signal, parent_death_signal
if {arm}:
    install_parent_death_signal()
open({pidfile!r} + ".tmp", "w").write(f"{{os.getpid()}} {{parent_death_signal()}}")
os.replace({pidfile!r} + ".tmp", {pidfile!r})
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False


def _launch(tmp_path, arm: bool) -> tuple[subprocess.Popen, int, int]:
    pidfile = str(tmp_path / f"child.{arm}")
    child = _CHILD.format(repo=REPO, arm=arm, pidfile=pidfile)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(child=child)])
    deadline = time.time() + 60
    while not os.path.exists(pidfile):
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.05)
    pid, armed = (int(x) for x in open(pidfile).read().split())
    return parent, pid, armed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")
def test_worker_dies_with_a_killed_launcher(tmp_path):
    parent, child, armed = _launch(tmp_path, arm=True)
    assert armed == signal.SIGKILL
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    t0 = time.time()
    while _alive(child) and time.time() - t0 < 5:
        time.sleep(0.05)
    assert not _alive(child), "the worker outlived its launcher"
    assert time.time() - t0 < 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")
def test_without_it_the_worker_is_orphaned(tmp_path):
    """The control: the same launcher without the parent-death signal leaves its worker running."""
    parent, child, armed = _launch(tmp_path, arm=False)
    assert armed == 0
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(1.5)
    try:
        assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def test_parent_already_gone_raises_the_signal_at_once():
    code = ("import os, signal, sys; sys.path.insert(0, %r)\n"
            "from megatron_2bw.training.supervision import install_parent_death_signal\n"
            "install_parent_death_signal(signal.SIGTERM, expected_parent=os.getppid() + 100000)\n"
            "print('still here')" % REPO)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGTERM and "still here" not in res.stdout


def test_save_dir_is_created_and_probed(tmp_path):
    target = tmp_path / "a" / "b" / "ckpt"
    assert check_save_dir(str(target)) == str(target) and target.is_dir()
    assert os.listdir(target) == []  # the probe file is gone


def test_save_dir_that_is_or_is_under_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=f"^--save {f} is a file, not a directory$"):
        check_save_dir(str(f))
    with pytest.raises(ConfigError, match=f"^--save {f}/ckpt is under {f}, which is a file, not a directory$"):
        check_save_dir(str(f / "ckpt"))


def _read_only_dir(tmp_path) -> str:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        open(ro / "probe", "w").close()
    except PermissionError:
        return str(ro)
    os.remove(ro / "probe")  # root ignores permission bits: use a directory the kernel refuses
    return "/sys/kernel"


def test_read_only_save_dir(tmp_path):
    ro = _read_only_dir(tmp_path)
    with pytest.raises(ConfigError,
                       match=f"^--save {ro} is not writable \\((Permission denied|Read-only file system)\\)$"):
        check_save_dir(ro)


def test_load_path_checks(tmp_path):
    f = tmp_path / "model_optim_rng.pt"
    f.write_text("x")
    with pytest.raises(ConfigError, match=f"^--load {f} is a file; it must name a checkpoint directory"):
        check_load_path(str(f))
    with pytest.raises(ConfigError, match=f"^--load {tmp_path}/nope does not exist$"):
        check_load_path(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=f"^--load {f}/x is under {f}, which is a file"):
        check_load_path(str(f / "x"))
    check_load_path(str(tmp_path))


def test_full_disk_during_a_checkpoint_write_is_one_line():
    with pytest.raises(OSError) as e:  # /dev/full: every write fails with ENOSPC, as on a full disk
        with open("/dev/full", "wb") as f:
            cw = ChecksumWriter(f)
            torch.save({"w": torch.zeros(1 << 16)}, cw)
            f.flush()
    assert cw.error is not None and cw.error.errno == 28
    assert describe_save_failure(e.value, "/dev/full", cw.error) == \
        "writing /dev/full failed: No space left on device (ENOSPC)"


def test_full_disk_for_the_metrics_file_names_it():
    with pytest.raises(OSError) as e:
        with open("/dev/full", "a", encoding="utf-8") as f:
            f.write('{"type": "train"}\n')
            f.flush()
    assert os_error_line(e.value, "runs/x/metrics.jsonl") == \
        "writing runs/x/metrics.jsonl failed: No space left on device (ENOSPC)"


def test_torch_save_to_a_path_hides_the_errno_but_free_space_names_it():
    with pytest.raises(RuntimeError) as e:
        torch.save({"w": torch.zeros(1000)}, "/dev/full")
    assert "unexpected pos" in str(e.value)  # what users saw before
    line = describe_save_failure(e.value, "/dev/full")
    assert line.startswith("writing /dev/full failed: ") and "\n" not in line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")
def test_arming_in_process_reads_back():
    code = ("import signal, sys; sys.path.insert(0, %r)\n"
            "from megatron_2bw.training.supervision import install_parent_death_signal, parent_death_signal\n"
            "assert parent_death_signal() == 0\n"
            "assert install_parent_death_signal(signal.SIGTERM)\n"
            "print(parent_death_signal())" % REPO)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and int(res.stdout) == signal.SIGTERM, res.stderr
