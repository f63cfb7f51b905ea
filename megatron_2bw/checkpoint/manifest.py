"""Checkpoint integrity: a manifest per iteration directory, verified on load.

``iter_NNNNNNN/manifest.json`` lists every shard file of the iteration with its size, a
CRC-32 of its bytes and its identity (tensor rank, pipeline stage, layout t/d/w, schedule,
iteration). It is written last, after every shard is on disk, atomically (temporary name,
fsync, rename, fsync of the directory), and before the pointer file, so a manifest that
exists proves the iteration complete. On load it catches what a readable-but-wrong file
does not show: flipped bytes inside a tensor, a truncated or missing shard, and a shard
copied into another stage's or tensor rank's folder.

CRC-32 (zlib) rather than a cryptographic hash: it guards against corruption, not an
attacker, detects every burst of up to 32 flipped bits and anything else with probability
1 - 2**-32, and runs at disk speed; it can be computed while the file is written
(:class:`ChecksumWriter`), so a save reads nothing back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from typing import BinaryIO, Callable, Iterator

from ..errors import ConfigError, describe_save_failure, find_os_error, os_error_line
from .layout import FILENAME, ITER_DIR_RE, RANK_DIR_RE, TRACKER, iteration_dir

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CHUNK = 1 << 20
TEMP_RE = re.compile(r".+\.tmp\.(\d+)$")  # checkpointing.py's temporaries: f"{path}.tmp.{pid}"
_IDENTITY_WORDS = {"tp_rank": "tensor rank", "pp_rank": "pipeline stage", "t": "t", "d": "d", "w": "w",
                   "schedule": "schedule", "iteration": "iteration"}

IdentityFn = Callable[[str], dict]


# --------------------------------------------------------------------------- checksums
def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def file_checksum(path: str) -> tuple[str, int]:
    """(CRC-32 as 8 hex digits, size in bytes) of ``path``, streamed in 1 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return _hex(crc), size


class ChecksumWriter:
    """A write-only file wrapper that checksums what passes through (``torch.save(obj, ChecksumWriter(f))``)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._crc = 0
        self.size = 0
        self.error: OSError | None = None  # the first failed write (torch.save hides its errno)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        self.size += view.nbytes
        try:
            return self._f.write(view)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    @property
    def checksum(self) -> str:
        return _hex(self._crc)


# --------------------------------------------------------------------------- identity
def shard_identity(*, iteration: int, t: int, d: int, w: int, tp_rank: int, pp_rank: int, schedule: str) -> dict:
    """What a shard file is: which rank of which layout, schedule and iteration wrote it."""
    return {"iteration": int(iteration), "t": int(t), "d": int(d), "w": int(w), "tp_rank": int(tp_rank),
            "pp_rank": int(pp_rank), "schedule": str(schedule)}


def identity_from_path(relpath: str) -> dict:
    """The (tensor rank, stage) a file's folder stands for: ``mp_rank_TT[_PPP]/...`` (no suffix: stage 0)."""
    folder = relpath.replace(os.sep, "/").split("/")[0]
    m = RANK_DIR_RE.fullmatch(folder)
    if not m:
        return {}
    return {"tp_rank": int(m.group(1)), "pp_rank": int(m.group(2) or 0)}


def layout_identity_fn(*, iteration: int, t: int, d: int, schedule: str | None = None) -> IdentityFn:
    """``expected_identity_fn`` for :func:`verify`: this run's layout plus the folder's ranks.

    The data-parallel width ``w`` is not compared: replicas are identical, a resume may change it.
    ``schedule`` None: not compared here (a caller with a clearer message checks it).
    """
    fixed = {"iteration": iteration, "t": t, "d": d, **({"schedule": schedule} if schedule is not None else {})}

    def expected(relpath: str) -> dict:
        return {**fixed, **identity_from_path(relpath)}

    return expected


def _describe(identity: dict) -> str:
    return ", ".join(f"{_IDENTITY_WORDS.get(k, k)} {v}" for k, v in identity.items() if k in ("tp_rank", "pp_rank"))


def check_identity(path: str, recorded: dict, expected: dict) -> None:
    """One-line error when a shard's recorded identity differs from what its place says it must be."""
    diff = [k for k, v in expected.items() if k in recorded and recorded[k] != v]
    if not diff:
        return
    said = ", ".join(f"{_IDENTITY_WORDS.get(k, k)} {recorded[k]}" for k in diff)
    want = ", ".join(f"{_IDENTITY_WORDS.get(k, k)} {expected[k]}" for k in diff)
    raise ConfigError(f"checkpoint file {path} was written as {said} but its place requires {want} "
                      "(a shard copied into the wrong folder or checkpoint?)")


# --------------------------------------------------------------------------- writing
def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def manifest_entry(iter_dir: str, path: str, identity: dict, checksum: str | None = None,
                   size: int | None = None) -> tuple[str, dict]:
    """(path relative to ``iter_dir``, record) for one written shard; checksums the file if not given."""
    if checksum is None or size is None:
        checksum, size = file_checksum(path)
    rel = os.path.relpath(path, iter_dir).replace(os.sep, "/")
    return rel, {"size": int(size), "crc32": checksum, "identity": dict(identity)}


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb") -> Iterator:
    """Write ``path`` through ``path.tmp.PID``: on success fsync, rename and fsync the folder, so
    ``path`` is old or complete, never partial; on any failure the temporary is removed and the
    error propagates. The temporary's name is what :func:`clean_stale_temporaries` looks for."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        line = describe_save_failure(e, tmp) if _disk_failure(e) else None
        if os.path.exists(tmp):
            os.remove(tmp)
        if line is not None:  # a full disk or the file size limit: one line naming the file (F02-F05)
            raise ConfigError(line.replace(tmp, path)) from None
        raise
    fsync_dir(os.path.dirname(path) or ".")


def _disk_failure(e: BaseException) -> bool:
    """A write that failed on the disk: an OSError behind it, or torch's zip writer's ``unexpected pos``."""
    return not isinstance(e, ConfigError) and isinstance(e, Exception) and (
        find_os_error(e) is not None or "unexpected pos" in str(e))


def write_manifest(iter_dir: str, iteration: int, entries: dict[str, dict]) -> str:
    """Write ``iter_dir/manifest.json`` atomically; call it after every shard is on disk, before the pointer."""
    doc = {"format": MANIFEST_FORMAT, "iteration": int(iteration), "files": dict(sorted(entries.items()))}
    path = os.path.join(iter_dir, MANIFEST)
    with atomic_file(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path


# --------------------------------------------------------------------------- reading
def read_manifest(iter_dir: str) -> dict | None:
    """The manifest of ``iter_dir``; None when there is none (an older checkpoint or an unfinished save)."""
    path = os.path.join(iter_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint manifest {path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), dict):
        raise ConfigError(f"checkpoint manifest {path} is not a megatron_2bw manifest (format {MANIFEST_FORMAT})")
    return doc


def _unlisted_shards(iter_dir: str, files: dict) -> list[str]:
    out = []
    for name in sorted(os.listdir(iter_dir)):
        if RANK_DIR_RE.fullmatch(name) and os.path.isdir(os.path.join(iter_dir, name)):
            for leaf in sorted(os.listdir(os.path.join(iter_dir, name))):
                rel = f"{name}/{leaf}"
                if rel not in files and not TEMP_RE.fullmatch(leaf):
                    out.append(rel)
    return out


def _same_as(files: dict, crc: str, size: int, rel: str) -> str:
    twins = [r for r, e in files.items() if r != rel and e.get("crc32") == crc and e.get("size") == size]
    if not twins:
        return ""
    return f"; its bytes are those of {twins[0]} ({_describe(files[twins[0]].get('identity', {}))}): " \
           "a shard copied into the wrong folder"


def _verify_file(iter_dir: str, rel: str, files: dict, expected_identity_fn: IdentityFn | None,
                 checksums: bool) -> None:
    entry, path = files[rel], os.path.join(iter_dir, rel)
    if expected_identity_fn is not None:
        check_identity(path, entry.get("identity", {}), expected_identity_fn(rel))
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint file {path} is missing (listed in {os.path.join(iter_dir, MANIFEST)})")
    size = os.path.getsize(path)
    if not checksums:
        if size != entry["size"]:
            raise ConfigError(f"checkpoint file {path} has {size} bytes but the manifest recorded {entry['size']} "
                              "(truncated or replaced)")
        return
    crc, size = file_checksum(path)
    if crc != entry["crc32"] or size != entry["size"]:
        raise ConfigError(f"checkpoint file {path} is corrupt: crc32 {crc} ({size} bytes) but the manifest "
                          f"recorded {entry['crc32']} ({entry['size']} bytes){_same_as(files, crc, size, rel)}")


def verify(iter_dir: str, expected_identity_fn: IdentityFn | None = None, *, only: list[str] | None = None,
           checksums: bool = True, require: bool = True) -> dict | None:
    """Check ``iter_dir`` against its manifest; a one-line :class:`ConfigError` naming the file otherwise.

    ``only``: the files (relative paths) this rank loads; None checks every listed file and
    refuses shards the manifest does not list. ``checksums=False`` checks presence, sizes and
    identities only (cheap; for start-up scans). ``require=False`` returns None for a
    directory without a manifest (a checkpoint written before manifests existed).
    """
    doc = read_manifest(iter_dir)
    if doc is None:
        if require:
            raise ConfigError(f"checkpoint {iter_dir} has no {MANIFEST}: the save did not finish "
                              "(or the file was removed)")
        return None
    files = doc["files"]
    if only is None:
        extra = _unlisted_shards(iter_dir, files)
        if extra:
            raise ConfigError(f"checkpoint file {os.path.join(iter_dir, extra[0])} is not listed in "
                              f"{os.path.join(iter_dir, MANIFEST)} (copied in from another checkpoint?)")
    for rel in (only if only is not None else list(files)):
        rel = rel.replace(os.sep, "/")
        if rel not in files:
            raise ConfigError(f"checkpoint file {os.path.join(iter_dir, rel)} is not listed in "
                              f"{os.path.join(iter_dir, MANIFEST)} (written with another layout?)")
        _verify_file(iter_dir, rel, files, expected_identity_fn, checksums)
    return doc


# --------------------------------------------------------------------------- start-up: temporaries and resume



def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temporaries(save_dir: str, pid_alive: Callable[[int], bool] = _pid_alive) -> list[str]:
    """Remove ``*.tmp.<pid>`` files a killed save left under ``save_dir``; returns what was removed.

    A temporary whose pid is a live process on this host is kept (another job may be saving
    right now into the same directory); on a shared file system a pid from another host may
    collide with a live one here, which only keeps a stale file for one more start.
    """
    if not os.path.isdir(save_dir):
        return []
    removed = []
    for root, dirs, names in os.walk(save_dir):
        rel = os.path.relpath(root, save_dir)
        depth = 0 if rel == "." else rel.count(os.sep) + 1
        # temporaries live in SAVE/, SAVE/iter_*/ and SAVE/iter_*/mp_rank_*/ only
        dirs[:] = [d for d in dirs if depth == 1 or (depth == 0 and ITER_DIR_RE.fullmatch(d))]
        for name in names:
            m = TEMP_RE.fullmatch(name)
            if m and not pid_alive(int(m.group(1))):
                path = os.path.join(root, name)
                try:
                    os.remove(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
    return sorted(removed)


def holds_checkpoint(iter_dir: str) -> bool:
    """An ``iter_*`` folder is a checkpoint once it has a manifest or one complete shard file; a save
    killed before its first shard was renamed into place leaves only temporaries, which are not."""
    if os.path.isfile(os.path.join(iter_dir, MANIFEST)):
        return True
    for name in os.listdir(iter_dir) if os.path.isdir(iter_dir) else ():
        if RANK_DIR_RE.fullmatch(name) and os.path.isfile(os.path.join(iter_dir, name, FILENAME)):
            return True
    return False


def list_checkpoints(root: str) -> list[int]:
    """Iterations of :func:`list_iterations` that :func:`holds_checkpoint` (an unfinished first save is ignored)."""
    return [it for it in list_iterations(root) if holds_checkpoint(iteration_dir(root, it))]


def list_iterations(root: str) -> list[int]:
    """Iterations with an ``iter_*`` directory under ``root`` (complete or not), ascending."""
    if not os.path.isdir(root):
        return []
    out = [int(m.group(1)) for m in map(ITER_DIR_RE.fullmatch, os.listdir(root))
           if m and os.path.isdir(os.path.join(root, m.group(0)))]
    return sorted(out)


def newest_complete(root: str, below: int | None = None) -> int | None:
    """The newest iteration (under ``below`` if given) whose manifest lists only present files of the right size."""
    for it in reversed(list_iterations(root)):
        if below is not None and it >= below:
            continue
        idir = iteration_dir(root, it)
        try:
            if verify(idir, checksums=False, require=True) is not None:
                return it
        except ConfigError:
            continue
    return None


def recover_missing_tracker(load: str, save: str | None) -> tuple[int | None, str | None]:
    """With ``--load`` == ``--save`` and no pointer file: (iteration to resume, warning) or (None, None).

    Resumes from the newest iteration whose manifest shows it complete, with a warning: the
    manifest is written after every shard and just before the pointer, so that is exactly the
    iteration the pointer named (it can only be missing by deletion, or a crash between the two
    renames). Starting from scratch would overwrite those checkpoints one interval at a time,
    so with ``iter_*`` directories but none complete the run is refused instead.
    """
    same = save is not None and os.path.realpath(save) == os.path.realpath(load)
    if not same or os.path.isfile(os.path.join(load, TRACKER)):
        return None, None
    its = list_checkpoints(load)  # an iter_* folder without a complete shard (a killed first save) is none
    if not its:
        return None, None
    it = newest_complete(load)
    if it is None:
        raise ConfigError(
            f"--load {load} (also --save) has no {TRACKER} but holds {len(its)} iter_* directories, none with a "
            f"complete {MANIFEST}; refusing to start from scratch over them: write the iteration to resume into "
            f"{os.path.join(load, TRACKER)} or use another --save")
    return it, (f"{os.path.join(load, TRACKER)} is missing: resuming from iteration {it}, the newest checkpoint "
                f"whose {MANIFEST} shows it complete")


def write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER)
    try:
        with atomic_file(path, "w") as f:
            f.write(f"{iteration}\n")
    except OSError as e:
        raise ConfigError(os_error_line(e, path)) from None
