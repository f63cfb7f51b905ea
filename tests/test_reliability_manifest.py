"""Checkpoint manifests: flipped bytes, missing or misplaced shards are refused in one line naming the file;
stale temporaries from a kill -9 during a save are removed; a missing pointer file resumes or refuses, never
starts over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch

from megatron_2bw.checkpoint import checkpointing, manifest
from megatron_2bw.checkpoint.manifest import (
    ChecksumWriter,
    clean_stale_temporaries,
    file_checksum,
    layout_identity_fn,
    manifest_entry,
    recover_missing_tracker,
    shard_identity,
    verify,
    write_manifest,
)
from megatron_2bw.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, D, W, SCHEDULE = 2, 2, 1, "2bw"


def _save_iteration(root: str, iteration: int, *, with_manifest: bool = True, seed: int = 0) -> str:
    """A t=2 d=2 checkpoint like checkpointing.save writes, each shard saved through a ChecksumWriter."""
    idir = checkpointing.iteration_dir(root, iteration)
    entries = {}
    g = torch.Generator().manual_seed(seed + iteration)
    for tp in range(T):
        for pp in range(D):
            path = checkpointing.checkpoint_path(root, iteration, tp, pp, D)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            ident = shard_identity(iteration=iteration, t=T, d=D, w=W, tp_rank=tp, pp_rank=pp, schedule=SCHEDULE)
            payload = {"layout": ident, "w": torch.randn(4096, generator=g)}
            with open(path, "wb") as f:
                cw = ChecksumWriter(f)
                torch.save(payload, cw)
            rel, entry = manifest_entry(idir, path, ident, cw.checksum, cw.size)
            entries[rel] = entry
    if with_manifest:
        write_manifest(idir, iteration, entries)
    return idir


def _expected(iteration: int):
    return layout_identity_fn(iteration=iteration, t=T, d=D, schedule=SCHEDULE)


def test_checksum_writer_matches_an_independent_crc(tmp_path):
    path = tmp_path / "x.pt"
    obj = {"a": torch.arange(100000, dtype=torch.float32), "b": [1, 2, 3]}
    with open(path, "wb") as f:
        cw = ChecksumWriter(f)
        torch.save(obj, cw)
    data = path.read_bytes()
    assert cw.size == len(data) and cw.checksum == f"{zlib.crc32(data):08x}"
    assert file_checksum(str(path)) == (cw.checksum, len(data))
    assert torch.equal(torch.load(path)["a"], obj["a"])


def test_complete_checkpoint_verifies(tmp_path):
    idir = _save_iteration(str(tmp_path), 10)
    doc = verify(idir, _expected(10))
    assert sorted(doc["files"]) == [f"mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt"
                                    for tp in range(T) for pp in range(D)]
    assert doc["files"]["mp_rank_01_000/model_optim_rng.pt"]["identity"]["tp_rank"] == 1
    assert [n for n in os.listdir(idir) if ".tmp." in n] == []


def _tensor_offset(path: str) -> int:
    """Where the stored tensor's bytes start: the zip member holding the 4096 floats."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n + m


def test_eight_flipped_bytes_inside_a_tensor(tmp_path):
    idir = _save_iteration(str(tmp_path), 10)
    path = os.path.join(idir, "mp_rank_01_001", "model_optim_rng.pt")
    before = torch.load(path)["w"].clone()
    off = _tensor_offset(path) + 4 * 1000
    with open(path, "r+b") as f:
        f.seek(off)
        raw = bytearray(f.read(8))
        f.seek(off)
        f.write(bytes(b ^ 0xFF for b in raw))
    after = torch.load(path)["w"]  # torch loads it without complaint: the manifest is what catches it
    assert (after != before).sum().item() == 2
    with pytest.raises(ConfigError) as e:
        verify(idir, _expected(10), only=["mp_rank_01_001/model_optim_rng.pt"])
    msg = str(e.value)
    assert msg.startswith(f"checkpoint file {path} is corrupt: crc32 ") and "\n" not in msg
    assert f"{zlib.crc32(open(path, 'rb').read()):08x}" in msg
    verify(idir, _expected(10), only=["mp_rank_00_001/model_optim_rng.pt"])  # the other shards are fine


def test_missing_and_truncated_shards(tmp_path):
    idir = _save_iteration(str(tmp_path), 10)
    victim = os.path.join(idir, "mp_rank_00_001", "model_optim_rng.pt")
    with open(victim, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ConfigError, match=r"has 1000 bytes but the manifest recorded \d+ \(truncated"):
        verify(idir, _expected(10), checksums=False)
    os.remove(victim)
    with pytest.raises(ConfigError, match=f"checkpoint file {victim} is missing"):
        verify(idir, _expected(10))


def test_shard_copied_into_another_stages_folder(tmp_path):
    idir = _save_iteration(str(tmp_path), 10)
    src = os.path.join(idir, "mp_rank_00_001", "model_optim_rng.pt")
    dst = os.path.join(idir, "mp_rank_00_000", "model_optim_rng.pt")
    shutil.copyfile(src, dst)
    with pytest.raises(ConfigError) as e:
        verify(idir, _expected(10), only=["mp_rank_00_000/model_optim_rng.pt"])
    assert f"checkpoint file {dst} is corrupt" in str(e.value)
    assert "its bytes are those of mp_rank_00_001/model_optim_rng.pt (tensor rank 0, pipeline stage 1)" in str(e.value)


def test_shard_copied_into_another_tensor_ranks_folder_with_its_manifest_entry(tmp_path):
    # the manifest itself edited along: the recorded identity still gives it away
    idir = _save_iteration(str(tmp_path), 10)
    shutil.copyfile(os.path.join(idir, "mp_rank_01_000", "model_optim_rng.pt"),
                    os.path.join(idir, "mp_rank_00_000", "model_optim_rng.pt"))
    doc = json.load(open(os.path.join(idir, "manifest.json")))
    doc["files"]["mp_rank_00_000/model_optim_rng.pt"] = doc["files"]["mp_rank_01_000/model_optim_rng.pt"]
    json.dump(doc, open(os.path.join(idir, "manifest.json"), "w"))
    with pytest.raises(ConfigError, match=r"was written as tensor rank 1 but its place requires tensor rank 0"):
        verify(idir, _expected(10))


def test_layout_schedule_or_iteration_differs(tmp_path):
    idir = _save_iteration(str(tmp_path), 10)
    with pytest.raises(ConfigError, match="was written as schedule 2bw but its place requires schedule flush"):
        verify(idir, layout_identity_fn(iteration=10, t=T, d=D, schedule="flush"), checksums=False)
    with pytest.raises(ConfigError, match="was written as iteration 10 but its place requires iteration 20"):
        verify(idir, layout_identity_fn(iteration=20, t=T, d=D, schedule=SCHEDULE), checksums=False)
    verify(idir, layout_identity_fn(iteration=10, t=T, d=D), checksums=False)  # schedule left to the caller
    with pytest.raises(ConfigError, match="was written as d 2 but its place requires d 4"):
        verify(idir, layout_identity_fn(iteration=10, t=T, d=4), checksums=False)


def test_unlisted_shard_and_no_manifest(tmp_path):
    idir = _save_iteration(str(tmp_path), 10)
    os.makedirs(os.path.join(idir, "mp_rank_02_000"))
    shutil.copyfile(os.path.join(idir, "mp_rank_00_000", "model_optim_rng.pt"),
                    os.path.join(idir, "mp_rank_02_000", "model_optim_rng.pt"))
    with pytest.raises(ConfigError, match="mp_rank_02_000/model_optim_rng.pt is not listed in"):
        verify(idir, _expected(10))
    bare = _save_iteration(str(tmp_path), 20, with_manifest=False)
    assert verify(bare, require=False) is None
    with pytest.raises(ConfigError, match="has no manifest.json: the save did not finish"):
        verify(bare)


def test_manifest_write_is_atomic(tmp_path, monkeypatch):
    idir = _save_iteration(str(tmp_path), 10, with_manifest=False)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest.json, "dump", boom)
    # a full disk is one line naming the file (issue 45, F02-F05), and no partial manifest stays behind
    with pytest.raises(ConfigError, match=r"manifest\.json failed: No space left on device"):
        write_manifest(idir, 10, {})
    assert [n for n in os.listdir(idir) if n.startswith("manifest")] == []


_KILLED_SAVE = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from megatron_2bw.checkpoint import checkpointing
class Slow:
    def __init__(self, f): self.f = f
    def write(self, b):
        n = self.f.write(b); self.f.flush(); print("writing", flush=True); import time; time.sleep(0.2); return n
real = torch.save
torch.save = lambda obj, f: real(obj, Slow(f))
checkpointing.atomic_torch_save({{"w": torch.zeros(1 << 20)}}, {path!r})
"""


def test_kill_9_during_a_save_leaves_a_temporary_that_start_up_removes(tmp_path):
    save = tmp_path / "ckpt"
    path = checkpointing.checkpoint_path(str(save), 30, 0, 1, 2)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE.format(repo=REPO, path=path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    left = os.listdir(os.path.dirname(path))
    assert left == [f"model_optim_rng.pt.tmp.{proc.pid}"]
    tracker_tmp = save / f"{checkpointing.TRACKER}.tmp.{proc.pid}"
    tracker_tmp.write_text("30\n")
    mine = save / "iter_0000030" / f"manifest.json.tmp.{os.getpid()}"  # a live process's: kept
    mine.write_text("{}")
    metrics = save / "metrics.jsonl"
    metrics.write_text("{}\n")
    removed = clean_stale_temporaries(str(save))
    assert removed == sorted([os.path.join(os.path.dirname(path), left[0]), str(tracker_tmp)])
    assert os.listdir(os.path.dirname(path)) == [] and mine.exists() and metrics.exists()


def test_missing_tracker_resumes_from_the_newest_complete_iteration(tmp_path):
    root = str(tmp_path)
    _save_iteration(root, 10)
    _save_iteration(root, 20)
    _save_iteration(root, 30, with_manifest=False)  # killed before its manifest: incomplete
    it, warning = recover_missing_tracker(root, root)
    assert it == 20
    assert warning == (f"{os.path.join(root, checkpointing.TRACKER)} is missing: resuming from iteration 20, "
                       "the newest checkpoint whose manifest.json shows it complete")
    os.remove(os.path.join(root, "iter_0000020", "mp_rank_01_001", "model_optim_rng.pt"))  # now 20 is incomplete
    assert recover_missing_tracker(root, root)[0] == 10
    assert recover_missing_tracker(root, str(tmp_path / "elsewhere")) == (None, None)
    checkpointing.write_tracker(root, 10)
    assert recover_missing_tracker(root, root) == (None, None)  # the pointer decides


def test_missing_tracker_without_a_complete_iteration_is_refused(tmp_path):
    root = str(tmp_path)
    assert recover_missing_tracker(root, root) == (None, None)  # empty: a fresh start is right
    _save_iteration(root, 10, with_manifest=False)
    with pytest.raises(ConfigError, match="holds 1 iter_\\* directories, none with a complete manifest.json; "
                                          "refusing to start from scratch over them"):
        recover_missing_tracker(root, root)


def test_checksum_speed_is_disk_speed(tmp_path):
    """The checksum must not dominate a save: crc32 of 64 MB takes less than writing it with torch.save."""
    t = torch.randn(16 << 20)
    p = tmp_path / "big.pt"
    t0 = time.perf_counter()
    with open(p, "wb") as f:
        torch.save({"t": t}, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    file_checksum(str(p))
    crc_s = time.perf_counter() - t0
    assert crc_s < save_s, (crc_s, save_s)
