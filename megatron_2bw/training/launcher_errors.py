"""A start-up error under plain ``torchrun``: one line, not one per rank plus torchrun's traceback.

Every rank checks its flags and files before any process group exists, so a typo fails on every rank
at once; each would print the same ``error:`` line and torchrun would add its ``ChildFailedError``
traceback and failure table (57 lines for 4 ranks). Instead the first rank with a given message
prints it (identical messages of the node's other ranks are dropped: an ``O_EXCL`` marker file per
message and launch), then the rank ends its torchrun agent with a signal torchrun does not handle:
SIGUSR2 (status 140, "User defined signal 2"), not SIGKILL, whose status 137 (``Killed``) users read
as an out-of-memory kill; SIGKILL only where this torchrun was told to handle SIGUSR2
(``--signals-to-handle``), which would print a traceback. The other workers follow through their
parent-death signal. On the first attempt too: a start-up error comes before any process group and
repeats on every attempt, so ``--max-restarts`` would only multiply its lines and delay the exit.
Under the project's launchers (``scripts/graceful_torchrun.sh``, used by ``run_local.sh`` and
``slurm_launch.sh``) the message also goes to ``$MEGATRON_2BW_STARTUP_ERROR_FILE`` and the launcher
exits 2, the status of the same error caught by ``--validate-only``. Outside torchelastic (srun, one
process) nothing changes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import tempfile
import time

STARTUP_ERROR_FILE_ENV = "MEGATRON_2BW_STARTUP_ERROR_FILE"
LAUNCHER_NAMES = ("torch.distributed.run", "torchrun", "torch/distributed/run.py")


def _parent_is_torchrun(ppid: int) -> bool:
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(name in cmd for name in LAUNCHER_NAMES)


MARKER_PREFIX = "megatron_2bw-error-"
MARKER_MAX_AGE_S = 3600.0


def _remove_old_markers() -> None:
    """Markers of launches that ended long ago (the ranks of one launch report within seconds)."""
    tmp, now = tempfile.gettempdir(), time.time()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(MARKER_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(tmp, name)
        try:
            if now - os.stat(path).st_mtime > MARKER_MAX_AGE_S:
                os.remove(path)
        except OSError:
            pass


def torchrun_parent() -> int | None:
    """The pid of the torchrun agent that started this worker, or None (call it before any rank can end it)."""
    ppid = os.getppid()
    if os.environ.get("TORCHELASTIC_RUN_ID") is None or ppid <= 1 or not _parent_is_torchrun(ppid):
        return None
    return ppid


def launch_identity() -> str:
    """What the ranks of one torchrun agent's attempt share and no other launch does: the attempt's error-file
    folder (``.../torchelastic_<random>/<run id>/attempt_<n>``), else the run id and the parent."""
    err = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    head, sep, _ = err.rpartition("/attempt_")
    if sep:
        return head + sep + err[len(head) + len(sep):].split("/", 1)[0]
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.getppid()}"


def first_to_report(message: str, launch: str) -> bool:
    """Whether this rank is the first on this machine to report ``message`` in ``launch``."""
    key = hashlib.sha1(f"{launch}\0{message}".encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"{MARKER_PREFIX}{key}")
    _remove_old_markers()
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True  # no marker possible: report rather than hide
    return True


def agent_stop_signal(environ=os.environ) -> signal.Signals:
    """The signal that ends the torchrun agent without its traceback: SIGUSR2 unless torchrun handles it."""
    handled = {n.strip().upper() for n in environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "").split(",")}
    return signal.SIGKILL if "SIGUSR2" in handled else signal.SIGUSR2


def _tell_launcher(message: str) -> None:
    """Leave the message where a project launcher looks for it (it then exits 2, not the agent's signal status)."""
    path = os.environ.get(STARTUP_ERROR_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(message + "\n")
    except OSError:
        pass


def report_under_torchrun(message: str, agent: int | None) -> bool:
    """Print ``error: message`` once per machine and launch, and end the torchrun ``agent``
    (:func:`torchrun_parent`); False outside torchelastic (the caller prints as usual)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return False
    # a rank that started after another had ended the agent has no torchrun parent: it only dedups
    if first_to_report(message, launch_identity()):
        print(f"error: {message}", file=sys.stderr, flush=True)
    _tell_launcher(message)
    if agent is not None and os.getppid() == agent:  # not yet ended by another rank
        try:
            os.kill(agent, agent_stop_signal())
        except OSError:
            pass
    return True
