"""A start-up error under plain ``torchrun``: one line, not one per rank plus torchrun's traceback.

Every rank checks its flags and files before any process group exists, so a typo fails on every rank
at once; each would print the same ``error:`` line and torchrun would add its ``ChildFailedError``
traceback and failure table (57 lines for 4 ranks). Instead the first rank with a given message
prints it (identical messages of the node's other ranks are dropped: an ``O_EXCL`` marker file per
message and launch), then the rank ends its torchrun agent with SIGKILL, the only signal torchrun
does not answer with a traceback; the other workers follow through their parent-death signal. The
shell then reports status 137 (``Killed``). Only on torchrun's last attempt: with ``--max-restarts``
left, torchrun restarts the workers as it would. ``scripts/run_local.sh`` validates in one process
first and exits 2 with the line; outside torchelastic (srun, one process) nothing changes.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import tempfile
import time

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


def restarts_left() -> int:
    """How many more attempts torchrun makes after this one (``--max-restarts``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def report_under_torchrun(message: str, agent: int | None) -> bool:
    """Print ``error: message`` once per machine and launch, and end the torchrun ``agent``
    (:func:`torchrun_parent`); False outside torchelastic (the caller prints as usual)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is None or restarts_left() > 0:
        return False  # torchrun may restart the workers (--max-restarts): leave the attempt to it
    # a rank that started after another had ended the agent has no torchrun parent: it only dedups
    if first_to_report(message, launch_identity()):
        print(f"error: {message}", file=sys.stderr, flush=True)
    if agent is not None and os.getppid() == agent:  # not yet ended by another rank
        try:
            os.kill(agent, signal.SIGKILL)
        except OSError:
            pass
    return True
