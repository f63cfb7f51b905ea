"""Reading and validating a torch_dist checkpoint without a process group: every file's size against
the manifest, a CRC-32 of each rank's share, DCP's index, and the rank-independent state; and a
whole checkpoint in one process (``tools/checkpoint_util.py``).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...errors import ConfigError
from .. import manifest
from ..compat import check_model, check_optimizer
from ..layout import TRACKER, iteration_dir
from .collective import first_line
from .files import COMMON, FORMAT, METADATA, rng_key
from .planners import LoadPlanner
from .shard_map import Chunk


def read_checkpoint(load: str, iteration: int, rank: int, world: int, layout: tuple) -> dict:
    """The checkpoint's rank-independent state, after checking its files; no process group needed.

    Every file's presence and size is checked, and the CRC-32 of this rank's share of them
    (file i by rank i mod world), so the whole checkpoint is verified once per resume.
    ``layout``: this run's (t, d, w, split); the RNG states load only at the saved layout.
    """

    idir = iteration_dir(load, iteration)
    if not os.path.isdir(idir):
        raise ConfigError(f"{os.path.join(load, TRACKER)} names iteration {iteration} but {idir} is missing")
    doc = manifest.verify(idir, checksums=False, require=True)
    files = sorted(doc["files"])
    manifest.verify(idir, only=files[rank::world], checksums=True)
    reader = dcp.FileSystemReader(idir)
    try:
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - an unreadable index is a corrupt checkpoint
        raise ConfigError(f"checkpoint file {os.path.join(idir, METADATA)} is corrupt or unreadable "
                          f"({first_line(e)})") from None
    keys = set(md.state_dict_metadata)
    wanted = [COMMON] + ([rng_key(rank)] if rng_key(rank) in keys else [])
    planner = LoadPlanner([], wanted, idir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # no process group before init, by design
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint {idir} is unreadable ({first_line(e)})") from None
    common = planner.objects[COMMON]
    if not isinstance(common, dict) or common.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {idir} is not a megatron_2bw {FORMAT} checkpoint")
    lay = common["layout"]
    same = (lay["t"], lay["d"], lay["w"], tuple(lay["split"] or ()) or None) == \
        (layout[0], layout[1], layout[2], tuple(layout[3] or ()) or None)
    return {"format": FORMAT, "path": idir, "iteration": common["iteration"], "common": common, "keys": keys,
            "stage": {"step": common["step"], "schedule": common["schedule"]}, "layout": lay,
            "config": common["config"], "args": common["args"], "data": common["data"],
            "rng": planner.objects.get(rng_key(rank)) if same else None, "same_layout": same}


def check_compatible(sd: dict, model: dict, optimizer: dict, *, weights_only: bool = False) -> None:
    """Refuse a checkpoint of another model shape, optimizer or precision (layout and schedule may differ)."""

    path, saved = sd["path"], sd["config"]
    check_model(path, saved, model)
    if not weights_only:
        check_optimizer(path, saved, optimizer)


def read_whole(iter_dir: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(common state, family -> global name -> full tensor) of a torch_dist checkpoint, in one process
    (``tools/checkpoint_util.py``), after checking it against its manifest."""
    manifest.verify(iter_dir, require=True)
    reader = dcp.FileSystemReader(iter_dir)
    try:
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint file {os.path.join(iter_dir, METADATA)} is corrupt or unreadable "
                          f"({first_line(e)})") from None
    chunks, families = [], {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            family, name = fqn.split("/", 1)
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            families.setdefault(family, {})[name] = t
            chunks.append(Chunk(fqn, (0,) * len(m.size), tuple(m.size), t))
    planner = LoadPlanner(chunks, [COMMON], iter_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    return planner.objects[COMMON], families
