"""The small checks every config section uses, and the torch-free checks of flags whose runtime lives in
``training/`` (signals, the health policy, the watchdog): stated here so the config floor imports nothing above it."""

from __future__ import annotations

import math
import signal
from dataclasses import fields

from ..errors import ConfigError

# fp16's largest finite value: a constant loss scale above it overflows every scaled loss >= 1.
FP16_MAX = 65504.0
# numpy's seeds (the data order) are 32-bit.
MAX_SEED = 2**32 - 1


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require_finite(obj: object) -> None:
    """Refuse inf/nan in any float field of a config dataclass (a flag typed ``float`` accepts them)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float):
            _require(math.isfinite(v), f"{_flag(f.name)} must be a finite number, got {v}")



def check_max_skipped_steps(value: int | None) -> None:
    """``--max-skipped-steps``: None (the precision's default) or a positive integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"--max-skipped-steps must be a positive integer (got {value})")


def parse_signal(name: str | int) -> signal.Signals:
    """``SIGUSR1``, ``USR1``, ``usr1`` or ``10`` -> ``signal.SIGUSR1``; a one-line error otherwise."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(f"--exit-signal {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None


def check_stall_timeout(value: float) -> None:
    """Start-up check of ``--stall-timeout-s`` (0 disables; otherwise at least a few seconds)."""
    if value != value or value < 0 or (0 < value < 2):
        raise ConfigError(f"--stall-timeout-s must be 0 (off) or at least 2 seconds (got {value})")
