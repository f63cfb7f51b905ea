"""Graceful exit: ``--exit-signal-handler`` and ``--exit-duration-in-mins`` (Megatron-LM semantics).

A signal handler only *records* that SIGTERM (SLURM preemption, torchrun shutdown), the
configured extra signal (SLURM's ``--signal=USR1@300`` warning) or SIGINT (Ctrl-C) arrived.
Every rank reports "a signal arrived / the duration passed" with each step's reduced numbers
(``step_stats.py``), so all ranks learn it at the same step and stop together a few steps later
(a rank that saw no signal must still save with the others); at a drained boundary
:func:`exit_reason` (one tiny MAX all-reduce) catches what came after the segment's last update.
Then the loop saves a checkpoint and exits 0. Acting inside the handler is never safe: it runs
between arbitrary bytecodes, possibly in the middle of a collective.

A second SIGINT means "now": one line, exit 130 without saving (the first Ctrl-C already
promised a save; a user pressing again does not want to wait for it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Callable

from ..config.rules import parse_signal  # noqa: F401 - one implementation, below the config floor
from ..errors import ConfigError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for a second Ctrl-C


class ExitSignalHandler:
    """Records exit signals; ``received`` names the first one (None until one arrives).

    Install it once at start-up, in the main thread, before ``init_process_group`` so that a
    signal during start-up is not lost. ``restore()`` puts the previous handlers back.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,), *, handle_sigint: bool = True,
                 rank: int = 0, announce: Callable[[str], None] | None = None) -> None:
        sigs = list(dict.fromkeys(signals))
        if handle_sigint and signal.SIGINT not in sigs:
            sigs.append(signal.SIGINT)
        self.signals = tuple(sigs)
        self.rank = rank
        self.received: str | None = None
        self.count = 0
        self._sigints = 0
        self._previous: dict[signal.Signals, object] = {}
        self._announce = announce if announce is not None else _write_stderr

    def install(self) -> "ExitSignalHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> "ExitSignalHandler":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:
                self._announce(f"error: rank {self.rank}: second SIGINT: exiting now without saving")
                os._exit(EXIT_INTERRUPTED)
        if self.received is None:
            self.received = name
            if self.rank == 0:
                self._announce(f"received {name}: saving a checkpoint at the next step boundary, then exiting "
                               f"(press Ctrl-C again to exit at once without saving)")

    def should_exit(self) -> bool:
        return self.received is not None


def _write_stderr(line: str) -> None:
    """os.write, not print: a handler may interrupt a print on the same buffered stream."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class ExitDuration:
    """``--exit-duration-in-mins``: true once this many minutes have passed since ``start``."""

    def __init__(self, minutes: float | None, start: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if minutes is not None and not minutes > 0:
            raise ConfigError(f"--exit-duration-in-mins must be positive (got {minutes})")
        self.minutes = minutes
        self.clock = clock
        self.start = clock() if start is None else start

    def expired(self) -> bool:
        return self.minutes is not None and (self.clock() - self.start) / 60.0 >= self.minutes


def agree_max(values: list[int], group=None, device=None) -> list[int]:
    """Element-wise MAX of small integers over ``group`` (all ranks when None); identity without torch.distributed.

    Every rank of ``group`` must call this at the same boundary. ``device``: where the tensor
    lives (NCCL needs the current CUDA device; None picks it from the group's backend).
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                  else torch.device("cpu"))
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.cpu().tolist()]


def agree_any(flag: bool, group=None, device=None) -> bool:
    """True on every rank when any rank's ``flag`` is true."""
    return bool(agree_max([int(bool(flag))], group, device)[0])


def exit_reason(handler: ExitSignalHandler | None, duration: ExitDuration | None, group=None,
                device=None) -> str | None:
    """At a drained boundary: why every rank should save and exit now, or None (one all-reduce, all ranks).

    Returns ``"signal"`` (some rank received an exit signal) or ``"duration"``
    (``--exit-duration-in-mins`` passed on some rank). Call it only when at least one of the
    two is configured, and then on every rank at every boundary.
    """
    got_signal = handler is not None and handler.should_exit()
    expired = duration is not None and duration.expired()
    sig, dur = agree_max([int(got_signal), int(expired)], group, device)
    if sig:
        return "signal"
    if dur:
        return "duration"
    return None
