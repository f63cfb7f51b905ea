"""Megatron's .bin/.idx format: exact layout, zero-copy reads, and one-line errors on corruption."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from megatron_2bw.data.indexed_dataset import HEADER_SIZE, IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype
from megatron_2bw.errors import ConfigError

# Three documents: [a b] [c] [] ; item sizes 3, 0, 5, 2.
ITEMS = [[1, 2, 3], [], [7, 8, 9, 10, 11], [60000, 65535]]
DOCS = [[0, 1], [2, 3], []]


def write(prefix: str, items=ITEMS, docs=DOCS, dtype=np.uint16) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        for i in doc:
            builder.add_item(np.asarray(items[i]))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def prefix(tmp_path) -> str:
    return write(str(tmp_path / "ds"))


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32


def test_round_trip_and_megatron_layout(prefix):
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.num_documents == 3 and ds.dtype == np.uint16
    for i, item in enumerate(ITEMS):
        assert ds[i].tolist() == item and ds[i].dtype == np.uint16
    assert ds.sizes.tolist() == [3, 0, 5, 2]
    assert ds.pointers.tolist() == [0, 6, 6, 16]
    assert ds.doc_idx.tolist() == [0, 2, 4, 4]
    assert ds.document_sizes().tolist() == [3, 7, 0]
    assert ds.get(2, 1, 3).tolist() == [8, 9, 10] and ds.get(2, 4).tolist() == [11]
    assert [x.tolist() for x in ds[1:3]] == [[], [7, 8, 9, 10, 11]] and ds[-1].tolist() == ITEMS[-1]
    # Byte-exact header, as Megatron-LM writes it.
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:HEADER_SIZE] == b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 4, 4)
    assert len(raw) == HEADER_SIZE + 4 * 4 + 8 * 4 + 8 * 4
    assert open(prefix + ".bin", "rb").read() == np.concatenate([np.asarray(x, "<u2") for x in ITEMS]).tobytes()


def test_items_are_zero_copy_read_only_views(prefix):
    ds = IndexedDataset(prefix)
    x = ds[2]
    assert not x.flags.owndata and not x.flags.writeable
    assert ds.token_stream().tolist() == sum(ITEMS, [])


def test_int32_and_pickle(tmp_path):
    items = [[0, 70000, 2**31 - 1], [5]]
    p = write(str(tmp_path / "big"), items, [[0], [1]], np.int32)
    ds = pickle.loads(pickle.dumps(IndexedDataset(p)))
    assert ds.dtype == np.int32 and ds[0].tolist() == items[0]


def test_out_of_range_and_bad_shape_items(tmp_path):
    with IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16) as b:
        with pytest.raises(ConfigError, match="do not fit the dataset dtype uint16"):
            b.add_item(np.array([1, 70000]))
        with pytest.raises(ConfigError, match="1-D"):
            b.add_item(np.zeros((2, 2), dtype=np.int64))


def test_index_errors(prefix):
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)


# ---- corruption: every case is a one-line ConfigError naming the file ----------------------


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, by: int) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - by)


SIZES_AT = HEADER_SIZE
POINTERS_AT = HEADER_SIZE + 4 * 4

CORRUPTIONS = {
    "missing idx": (lambda p: os.remove(p + ".idx"), ".idx", "does not exist"),
    "missing bin": (lambda p: os.remove(p + ".bin"), ".bin", "does not exist"),
    "bad magic": (lambda p: _patch(p + ".idx", 0, b"XXXXX"), ".idx", "bad magic"),
    "bad version": (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), ".idx", "version 2"),
    "unknown dtype": (lambda p: _patch(p + ".idx", 17, bytes([42])), ".idx", "unknown dtype code 42"),
    "short header": (lambda p: open(p + ".idx", "wb").write(b"MMIDIDX\x00\x00\x01"), ".idx",
                     "shorter than the 34-byte header"),
    "truncated arrays": (lambda p: _truncate(p + ".idx", 8), ".idx", "truncated: header claims 4 sequences"),
    "trailing bytes": (lambda p: open(p + ".idx", "ab").write(b"\x00" * 3), ".idx", "3 unexpected trailing bytes"),
    "count too large": (lambda p: _patch(p + ".idx", 18, struct.pack("<Q", 10**12)), ".idx", "truncated"),
    "truncated bin": (lambda p: _truncate(p + ".bin", 2), ".bin", "sequence 3 spans bytes [16, 20)"),
    "pointer past end": (lambda p: _patch(p + ".idx", POINTERS_AT + 8, struct.pack("<q", 10**6)), ".idx", "sequence 1"),
    "negative size": (lambda p: _patch(p + ".idx", SIZES_AT, struct.pack("<i", -5)), ".idx", "negative size"),
    "bad doc_idx": (lambda p: _patch(p + ".idx", POINTERS_AT + 32, struct.pack("<q", 9)), ".idx", "document index"),
    # The dtype byte changed from uint16 (8) to uint8 (1): every pointer is then twice the running size sum.
    "dtype uint16 -> uint8": (lambda p: _patch(p + ".idx", 17, bytes([1])), ".idx",
                              "sequence 1 starts at byte 6 but the sizes before it give byte 3 for dtype uint8"),
    "dtype uint16 -> int32": (lambda p: _patch(p + ".idx", 17, bytes([4])), ".idx",
                              "sequence 1 starts at byte 6 but the sizes before it give byte 12 for dtype int32"),
    "pointer gap": (lambda p: _patch(p + ".idx", POINTERS_AT + 24, struct.pack("<q", 18)), ".idx",
                    "sequence 3 starts at byte 18"),
    "longer bin": (lambda p: open(p + ".bin", "ab").write(b"\x00" * 4), ".bin", "has 24 bytes but index file"),
    "doc_idx short of the sequences": (lambda p: _patch(p + ".idx", POINTERS_AT + 32 + 24, struct.pack("<q", 3)),
                                       ".idx", "rise from 0 to the 4 sequences"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_files_give_one_line_config_error(prefix, case):
    corrupt, names, expected = CORRUPTIONS[case]
    corrupt(prefix)
    with pytest.raises(ConfigError) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert "\n" not in msg and expected in msg and prefix + names in msg, msg


def test_index_beside_another_datasets_larger_bin(tmp_path):
    """An .idx copied beside a .bin of another (larger) dataset: refused, naming both files."""
    small = write(str(tmp_path / "small"))
    big = write(str(tmp_path / "big"), ITEMS * 3, [[0, 1], [2, 3], [4, 5, 6, 7, 8, 9, 10, 11]])
    os.replace(big + ".bin", small + ".bin")
    with pytest.raises(ConfigError) as e:
        IndexedDataset(small)
    msg = str(e.value)
    assert "\n" not in msg and small + ".bin" in msg and small + ".idx" in msg
    assert "has 60 bytes but index file" in msg and "describes 20 (4 sequences of uint16)" in msg


def test_items_after_the_last_document_end_form_a_document(tmp_path):
    prefix = str(tmp_path / "open")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_item(np.array([1, 2]))
    builder.end_document()
    builder.add_item(np.array([3]))
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.doc_idx.tolist() == [0, 1, 2] and ds[1].tolist() == [3]


def test_builder_writes_nothing_under_the_final_names_until_finalize(tmp_path):
    old = write(str(tmp_path / "ds"))
    before = {ext: open(old + ext, "rb").read() for ext in (".bin", ".idx")}
    with IndexedDatasetBuilder(old + ".bin", np.uint16) as b:
        b.add_item(np.array([9, 9, 9]))
        b.end_document()
        assert {ext: open(old + ext, "rb").read() for ext in (".bin", ".idx")} == before
        # an error here (no finalize) leaves the old dataset and no temporary files
    assert {ext: open(old + ext, "rb").read() for ext in (".bin", ".idx")} == before
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def test_open_dataset_keeps_its_tokens_when_rewritten(tmp_path):
    """A reader's memory map survives a rewrite of its files (rename, never in-place truncation)."""
    prefix = write(str(tmp_path / "ds"))
    ds = IndexedDataset(prefix)
    inode = os.stat(prefix + ".bin").st_ino
    write(prefix, [[5]], [[0]])
    assert os.stat(prefix + ".bin").st_ino != inode
    assert [ds[i].tolist() for i in range(len(ds))] == ITEMS  # the old inode, still mapped
    assert IndexedDataset(prefix)[0].tolist() == [5]


def test_temporaries_of_killed_writers_are_removed(tmp_path):
    """A writer killed with -9 leaves hidden temporaries; the next build removes those whose
    process is gone and keeps those of a live one."""
    dead, alive = 2**22 + 7, os.getppid()  # above any pid_max; our parent is alive
    stale = [tmp_path / f".ds.bin.tmp-{dead}", tmp_path / f".ds.idx.tmp-{dead}"]
    live = tmp_path / f".ds.bin.tmp-{alive}"
    for path in stale + [live]:
        path.write_bytes(b"partial")
    write(str(tmp_path / "ds"))
    assert sorted(os.listdir(tmp_path)) == sorted(["ds.bin", "ds.idx", live.name])
