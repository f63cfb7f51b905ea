"""One exception type for every bad input, and the wrapper that turns it into one line and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


class ConfigError(ValueError):
    """A user-facing configuration error; its message is one line naming the problem."""


def run_cli(run: Callable[[list[str]], str | int | None], argv: Sequence[str] | None = None) -> int:
    """Run an entry point; a :class:`ConfigError` becomes one ``error:`` line on stderr and status 2.

    A returned string is printed (status 0); a returned int is the exit status.
    """
    try:
        out = run(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if isinstance(out, str):
        print(out)
        return 0
    return int(out or 0)
