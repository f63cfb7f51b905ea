"""Where the offline tools write: never into another run's or another tool's files, always whole.

Every tool that writes a directory (``checkpoint_util.py`` with each saver) builds it under a
temporary sibling name and renames it into place at the end, so a failed run leaves the target as it
was and a reader never sees half a model. Before any work it checks the target (:func:`check_dir`):

- missing or empty: written;
- its own earlier output (the marker file :data:`MARKER` this module writes, naming the same tool and
  the same request, and nothing added since): replaced whole;
- a directory holding another run's checkpoints (``latest_checkpointed_iteration.txt`` not written
  here): refused, ``--overwrite`` or not: moving that run's pointer would make it resume elsewhere;
- anything else non-empty: refused unless ``--overwrite``, which replaces the directory whole (no file
  of the old contents is left beside the new ones).

Tools that write files beside others (``preprocess_data.py``, ``train_tokenizer.py``, a benchmark's JSON)
use :func:`check_files`: the files they would replace must be their own earlier output, or ``--overwrite``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ..checkpoint.layout import TRACKER
from ..errors import ConfigError, describe_save_failure, file_size_limit, find_os_error, os_error_line

MARKER = ".megatron_2bw_output.json"
OVERWRITE_HELP = "replace a non-empty target that is not this tool's earlier output (never another run's checkpoints)"


def _read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _untouched_marker(path: str) -> dict | None:
    """The marker of ``path`` when nothing was added or removed since it was written."""
    doc = _read_marker(path)
    if doc is None or sorted(set(os.listdir(path)) - {MARKER}) != sorted(doc.get("entries", [])):
        return None
    return doc


def is_own_output(path: str, request: dict) -> bool:
    """Whether ``path`` holds exactly what an earlier run of the same ``request`` wrote there."""
    doc = _untouched_marker(path)
    return doc is not None and doc.get("request") == request


def _tracker_line(path: str) -> str:
    try:
        with open(os.path.join(path, TRACKER), encoding="utf-8") as f:
            return f"{TRACKER} names iteration {f.read().strip() or '?'}"
    except OSError:
        return f"it has {TRACKER}"


def _sample(entries: Sequence[str]) -> str:
    shown = ", ".join(sorted(entries)[:3])
    return shown + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")


def check_dir(path: str, request: dict, *, overwrite: bool, flag: str) -> None:
    """Refuse a target directory this request may not write (see the module's rules), before any work."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory: give a directory path")
    entries = os.listdir(path)
    if not entries or is_own_output(path, request):
        return
    own_pointer = (_untouched_marker(path) or {}).get("tool") == request.get("tool")
    if TRACKER in entries and not own_pointer:
        raise ConfigError(f"{flag} {path} holds another run's checkpoints ({_tracker_line(path)}): "
                          f"{request['tool']} never moves another run's pointer; give a new or empty directory")
    if not overwrite:
        raise ConfigError(f"{flag} {path} is not empty ({_sample(entries)}) and is not an earlier output of this "
                          f"{request['tool']} command: give a new or empty directory, or --overwrite to replace "
                          "it whole")


@contextmanager
def staged_dir(path: str, request: dict) -> Iterator[str]:
    """A temporary sibling of ``path`` to write into; on success it becomes ``path`` (an old one is replaced
    whole, after the new one is complete), marked as ``request``'s output. On failure nothing changes."""
    final = os.path.abspath(path)
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp.", dir=parent)
    except OSError as e:
        raise ConfigError(f"{path}: cannot create ({e.strerror or e})") from None
    try:
        try:
            yield tmp
        except ConfigError as e:  # named as the files will be, not by the temporary folder
            raise ConfigError(str(e).replace(tmp, final)) from None
        except Exception as e:  # noqa: BLE001 - a failed write: one line naming the file (F05), else as it was
            line = _write_failure(e, tmp)
            if line is None:
                raise
            raise ConfigError(line.replace(tmp, final)) from None
        entries = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump({"tool": request.get("tool"), "request": request, "entries": entries}, f, indent=1)
            f.write("\n")
        apply_umask(tmp)
        old = None
        if os.path.lexists(final):
            old = f"{final}.old.tmp.{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None and (os.path.islink(old) or not os.path.isdir(old)):
            os.unlink(old)  # a link (or file) that stood at the target: removed, what it pointed to untouched
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _write_failure(e: BaseException, tmp: str) -> str | None:
    """One line for a write into ``tmp`` that failed on the disk (full, or the file size limit): the file
    written last and the errno text; None for any other failure. safetensors and torch's zip writer hide the
    OSError (``I/O error: ... (os error 28)``, ``unexpected pos``): the errno is read from their text."""
    files = [os.path.join(top, n) for top, _, names in os.walk(tmp) for n in names]
    limit = file_size_limit()

    def last_written(p: str) -> tuple:  # the file at the size limit, else the one written last
        st = os.stat(p)
        return limit is not None and st.st_size >= limit, st.st_mtime_ns, st.st_size

    path = max(files, key=last_written) if files else tmp
    oe = find_os_error(e)
    if oe is None and (m := re.search(r"os error (\d+)", str(e))):
        oe = OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    if oe is not None:
        return os_error_line(oe, path)
    if "unexpected pos" in str(e):
        return describe_save_failure(e, path)
    return None


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back: there is no getter before Python 3.13)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str) -> None:
    """Give ``root`` and everything under it the modes a plain ``open``/``mkdir`` would under the user's umask.

    ``mkdtemp`` makes its folder ``drwx------`` and some writers (safetensors) their files ``-rw-------``:
    renamed into place as they are, an export on a shared file system would be unreadable to teammates."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for top, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(top, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(top, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def check_files(paths: Sequence[str], *, overwrite: bool, flag: str, is_own: Callable[[], bool], tool: str) -> None:
    """Refuse to replace existing ``paths`` unless they are this tool's earlier output (``is_own``) or
    ``--overwrite``."""
    existing = [p for p in paths if os.path.lexists(p)]
    if not existing or overwrite or is_own():
        return
    one = len(existing) == 1
    raise ConfigError(f"{flag}: {_sample(existing)} {'exists' if one else 'exist'} and {'is' if one else 'are'} not "
                      f"an earlier output of {tool}: give another name, or --overwrite to replace "
                      f"{'it' if one else 'them'}")


def write_text_atomic(path: str, text: str) -> None:
    """``text`` to ``path`` under a temporary name, then renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def claim_dir(path: str, tool: str, *, flag: str) -> str:
    """A directory a long-running tool fills as it goes (a benchmark's ``--out-dir``): created and marked as
    ``tool``'s when missing or empty, accepted when ``tool`` marked it before, refused otherwise."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory: give a directory path")
    entries = os.listdir(path) if os.path.isdir(path) else []
    doc = _read_marker(path) if entries else None
    if entries and (doc is None or doc.get("tool") != tool):
        what = _tracker_line(path) if TRACKER in entries else _sample(entries)
        raise ConfigError(f"{flag} {path} is not empty ({what}) and is not an earlier output of {tool}: give a new "
                          "or empty directory")
    if not entries:
        os.makedirs(path, exist_ok=True)
        write_text_atomic(os.path.join(path, MARKER), json.dumps({"tool": tool, "request": {"tool": tool},
                                                                  "entries": []}) + "\n")
    return path


def write_json_atomic(path: str, obj: dict, *, flag: str) -> None:
    """``obj`` as JSON to ``path`` (temporary name, renamed), refusing to replace a directory or a file that is
    not a JSON object (every output of the benchmarks is one: such a file is someone else's)."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory: give a file path")
    if os.path.lexists(path):
        try:
            with open(path, encoding="utf-8") as f:
                ours = isinstance(json.load(f), dict)
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise ConfigError(f"{flag} {path} exists and is not a JSON results file: give another path")
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=False) + "\n")
