"""One exception type for every bad input, so entry points can print one line and exit."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


class ConfigError(ValueError):
    """A user-facing configuration error; its message is one line naming the problem."""


def run_cli(run: Callable[[list[str]], str], argv: Sequence[str] | None = None) -> int:
    """Print ``run(argv)``; a :class:`ConfigError` becomes one ``error:`` line on stderr and exit code 2."""
    try:
        print(run(list(sys.argv[1:] if argv is None else argv)))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
