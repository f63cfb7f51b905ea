"""Checkpoint integrity through the trainer's own files (issue 11's checkpoint rows).

Flipped bytes inside a tensor, shards copied into another stage's or tensor rank's folder, a
missing pointer file with ``--load`` == ``--save``, stale temporaries and a full disk: each is a
one-line refusal naming the file, or a correct recovery (losses equal to the uninterrupted run's).
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import zipfile

import pytest
import torch
from ckpt_runs import _ckpt_data, gpt_args, one_rank_run, tp2_pp2_run, train  # noqa: F401
from e2e import read_metrics, train_losses

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint import manifest
from megatron_2bw.errors import ConfigError


def _error_lines(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


def _tensor_data_offset(path: str) -> tuple[int, int]:
    """(file offset, size) of the largest tensor storage inside a torch.save zip archive."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_eight_flipped_bytes_inside_a_tensor_are_refused(one_rank_run, tmp_path):  # noqa: F811
    load = str(tmp_path / "ckpt")
    shutil.copytree(one_rank_run.save, load)
    path = ck.checkpoint_path(load, 4, 0, 0, 1)
    start, size = _tensor_data_offset(path)
    with open(path, "r+b") as f:
        f.seek(start + size // 2)
        data = f.read(8)
        f.seek(start + size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    torch.load(path, weights_only=False)  # still a readable file: only the manifest can tell
    res = train([*one_rank_run.args, "--load", load])
    assert res.returncode == 2, res.describe()
    errors = _error_lines(res)
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.describe()
    assert f"checkpoint file {path} is corrupt: crc32" in errors[0]


def _swap(a: str, b: str) -> None:
    tmp = a + ".swap"
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


@pytest.mark.parametrize("what", ["pipeline stage", "tensor rank"])
@pytest.mark.parametrize("with_manifest", [True, False])
def test_shards_in_the_wrong_folder_are_refused(tp2_pp2_run, tmp_path, what, with_manifest):  # noqa: F811
    """The file each rank loads (before any process group) names itself when it sits in another's folder."""
    load = str(tmp_path / "ckpt")
    shutil.copytree(tp2_pp2_run.save, load)
    other = (0, 1) if what == "pipeline stage" else (1, 0)
    mine = ck.checkpoint_path(load, 10, 0, 0, 2)
    _swap(mine, ck.checkpoint_path(load, 10, *other, 2))
    if not with_manifest:  # a checkpoint without a manifest: the file's recorded place still decides
        os.remove(os.path.join(ck.iteration_dir(load, 10), manifest.MANIFEST))
    for tp, pp in [(0, 0), other]:
        with pytest.raises(ConfigError) as e:
            ck.load_rank_file(load, 10, 2, 2, tp, pp)
        line = str(e.value)
        assert "\n" not in line and ck.checkpoint_path(load, 10, tp, pp, 2) in line
        if with_manifest:
            assert "is corrupt" in line and "copied into the wrong folder" in line
        else:
            assert f"was written as {what}" in line and "copied into the wrong folder" in line
    if with_manifest:
        assert ck.load_rank_file(load, 10, 2, 2, 1, 1)["layout"]["pp_rank"] == 1  # an untouched shard still loads
    else:  # format 3 always writes a manifest (issue 19): without it even an untouched shard is not trusted
        with pytest.raises(ConfigError, match="has no manifest.json but its files are format 3"):
            ck.load_rank_file(load, 10, 2, 2, 1, 1)


def test_missing_tracker_resumes_from_newest_complete_and_removes_stale_temporaries(one_rank_run, tmp_path):  # noqa: F811
    """--load == --save without the pointer file: resume from the newest complete iter_* (its losses
    equal the uninterrupted run's bitwise), never from scratch; a dead save's temporary is removed."""
    save = str(tmp_path / "ckpt")
    shutil.copytree(one_rank_run.save, save)
    os.remove(os.path.join(save, ck.TRACKER))
    os.remove(os.path.join(ck.iteration_dir(save, 4), manifest.MANIFEST))  # iteration 4 never finished
    stale = ck.checkpoint_path(save, 4, 0, 0, 1) + ".tmp.999999"
    with open(stale, "wb") as f:
        f.write(b"partial")
    metrics = str(tmp_path / "m.jsonl")
    res = train([*one_rank_run.args, "--load", save, "--save", save, "--metrics-file", metrics])
    assert res.returncode == 0, res.describe()
    assert f"{os.path.join(save, ck.TRACKER)} is missing: resuming from iteration 2" in res.stderr
    assert f"removed stale temporary {stale}" in res.stderr and not os.path.exists(stale)
    resumed, straight = train_losses(read_metrics(metrics)), train_losses(one_rank_run.metrics)
    assert sorted(resumed) == [2, 3] and resumed == {k: straight[k] for k in resumed}
    assert ck.read_tracker(save) == 4 and manifest.verify(ck.iteration_dir(save, 4)) is not None


def test_full_disk_is_one_line_naming_the_file(tmp_path):
    """A real ENOSPC (the temporary is /dev/full): one line with the file and the errno text, no temporary left."""
    path = str(tmp_path / "iter_0000001" / "mp_rank_00" / ck.FILENAME)
    os.makedirs(os.path.dirname(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    os.symlink("/dev/full", tmp)
    with pytest.raises(ConfigError) as e:
        ck.atomic_torch_save({"w": torch.randn(1 << 16)}, path)
    assert str(e.value) == f"writing {path} failed: {os.strerror(errno.ENOSPC)} (ENOSPC)"
    assert not os.path.lexists(tmp) and not os.path.exists(path)


def test_manifest_lists_every_shard_with_its_identity(tp2_pp2_run):  # noqa: F811
    idir = ck.iteration_dir(tp2_pp2_run.save, 10)
    doc = manifest.verify(idir)  # every checksum matches the bytes on disk
    assert sorted(doc["files"]) == [f"{ck.rank_dir_name(tp, pp, 2)}/{ck.FILENAME}"
                                    for tp in range(2) for pp in range(2)]
    for rel, entry in doc["files"].items():
        assert entry["identity"] == {"iteration": 10, "t": 2, "d": 2, "w": 1, "schedule": "2bw",
                                     **manifest.identity_from_path(rel)}
        assert (entry["crc32"], entry["size"]) == manifest.file_checksum(os.path.join(idir, rel))
