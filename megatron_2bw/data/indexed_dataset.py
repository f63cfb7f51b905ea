"""Megatron's memory-mapped token store: a ``.bin`` of token ids back to back plus an ``.idx``.

Keeping Megatron-LM's exact ``MMapIndexedDataset`` layout means data preprocessed by either
project can be read by the other. The ``.idx`` layout (all little-endian):

    magic b"MMIDIDX\\x00\\x00" | version uint64 = 1 | dtype code uint8 |
    number of sequences uint64 | number of documents + 1 uint64 |
    sizes int32[n] | pointers int64[n] (byte offsets into .bin) | doc_idx int64[docs + 1]

The reader checks the whole index against the ``.bin`` up front (vectorized, never reading the
``.bin``): header fields, pointers equal to the running sum of sizes times the item size, a
document index that rises from 0 to the number of sequences, and a ``.bin`` of exactly the
described length. A changed dtype byte or an ``.idx`` beside another dataset's ``.bin`` thus
fails with one line instead of training on garbage tokens.

The builder writes both files under temporary names and renames them into place when it
finalizes: a failed run leaves an existing dataset untouched, and a job that has the old files
memory-mapped keeps reading the old inodes instead of dying with SIGBUS on a truncated file.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from ..errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8

# Megatron-LM's dtype codes.
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def best_fitting_dtype(vocab_size: int) -> type:
    """uint16 halves the file for vocabularies that fit (Megatron's 65500 threshold), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def _dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODES:
        raise ConfigError(f"indexed dataset dtype {dt} is not one of "
                          f"{sorted(str(np.dtype(d)) for d in DTYPES.values())}")
    return _CODES[dt]


def _temporary_path(path: str, pid: int | None = None) -> str:
    """A sibling name (same filesystem, so the final rename is atomic) unique to one process."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid() if pid is None else pid}")


def _remove_stale_temporaries(path: str) -> None:
    """Delete temporary siblings of ``path`` left by killed writers (their process is gone)."""
    head, tail = os.path.split(path)
    prefix = f".{tail}.tmp-"
    for name in os.listdir(head or "."):
        pid = name[len(prefix):]
        if not (name.startswith(prefix) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            os.remove(os.path.join(head, name))
        except OSError:
            pass  # alive (or not ours to signal): leave it


class IndexedDatasetBuilder:
    """Appends token arrays to a ``.bin`` and writes the matching ``.idx`` on :meth:`finalize`.

    An item is one sequence (Megatron: a sentence, or a whole document); :meth:`end_document`
    closes the document made of the items added since the previous call. Nothing is visible
    under the final names until :meth:`finalize` renames both files into place.
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)
        _remove_stale_temporaries(bin_path)
        self._tmp_bin = _temporary_path(bin_path)
        self._tmp_idx: str | None = None
        self._file = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        else:
            self._lo = self._hi = None

    def add_item(self, tokens: np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ConfigError(f"indexed dataset items must be 1-D token arrays, got shape {arr.shape}")
        if arr.size and self._lo is not None and (arr.min() < self._lo or arr.max() > self._hi):
            raise ConfigError(
                f"token ids in [{arr.min()}, {arr.max()}] do not fit the dataset dtype {self.dtype} of {self.bin_path}"
            )
        self._file.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, idx_path: str) -> None:
        """Write the ``.idx``, then rename both files into place (``.bin`` first).

        Items added after the last :meth:`end_document` form one last document, so the document
        index always ends at the number of sequences (what the reader requires).
        """
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        _remove_stale_temporaries(idx_path)
        self._tmp_idx = _temporary_path(idx_path)
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", _dtype_code(self.dtype)))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(doc_idx.astype("<i8").tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, idx_path)

    def close(self) -> None:
        """Close and remove the temporary files (after an error; a no-op after finalize)."""
        if not self._file.closed:
            self._file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if path and os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_header(idx_path: str) -> tuple[np.dtype, int, int, int]:
    """Check magic, version, dtype code and the file length; return (dtype, n, ndoc, idx size)."""
    try:
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
    except OSError as e:
        raise ConfigError(f"cannot read index file {idx_path}: {e.strerror or e}") from None
    if len(header) < HEADER_SIZE:
        raise ConfigError(f"index file {idx_path} is truncated: {idx_size} bytes, "
                          f"shorter than the {HEADER_SIZE}-byte header")
    if header[: len(MAGIC)] != MAGIC:
        raise ConfigError(f"index file {idx_path} has a bad magic number (not a Megatron MMIDIDX index)")
    pos = len(MAGIC)
    (version,) = struct.unpack_from("<Q", header, pos)
    if version != VERSION:
        raise ConfigError(f"index file {idx_path} has version {version}; only version {VERSION} is supported")
    (code,) = struct.unpack_from("<B", header, pos + 8)
    if code not in DTYPES:
        raise ConfigError(f"index file {idx_path} has unknown dtype code {code}")
    n, ndoc = struct.unpack_from("<QQ", header, pos + 9)
    expected = HEADER_SIZE + 4 * n + 8 * n + 8 * ndoc
    if idx_size < expected:
        raise ConfigError(
            f"index file {idx_path} is truncated: header claims {n} sequences and {ndoc - 1 if ndoc else 0} documents "
            f"({expected} bytes) but the file has {idx_size} bytes"
        )
    if idx_size > expected:
        raise ConfigError(f"index file {idx_path} has {idx_size - expected} unexpected trailing bytes")
    if ndoc < 1:
        raise ConfigError(f"index file {idx_path} has an empty document index (needs at least one entry)")
    return np.dtype(DTYPES[code]), n, ndoc, idx_size


def _check_pointers(idx_path: str, bin_path: str, bin_size: int, dtype: np.dtype, sizes, pointers) -> None:
    """Pointers must be the running byte sum of the sizes, and the ``.bin`` exactly that long."""
    n, item = len(sizes), dtype.itemsize
    if n and sizes.min() < 0:
        raise ConfigError(f"index file {idx_path} is corrupt: sequence {int(np.argmin(sizes))} has a negative size")
    nbytes = sizes.astype(np.int64) * item
    expected = np.zeros(n, dtype=np.int64)
    if n > 1:
        np.cumsum(nbytes[:-1], out=expected[1:])
    if n and np.any(pointers != expected):
        bad = int(np.argmax(pointers != expected))
        raise ConfigError(
            f"index file {idx_path} is corrupt: sequence {bad} starts at byte {int(pointers[bad])} "
            f"but the sizes before it give byte {int(expected[bad])} for dtype {dtype} ({item} bytes per token); "
            "its dtype code or pointers are wrong"
        )
    ends = pointers + nbytes
    if n and ends.max() > bin_size:
        bad = int(np.argmax(ends > bin_size))
        raise ConfigError(
            f"data file {bin_path} is truncated or index file {idx_path} is corrupt: sequence {bad} spans "
            f"bytes [{int(pointers[bad])}, {int(ends[bad])}) but the data file has {bin_size} bytes"
        )
    total = int(ends[-1]) if n else 0
    if bin_size != total:
        raise ConfigError(
            f"data file {bin_path} has {bin_size} bytes but index file {idx_path} describes {total} "
            f"({n} sequences of {dtype}): the two files do not belong to the same dataset"
        )


def _read_index(idx_path: str, bin_path: str, bin_size: int):
    """Parse and validate an ``.idx``; return (dtype, sizes, pointers, doc_idx) as read-only views."""
    dtype, n, ndoc, _ = _read_header(idx_path)
    buf = np.memmap(idx_path, mode="r", dtype=np.uint8)
    sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
    doc_idx = np.frombuffer(buf, dtype="<i8", count=ndoc, offset=HEADER_SIZE + 12 * n)
    _check_pointers(idx_path, bin_path, bin_size, dtype, sizes, pointers)
    if doc_idx[0] != 0 or np.any(np.diff(doc_idx) < 0) or doc_idx[-1] != n:
        raise ConfigError(
            f"index file {idx_path} is corrupt: its document index must rise from 0 to the {n} sequences, "
            f"got [{int(doc_idx[0])} .. {int(doc_idx[-1])}]"
            f"{' and decreasing steps' if np.any(np.diff(doc_idx) < 0) else ''}"
        )
    return dtype, sizes, pointers, doc_idx


class IndexedDataset:
    """Read side of the format: item ``i`` is a zero-copy ``np.memmap``-backed view of the ``.bin``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path, what in ((idx_path, "index"), (bin_path, "data")):
            if not os.path.isfile(path):
                raise ConfigError(f"{what} file {path} does not exist (data prefix {prefix!r})")
        bin_size = os.path.getsize(bin_path)
        self._dtype, self._sizes, self._pointers, self._doc_idx = _read_index(idx_path, bin_path, bin_size)
        # An empty file cannot be memory-mapped; an empty buffer serves the (necessarily empty) items.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.empty(0, np.uint8)

    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self.__init__(prefix)

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of item ``i`` (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} items in {self.prefix}")
        i %= n
        size = int(self._sizes[i])
        if offset < 0 or offset > size:
            raise IndexError(f"offset {offset} out of range for item {i} of size {size}")
        if length is None:
            length = size - offset
        if length < 0 or offset + length > size:
            raise IndexError(f"length {length} at offset {offset} runs past item {i} of size {size}")
        ptr = int(self._pointers[i]) + offset * self._dtype.itemsize
        return np.frombuffer(self._bin, dtype=self._dtype, count=length, offset=ptr)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per item (int32)."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each item in the ``.bin`` (int64)."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """Document ``d`` is items ``doc_idx[d]:doc_idx[d + 1]`` (int64, length documents + 1)."""
        return self._doc_idx

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def document_sizes(self) -> np.ndarray:
        """Tokens per document (int64), vectorized over the item sizes."""
        cum = np.concatenate([[0], np.cumsum(self._sizes, dtype=np.int64)])
        return cum[self._doc_idx[1:]] - cum[self._doc_idx[:-1]]

    def token_stream(self) -> np.ndarray:
        """All tokens as one zero-copy array, for whole-dataset scans such as a max (the reader
        has checked that items lie back to back and fill the ``.bin``)."""
        return np.frombuffer(self._bin, dtype=self._dtype, count=int(self._sizes.sum(dtype=np.int64)))
