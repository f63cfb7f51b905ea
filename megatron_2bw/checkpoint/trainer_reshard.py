"""Reshard a trainer checkpoint (format 3) to another tensor x pipeline layout or schedule, optimizer state included.

Every per-parameter tensor of a file (the newest weights in ``model``, 2BW's older version, the fp32
master copy, each optimizer buffer such as Adam's moments) is merged across ranks into the full
t = 1 model and split again for the target layout exactly like the weights (``checkpoint.reshard``):
the optimizer state moves with the parameter it belongs to. Scalars (the step, the optimizer's
step count, the loss scaler) are the same on every rank and are copied.

Schedules: 2BW -> flush keeps the newest version (``model``) and drops the older one; flush ->
2BW starts both versions equal (a file without an older version loads that way). Interleaved runs
(``model0``, ``model1``, ... per rank: one per model chunk) convert to and from any other layout the
same way: the families are whole-model dicts by global name, and the global layer order is the same.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from ..checkpoint import manifest
from ..config import ModelConfig
from ..config.moe_arith import MOE_MLP
from ..errors import ConfigError
from ..schedule.schedules import get_schedule
from ..schedule.stages import check_virtual_split
from . import trainer_format
from .compat import model_config
from .layout import iteration_dir
from .megatron_format import FILENAME, TRACKER, find_iteration_dir, rank_dir
from .names import is_moe_layer
from .reshard import reshard, unshard

MODEL = "model"


@dataclass
class TrainerCheckpoint:
    """A whole trainer checkpoint: every per-parameter family as a full t = 1 state dict, plus one source file."""

    cfg: ModelConfig
    families: dict[str, dict[str, torch.Tensor]]  # "model", "older", "master", "optimizer.<key>"
    first: dict  # the (0, 0) file: args, config, data, scalars of the engine state


def _families(sd: dict, cfg: ModelConfig) -> dict[str, dict[str, torch.Tensor]]:
    st = sd["stage"]
    out = {MODEL: trainer_format.newest_weights(sd, cfg)}
    for key in ("older", "master"):
        if st.get(key):
            out[key] = st[key]
    out.update({f"optimizer.{k}": v for k, v in st["optimizer"].items() if isinstance(v, dict)})
    return out


def read_trainer_checkpoint(path: str) -> TrainerCheckpoint:
    """The checkpoint ``path`` names (root or iteration dir), verified against its manifest when it has one."""
    from .trainer_format import verified_rank_files

    idir = find_iteration_dir(path)
    files = verified_rank_files(idir)
    first = files[min(files)]
    bad = [k for k, sd in files.items() if sd.get("format") != trainer_format.FORMAT or "stage" not in sd]
    if bad:
        raise ConfigError(f"{idir} is not a trainer checkpoint of format {trainer_format.FORMAT} (rank {bad[0]}): its "
                          "optimizer state cannot be resharded; pass --no-optimizer to convert the weights only")
    cfg = model_config(first["config"])
    per_rank = {k: _families(sd, cfg) for k, sd in files.items()}
    names = set(per_rank[min(per_rank)])
    if any(set(f) != names for f in per_rank.values()):
        raise ConfigError(f"the files of {idir} disagree on which engine state they hold")
    families = {n: unshard(cfg, {k: f[n] for k, f in per_rank.items()}) for n in sorted(names)}
    return TrainerCheckpoint(cfg, families, first)


def _stage_entry(ckpt: TrainerCheckpoint, parts: dict[str, dict], schedule: str) -> dict:
    st = ckpt.first["stage"]
    opt = {k: (parts[f"optimizer.{k}"] if isinstance(v, dict) else copy.deepcopy(v))
           for k, v in st["optimizer"].items()}
    older = parts.get("older") if get_schedule(schedule).weight_versions > 1 else None
    return {"step": st["step"], "schedule": schedule, "older": older,
            "master": parts.get("master"), "optimizer": opt, "scaler": copy.deepcopy(st["scaler"])}


def target_chunks(ckpt: TrainerCheckpoint, d: int, schedule: str | None, chunks: int | None) -> int:
    """Model chunks per rank of the target: ``chunks`` if given, else the source's when the schedule stays,
    else the target schedule's own (2 for interleaved-1f1b); refused (one line) where they do not fit."""
    source = ckpt.first["layout"]
    if chunks is None:
        chunks = source.get("chunks", 1) if schedule in (None, source["schedule"]) else get_schedule(schedule).chunks
    spec = get_schedule(schedule or source["schedule"], chunks)
    if spec.chunks > 1:
        check_virtual_split(ckpt.cfg.num_layers, d, spec.chunks)
    return spec.chunks


def _file(ckpt: TrainerCheckpoint, parts: dict[str, dict], *, t: int, d: int, tp: int, pp: int, schedule: str,
          chunks: int = 1) -> dict:
    first = ckpt.first
    args = copy.deepcopy(first["args"])
    vars(args).update(tensor_model_parallel_size=t, pipeline_model_parallel_size=d, model_parallel_size=t,
                      padded_vocab_size=ckpt.cfg.padded_vocab_size(t), pipeline_schedule=schedule, pipeline_split=None,
                      virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    config = copy.deepcopy(first["config"])
    config.setdefault("pipeline", {}).update(schedule=schedule, layer_split=None,
                                             virtual_stages=chunks if chunks > 1 else None)
    config.setdefault("parallel", {}).update(tensor=t, pipeline=d)
    return trainer_format.file_contents(
        ckpt.cfg, parts[MODEL], args=args, iteration=int(first["iteration"]), t=t, pp=pp, d=d, chunks=chunks,
        layout={"t": t, "d": d, "w": 1, "tp_rank": tp, "pp_rank": pp, "schedule": schedule, "split": None,
                **({"chunks": chunks} if chunks > 1 else {})},
        stage=_stage_entry(ckpt, parts, schedule), rng=None, data=copy.deepcopy(first["data"]), config=config,
    )


def write_trainer_checkpoint(root: str, ckpt: TrainerCheckpoint, *, t: int, d: int, schedule: str | None,
                             chunks: int | None = None) -> str:
    """Write ``ckpt`` under ``root`` for layout ``t x d`` (manifest, then the pointer file); returns the iteration dir.
    ``chunks``: model chunks per rank (:func:`target_chunks`)."""
    chunks = target_chunks(ckpt, d, schedule, chunks)
    schedule = schedule or ckpt.first["layout"]["schedule"]
    split = {n: reshard(ckpt.cfg, full, t, d, chunks=chunks) for n, full in ckpt.families.items()}
    it = int(ckpt.first["iteration"])
    idir = iteration_dir(root, it)
    entries = {}
    for tp, pp in split[MODEL]:
        parts = {n: s[(tp, pp)] for n, s in split.items()}
        path = os.path.join(idir, rank_dir(tp, pp, d), FILENAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with manifest.atomic_file(path, "wb") as f:
            cw = manifest.ChecksumWriter(f)
            torch.save(_file(ckpt, parts, t=t, d=d, tp=tp, pp=pp, schedule=schedule, chunks=chunks), cw)
        ident = manifest.shard_identity(iteration=it, t=t, d=d, w=1, tp_rank=tp, pp_rank=pp, schedule=schedule)
        rel, entry = manifest.manifest_entry(idir, path, ident, cw.checksum, cw.size)
        entries[rel] = entry
    manifest.write_manifest(idir, it, entries)
    with manifest.atomic_file(os.path.join(root, TRACKER), "w") as f:
        f.write(f"{it}\n")
    return idir


# --------------------------------------------------------------------------- the torch_dist format
def expert_stacks(cfg: ModelConfig, named: dict[str, torch.Tensor], *, flat: bool) -> dict[str, torch.Tensor]:
    """``named`` with each expert stack in the torch_dist format's 2-D shape ``[E, out * in]`` (``flat``; its
    shards are 2-D: ``dist_checkpoint/shard_map.py``) or the model's ``[E, out, in]`` (every other family here)."""
    shapes = {f"{i + 1}.mlp.{p.name}": p.shape for i in range(cfg.num_layers) if is_moe_layer(cfg, i)
              for p in MOE_MLP.params(cfg) if len(p.shape) > 2}
    return {n: v.reshape((shapes[n][0], -1) if flat else shapes[n]) if n in shapes else v for n, v in named.items()}


def read_dist_checkpoint(path: str) -> TrainerCheckpoint:
    """A torch_dist checkpoint (root or iteration dir) as a :class:`TrainerCheckpoint`: its global
    tensors are already the full t = 1 families, its common state gives the (0, 0) file's keys."""
    from ..checkpoint import dist_checkpoint as dc  # noqa: PLC0415

    idir = path if dc.is_dist_checkpoint(path) else find_iteration_dir(path)
    common, families = dc.read_whole(idir)
    cfg = model_config(common["config"])
    families = {f: expert_stacks(cfg, named, flat=False) for f, named in families.items()}
    opt_keys = {f.split(".", 1)[1]: {} for f in families if f.startswith("optimizer.")}
    first = {"args": common["args"], "config": common["config"], "data": common["data"],
             "iteration": common["iteration"], "layout": {**common["layout"], "tp_rank": 0, "pp_rank": 0},
             "stage": {"step": common["step"], "schedule": common["schedule"], "scaler": common["scaler"],
                       "optimizer": {**opt_keys, **common["optimizer"]}}}
    return TrainerCheckpoint(cfg, families, first)


def write_dist_checkpoint(root: str, ckpt: TrainerCheckpoint, *, schedule: str | None) -> str:
    """Write ``ckpt`` as a torch_dist checkpoint (layout-free: any t, d, w resumes from it)."""
    from ..checkpoint import dist_checkpoint as dc  # noqa: PLC0415

    first, st = ckpt.first, ckpt.first["stage"]
    schedule = schedule or first["layout"]["schedule"]
    families = {n: expert_stacks(ckpt.cfg, f, flat=True) for n, f in ckpt.families.items()
                if n != "older" or get_schedule(schedule).weight_versions > 1}
    args = copy.deepcopy(first["args"])
    vars(args).update(pipeline_schedule=schedule)
    config = copy.deepcopy(first["config"])
    config.setdefault("pipeline", {}).update(schedule=schedule, layer_split=None)
    if schedule != first["layout"]["schedule"]:  # the resuming run's own chunk count applies
        config["pipeline"]["virtual_stages"] = None
    common = {"format": dc.FORMAT, "iteration": int(first["iteration"]), "step": int(st["step"]), "schedule": schedule,
              "layout": {"t": None, "d": None, "w": None, "schedule": schedule, "split": None,
                         "distributed_optimizer": False},
              "config": config, "args": args, "data": copy.deepcopy(first["data"]),
              "scaler": copy.deepcopy(st["scaler"]),
              "optimizer": {k: copy.deepcopy(v) for k, v in st["optimizer"].items() if not isinstance(v, dict)}}
    return dc.write_whole(root, int(first["iteration"]), common, families)
