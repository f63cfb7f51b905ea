"""Nothing in ``--save`` is overwritten by accident: one job per directory, no silent fresh start over a run.

* **A lock per ``--save``.** Rank 0 of a job creates ``SAVE/megatron_2bw.lock`` (``O_EXCL``) holding its
  host, pid, the pid's start time and the job's id (``TORCHELASTIC_RUN_ID``, else ``SLURM_JOB_ID``). A
  second job on the same directory is refused with one line naming the holder. A lock whose process is
  gone (same host, the pid dead or reused by another process) is taken over with a warning, and so is one
  that the same job left on another host (a torchrun restart or a SLURM requeue may move rank 0).
  ``--validate-only`` only checks the lock, so launch scripts refuse a second job before any worker starts.
* **No fresh start over another run.** A ``--save`` that already holds checkpoints (a pointer file or
  ``iter_*`` folders) is refused unless this run resumes from that very directory (Megatron's ``--load`` =
  ``--save``) or ``--overwrite-save`` asks to start over; then the old pointer and ``iter_*`` folders are
  removed first, so the new run's pointer never sits below old, newer checkpoints.

No torch here: this runs before anything heavy, on rank 0 only (the other ranks of a job trust it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time

from ..errors import ConfigError
from .layout import iteration_dir
from .manifest import TRACKER, _pid_alive, list_checkpoints, list_iterations

log = logging.getLogger("megatron_2bw")

LOCK = "megatron_2bw.lock"


# --------------------------------------------------------------------------- who holds the lock
def job_id() -> str | None:
    """The launch's identity, shared by every rank and by restarts of the same job (torchrun's default
    ``--rdzv-id none`` names no job: two launches share it)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return (run if run and run != "none" else None) or os.environ.get("SLURM_JOB_ID") or None


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _me() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid), "job": job_id(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read(path: str) -> dict | None:
    """The lock's record; None when there is no lock; ``{}`` when it is unreadable (a half-written lock)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _stale(holder: dict) -> str | None:
    """Why the lock's holder is gone (the lock may be taken over), or None while it may be alive."""
    if not holder:
        return "the lock file is unreadable"
    if holder.get("host") != socket.gethostname():
        if holder.get("job") is not None and holder.get("job") == job_id():
            return f"it was left by this job ({holder['job']}) before a restart on another host"
        return None  # another host: its pid cannot be checked from here
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return f"pid {pid} is no longer running"
    if holder.get("start") is not None and _start_ticks(pid) not in (None, holder["start"]):
        return f"pid {pid} now belongs to another process"
    return None


def _describe(holder: dict) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('time')}"


def _refusal(save: str, path: str, holder: dict) -> ConfigError:
    return ConfigError(
        f"--save {save} is in use by another job ({_describe(holder)}; lock {path}): wait for it to finish or "
        "give another --save (if that job is gone on another host, delete the lock file)")


class SaveLock:
    """The lock of one ``--save`` held by this process; :meth:`release` removes it if it is still ours."""

    def __init__(self, path: str, record: dict) -> None:
        self.path, self.record = path, record

    def release(self) -> None:
        held = _read(self.path)
        if held and held.get("pid") == self.record["pid"] and held.get("host") == self.record["host"]:
            try:
                os.remove(self.path)
            except OSError:
                pass


def check_lock(save: str) -> None:
    """Refuse when a live job holds ``save``'s lock (``--validate-only``: nothing is written)."""
    path = os.path.join(save, LOCK)
    holder = _read(path)
    if holder is not None and _stale(holder) is None:
        raise _refusal(save, path, holder)


def acquire(save: str) -> SaveLock:
    """Take ``save``'s lock for this process (rank 0), taking over a stale one; one line if a live job holds it."""
    path = os.path.join(save, LOCK)
    record = _me()
    for _ in range(3):  # a race with another starter: at most one of them creates the file
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                continue  # released meanwhile
            why = _stale(holder)
            if why is None:
                raise _refusal(save, path, holder) from None
            same_job = holder.get("job") is not None and holder.get("job") == record["job"]
            (log.info if same_job else log.warning)(" taking over the lock %s (%s): %s", path, _describe(holder), why)
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        except OSError as e:
            raise ConfigError(f"cannot create the lock {path}: {e.strerror or e}") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.write("\n")
        return SaveLock(path, record)
    raise ConfigError(f"cannot take the lock {path}: another job keeps creating it")


# --------------------------------------------------------------------------- a fresh start over checkpoints
def saved_checkpoints(save: str) -> str | None:
    """What checkpoints ``save`` holds, in words (None: none; an unfinished first save is none)."""
    its = list_checkpoints(save)
    pointer = None
    path = os.path.join(save, TRACKER)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                pointer = f.read().strip()[:20]
        except OSError:
            pointer = "?"
    if not its and pointer is None:
        return None
    parts = []
    if its:
        shown = ", ".join(map(str, its[-3:]))
        parts.append(f"iterations {'..., ' if len(its) > 3 else ''}{shown}")
    if pointer is not None:
        parts.append(f"{TRACKER} at {pointer}")
    return "; ".join(parts)


def same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def check_fresh_start(save: str, load: str | None, resumes_from_save: bool, overwrite: bool) -> bool:
    """Refuse to start a new run in a ``--save`` that holds another run's checkpoints.

    ``resumes_from_save``: this run continues the checkpoint in ``save`` itself (``--load`` = ``--save``,
    not ``--finetune``). Returns True when ``--overwrite-save`` asks to clear them (:func:`clear_checkpoints`).
    """
    if resumes_from_save:
        return False
    held = saved_checkpoints(save)
    if held is None:
        return False
    if overwrite and same_dir(save, load):
        raise ConfigError(f"--overwrite-save would delete the checkpoints of --load {load} that this run loads; "
                          "give another --save")
    if overwrite:
        return True
    if same_dir(save, load):
        why = "--finetune starts a new run at iteration 0"
    elif load:
        why = f"this run resumes from --load {load}, another directory"
    else:
        why = "this run starts from scratch (no --load)"
    raise ConfigError(
        f"--save {save} already holds checkpoints ({held}) and {why}: its saves would overwrite them and move "
        f"{TRACKER} backwards; pass --load {save} to resume that run, give another --save, or --overwrite-save "
        "to delete them and start over")


def clear_checkpoints(save: str) -> None:
    """``--overwrite-save``: remove the pointer file and every ``iter_*`` folder of ``save`` (rank 0, under the
    lock)."""
    held = saved_checkpoints(save)
    try:
        if os.path.exists(os.path.join(save, TRACKER)):
            os.remove(os.path.join(save, TRACKER))
        for it in list_iterations(save):
            shutil.rmtree(iteration_dir(save, it))
    except OSError as e:
        raise ConfigError(f"--overwrite-save: cannot remove the checkpoints in {save}: {e.strerror or e}") from None
    log.warning(" --overwrite-save: removed the checkpoints in %s (%s): starting over", save, held)


def check_pointer_advances(save: str, iteration: int, current: int | None) -> None:
    """The pointer file never moves backwards: a save below the iteration it names is another run's doing."""
    if current is not None and current > iteration:
        raise ConfigError(
            f"{os.path.join(save, TRACKER)} names iteration {current}, newer than this save of iteration {iteration}: "
            "another job writes into this --save; nothing was overwritten")
