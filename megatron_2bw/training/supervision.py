"""Supervision and file-system checks: workers die with their launcher; ``--save``/``--load`` checked at start-up.

- :func:`install_parent_death_signal`: Linux ``prctl(PR_SET_PDEATHSIG)``. If the launcher
  (torchrun, or whatever spawned the worker) dies, even by ``kill -9``, the kernel sends the
  worker SIGKILL, so no orphan keeps training and writing checkpoints while a relaunch starts
  on the same ``--save``. SIGKILL rather than SIGTERM: a graceful save would race the relaunch.
- :func:`check_save_dir` / :func:`check_load_path`: before any collective, so a read-only
  ``--save`` is a one-line error at start-up, not at the first save after hours of work.
- :func:`os_error_line`: a failed write (a full disk) as one line naming the file and the errno text.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys

from ..errors import ConfigError, describe_save_failure, find_os_error, os_error_line  # noqa: F401 - re-exported

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def install_parent_death_signal(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where unsupported (not Linux).

    ``expected_parent``: the parent pid seen before the call (default: ``os.getppid()`` now).
    If the parent is already gone (re-parented before we asked), the signal is raised at once.
    Note: the kernel tracks the parent *thread*; launchers spawn workers from their main thread.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    libc = _libc()
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent:
        os.kill(os.getpid(), int(sig))
    return True


def parent_death_signal() -> int:
    """The signal currently armed (0: none); Linux only."""
    value = ctypes.c_int(0)
    if _libc().prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return value.value


def _blocking_file(path: str) -> str | None:
    """The first component of ``path`` (from the root) that exists and is not a directory."""
    cur = os.path.abspath(path)
    parts = []
    while True:
        parts.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for p in reversed(parts):
        if os.path.lexists(p) and not os.path.isdir(p):
            return p
    return None


def _probe_writable(path: str) -> OSError | None:
    """Create and remove a file in ``path``: permission bits lie for root and read-only mounts."""
    probe = os.path.join(path, f".write_test.{socket.gethostname()}.{os.getpid()}")  # ranks on many hosts
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e
    return None


def _refuse_dangling_link(path: str, flag: str) -> None:
    """A symbolic link whose target is gone (an unmounted file system, a moved run) is named as such."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError(f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist "
                          "(an unmounted file system or a moved directory?): create it or fix the link")


def check_save_dir(path: str, flag: str = "--save") -> str:
    """``path`` as a writable directory (created when missing); a one-line :class:`ConfigError` otherwise."""
    _refuse_dangling_link(path, flag)
    blocker = _blocking_file(path)
    if blocker is not None:
        what = "is a file" if blocker == os.path.abspath(path) else f"is under {blocker}, which is a file"
        raise ConfigError(f"{flag} {path} {what}, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
    err = _probe_writable(path)
    if err is not None:
        raise ConfigError(f"{flag} {path} is not writable ({err.strerror or err})")
    return path


def check_load_path(path: str, flag: str = "--load") -> None:
    """``--load`` must name a checkpoint directory: a clear line for a file or a missing path."""
    if os.path.isdir(path):
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"{flag} {path} is not readable")
        return
    _refuse_dangling_link(path, flag)
    if os.path.lexists(path):
        raise ConfigError(f"{flag} {path} is a file; it must name a checkpoint directory "
                          "(the one holding latest_checkpointed_iteration.txt)")
    blocker = _blocking_file(path)
    if blocker is not None:
        raise ConfigError(f"{flag} {path} is under {blocker}, which is a file, not a directory")
    raise ConfigError(f"{flag} {path} does not exist")


def attempt_store(timeout_s: float):
    """torchrun's shared store under a prefix of this launch attempt; None when torchrun's agent does not host it.

    torchrun's c10d rendezvous keeps one store for every ``--max-restarts`` attempt, and the default
    process group's keys do not name the attempt: a restarted gloo group can read a dead attempt's
    addresses and fail with ``connectFullMesh ... Connection refused``. Keys under
    ``attempt_<$TORCHELASTIC_RESTART_COUNT>/`` belong to this attempt only.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"megatron_2bw/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
