"""One exception type for every bad input, the wrapper that turns it into one line and exit 2, and the
one-line description of a failed file write (a full disk) that every writer uses."""

from __future__ import annotations

import errno
import os
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


def os_error_line(e: OSError, path: str | None = None, action: str = "writing") -> str:
    """``e`` as one line naming the file and the errno text (``No space left on device``), no traceback."""
    where = path or e.filename or "?"
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or os.strerror(e.errno) if e.errno else str(e)
    return f"{action} {where} failed: {text}" + (f" ({code})" if code else "")


def find_os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (torch.save wraps a full disk as RuntimeError ``unexpected pos ...``)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        e = e.__cause__ or e.__context__
    return None


def file_size_limit() -> int | None:
    """This process's RLIMIT_FSIZE in bytes (``ulimit -f``), or None when unlimited or unknown."""
    try:
        import resource  # noqa: PLC0415 - POSIX only

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def describe_save_failure(e: BaseException, path: str, writer_error: OSError | None = None) -> str:
    """One line for a failed checkpoint or metrics write: the file and the errno text when there is one.

    ``writer_error``: the OSError a wrapping writer saw (see ``manifest.ChecksumWriter.error``);
    without it a full file system is still recognised from its free space.
    """
    oe = writer_error or find_os_error(e)
    if oe is not None:
        return os_error_line(oe, path)
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
        if st.f_bavail * st.f_frsize < (1 << 20):
            return f"writing {path} failed: No space left on device (ENOSPC; {st.f_bavail * st.f_frsize} bytes free)"
    except OSError:
        pass
    limit = file_size_limit()
    try:
        at_limit = limit is not None and os.path.getsize(path) >= limit
    except OSError:
        at_limit = False
    if at_limit:
        return (f"writing {path} failed: File too large (EFBIG: the file size limit of this process, ulimit -f, "
                f"is {limit} bytes)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"writing {path} failed: {type(e).__name__}: {first}"
