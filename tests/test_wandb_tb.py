"""TensorBoard and Weights & Biases writers, for real: write scalars, read the files back.

TensorBoard events are read with tensorboard's own EventAccumulator. An offline wandb run is
read from its ``run-<id>.wandb`` file: a LevelDB-style log (7-byte ``:W&B`` header, 32 KiB
blocks, records ``crc32 | length | type``) of wandb's protobuf ``Record`` messages, decoded
with the ``wandb.proto`` classes of the installed package.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
import zlib

import pytest

from megatron_2bw.errors import ConfigError
from megatron_2bw.training.tb_writer import TensorBoardWriter, finite_scalars, open_tensorboard, require_tensorboard
from megatron_2bw.training.wandb_writer import WandbSettings, open_wandb, require_wandb, wandb_mode, wandb_settings

TRAIN = {1: {"loss": 9.5, "lr": 1e-4, "grad_norm": 2.5, "skipped": False, "tflops": None},
         2: {"loss": 8.25, "lr": 2e-4, "grad_norm": float("nan")},
         3: {"loss": 7.125, "lr": 3e-4, "grad_norm": 1.75}}
VALID = {3: {"loss": 7.5, "ppl": 1808.0424144560632}}


def expected() -> dict[tuple[str, int], float]:
    """What a writer should record: every finite number, nothing else."""
    out = {}
    for prefix, rows in (("train", TRAIN), ("valid", VALID)):
        for step, row in rows.items():
            for k, v in finite_scalars(row).items():
                out[(f"{prefix}/{k}", step)] = v
    return out


def write_all(writer) -> None:
    for step, row in TRAIN.items():
        writer.scalars("train", row, step)
    for step, row in VALID.items():
        writer.scalars("valid", row, step)
    writer.close()


def test_finite_scalars_drops_what_cannot_be_plotted():
    assert finite_scalars({"a": 1, "b": 2.5, "c": None, "d": float("inf"), "e": True, "f": "x"}) == {"a": 1.0, "b": 2.5}


# --------------------------------------------------------------------------- TensorBoard
def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_all(open_tensorboard(str(tmp_path / "tb")))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    want = expected()
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6)  # events store float32
    assert open_tensorboard(None) is None


def test_tensorboard_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"tensorboard package: pip install -e '\.\[tensorboard\]'"):
        require_tensorboard()
    with pytest.raises(ConfigError):
        TensorBoardWriter("unused")


# --------------------------------------------------------------------------- wandb
def test_mode_and_flag_checks():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_settings(None, None, None, "runs/x") is None
    s = wandb_settings("proj", "exp", None, "runs/x", env={})
    assert s == WandbSettings("proj", "exp", os.path.join("runs/x", "wandb"), "offline")
    assert wandb_settings("proj", "exp", "wb", None, env={}).save_dir == "wb"
    with pytest.raises(ConfigError, match="needs --wandb-exp-name"):
        wandb_settings("proj", None, "wb", None)
    with pytest.raises(ConfigError, match="needs --wandb-save-dir"):
        wandb_settings("proj", "exp", None, None)
    with pytest.raises(ConfigError, match="need --wandb-project"):
        wandb_settings(None, "exp", None, None)


def test_wandb_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"wandb package: pip install -e '\.\[wandb\]'"):
        require_wandb()


def read_wandb_records(path: str) -> list:
    """Every protobuf Record of a ``.wandb`` file, checksums verified."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            break
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        pos += 7 + n
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # FULL or LAST completes a record
            rec = pb.Record()
            rec.ParseFromString(partial)
            records.append(rec)
    return records


def test_offline_wandb_run_records_the_scalars(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.chdir(tmp_path)
    settings = wandb_settings("megatron-2bw-test", "tiny-gpt", str(tmp_path / "wb"), None)
    assert settings.mode == "offline"
    writer = open_wandb(settings, config={"train_iters": 3, "kind": "gpt"})
    run_dir = writer.run_dir
    write_all(writer)

    assert os.path.dirname(run_dir) == str(tmp_path / "wb" / "wandb")
    assert os.path.basename(run_dir).startswith("offline-run-")
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    got, config = {}, {}
    for rec in read_wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            values = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            for key, v in values.items():
                if not key.startswith("_"):
                    got[(key, values["_step"])] = v
        elif kind == "run":
            config.update({(u.key or ".".join(u.nested_key)): json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({(u.key or ".".join(u.nested_key)): json.loads(u.value_json) for u in rec.config.update})
    assert got == expected()
    assert config.get("train_iters") == 3 and config.get("kind") == "gpt"
