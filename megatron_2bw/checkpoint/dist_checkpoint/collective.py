"""DCP's collectives: the checkpoint's own gloo group, and a failure on any rank as one line.

DCP's ``CheckpointException`` carries every rank's traceback; a run reports the error itself.
"""

from __future__ import annotations

import os
import re

import torch.distributed as dist

from ...errors import ConfigError, describe_save_failure, find_os_error, os_error_line
from ...parallel_state import group_timeout

_GROUP: list = []  # the gloo group of checkpoint collectives (made on first use, by every rank at once)


def checkpoint_group():
    """A gloo group over every rank for DCP's collectives (``None`` without a process group): CPU
    objects on any backend, and an asynchronous write's own communicator beside training's."""
    if not dist.is_initialized():
        return None
    if not _GROUP:  # with the run's timeout: new_group would take torch's (30 min on gloo)
        _GROUP.append(dist.new_group(backend="gloo", timeout=group_timeout()))
    return _GROUP[0]


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():  # DCP's CheckpointException lists each rank's traceback: the error itself
        m = re.match(r"\s*(?:torch\.distributed\.checkpoint\.\S+\.)?(\w+(?:Error|Exception)): (.+)", line)
        if m and m.group(1) != "CheckpointException":
            return f"{m.group(1)}: {m.group(2)}"
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def config_error(e: BaseException) -> ConfigError:
    """A one-line error from a failure inside DCP (whose exception carries every rank's traceback)."""
    cause = e
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) else cause
    if isinstance(cause, ConfigError):
        return cause
    if isinstance(cause, OSError):
        return ConfigError(os_error_line(cause))
    return ConfigError(first_line(cause))


def write_error(e: BaseException, tmp: str, rank: int) -> ConfigError:
    """A failed DCP write as one line naming this rank's file and the cause (F02-F05): torch's zip writer
    reports a full disk or the file size limit as ``unexpected pos N vs M``; the errno is found behind it, or
    the cause recognised from the disk's free space and ``ulimit -f`` (``errors.describe_save_failure``)."""
    names = sorted(n for n in (os.listdir(tmp) if os.path.isdir(tmp) else []) if n.startswith(f"__{rank}_"))
    path = os.path.join(tmp, names[0]) if names else tmp
    oe = os_error_in(e)
    if oe is not None:
        return ConfigError(os_error_line(oe, path))
    if "unexpected pos" in str(e):
        return ConfigError(describe_save_failure(RuntimeError(first_line(e)), path))
    return config_error(e)


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind a DCP failure (its CheckpointException lists each rank's exception), or None."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        e = cause[0] if isinstance(cause, tuple) else cause
    return find_os_error(e)
