"""Checkpoints in Megatron's layout and contents, written atomically, verified on load, holding everything a
bitwise resume needs.

Layout (as Megatron-LM)::

    SAVE/latest_checkpointed_iteration.txt          the iteration of the newest complete checkpoint
    SAVE/iter_0000100/manifest.json                 size, CRC-32 and identity of every file below
    SAVE/iter_0000100/mp_rank_TT/model_optim_rng.pt        d == 1 (TT = tensor rank)
    SAVE/iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt    d > 1  (PPP = pipeline rank)

One file per (tensor, pipeline) rank, written by data-parallel rank 0 of that pair (replicas
hold identical state). With the distributed optimizer (``--use-distributed-optimizer``) the data-
parallel ranks hold shards of the fp32 master and the optimizer state: they are gathered for the
save, so the file is the same as without it, and each rank takes its own shard at load; a
checkpoint therefore loads at any data-parallel width, with or without the distributed optimizer.
Its contents (format 3, ``checkpoint.trainer_format``) are Megatron-LM v2.x's
(``model`` nested as ``language_model.{embedding,encoder}`` holding the newest weights W(step),
``args`` as a Namespace, ``checkpoint_version`` 3.0, ``iteration``), so Megatron's tools and
transformers' converters read them, plus keys of our own: the engine state by parameter name
(2BW's older version, fp32 master, optimizer, loss scaler, step), every RNG state, the data
position, the layout and the run's configuration. Formats 1 and 2 (flat engine buffers) still load.

Atomicity and integrity: each file is written to a temporary name while its CRC-32 is computed,
flushed and renamed; the writers' checksums meet at rank 0, which writes the manifest (atomically)
and only then replaces the pointer file. A crash at any moment leaves the pointer on the previous
complete checkpoint. On load a file is checked against the manifest (flipped bytes, truncation)
and its recorded (tensor rank, stage) against the folder it sits in. Reading is done before
``init_process_group``, so a missing, corrupt or misplaced file is a one-line error, never a hang.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from ..checkpoint import megatron_format, trainer_format
from ..errors import ConfigError, describe_save_failure, os_error_line
from ..schedule.stages import layers_per_stage
from ..tensor_parallel.recompute import RNGSnapshot
from . import manifest, save_guard
from .compat import SHAPE_FIELDS as _SHAPE_FIELDS  # noqa: F401
from .compat import check_model, check_optimizer, model_config
from .layout import (
    FILENAME,
    RANK_DIR_RE,
    TRACKER,
    checkpoint_path,
    iteration_dir,
    iteration_name,
    rank_dir_name,
    read_tracker,
)  # noqa: F401 - re-exported
from .manifest import write_tracker  # noqa: F401 - re-exported

log = logging.getLogger("megatron_2bw")

FORMAT = trainer_format.FORMAT
TRAINER_FORMATS = (1, 2, 3)
MEGATRON_WEIGHTS = "megatron-weights"  # a Megatron-LM file with no engine state (read with --finetune)
READABLE_FORMATS = (*TRAINER_FORMATS, MEGATRON_WEIGHTS)
def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def saved_layout(iter_dir: str) -> tuple[int, int] | None:
    """(t, d) of the checkpoint in ``iter_dir`` as its directory names tell (a lower bound if files are
    missing): the highest tensor and pipeline ranks present; a ``_PPP`` suffix means d > 1."""
    t = d = 0
    for name in os.listdir(iter_dir) if os.path.isdir(iter_dir) else ():
        m = RANK_DIR_RE.fullmatch(name)
        if m and os.path.isfile(os.path.join(iter_dir, name, FILENAME)):
            t = max(t, int(m.group(1)) + 1)
            d = max(d, 1 if m.group(2) is None else max(int(m.group(2)) + 1, 2))
    return (t, d) if t else None


def _manifest_layout(iter_dir: str) -> tuple[int, int] | None:
    """(t, d) the iteration's manifest records for its shards (None: no manifest, or it does not say)."""
    try:
        doc = manifest.read_manifest(iter_dir)
    except ConfigError:
        return None  # verified (and reported) with the shard
    ids = [e.get("identity", {}) for e in (doc or {}).get("files", {}).values() if isinstance(e, dict)]
    layouts = {(i.get("t"), i.get("d")) for i in ids}
    if len(layouts) != 1:
        return None
    (t, d), = layouts
    return (int(t), int(d)) if isinstance(t, int) and isinstance(d, int) else None


def _layout_error(path: str, saved: tuple[int, int], mine: tuple[int, int]) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} was saved with layout t={saved[0]} d={saved[1]} (tensor x pipeline) but this run uses "
        f"t={mine[0]} d={mine[1]}; reshard it with tools/checkpoint_util.py --target-tensor-parallel-size "
        f"{mine[0]} --target-pipeline-parallel-size {mine[1]}"
    )


def find_checkpoint(load: str, save: str | None) -> int | None:
    """The iteration to resume from; None to start fresh.

    ``--load`` equal to ``--save`` without a checkpoint in it starts fresh (Megatron's
    auto-resume pattern for the first run of a job); any other ``--load`` must hold one. With
    ``--load`` == ``--save``, a missing pointer file beside complete ``iter_*`` checkpoints
    resumes from the newest complete one (with a warning) instead of overwriting them.
    """
    it = read_tracker(load)
    if it is not None:
        return it
    it, warning = manifest.recover_missing_tracker(load, save)
    if it is not None:
        log.warning(" %s", warning)
        return it
    same = save is not None and os.path.realpath(save) == os.path.realpath(load)
    if same:
        unfinished = sorted(set(manifest.list_iterations(load)) - set(manifest.list_checkpoints(load)))
        if unfinished:
            log.warning(" ignoring %s in %s: no complete shard (a save killed before its first file was written)",
                        ", ".join(iteration_name(i) for i in unfinished), load)
        return None
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load} does not exist")
    raise ConfigError(f"--load {load} holds no checkpoint (no {TRACKER})")


def _verified_load(path: str, idir: str, rel: str, iteration: int, t: int, d: int) -> dict:
    """``torch.load`` of ``path`` after checking it against the iteration's manifest (when there is one)."""
    doc = manifest.verify(idir, manifest.layout_identity_fn(iteration=iteration, t=t, d=d), only=[rel], require=False)
    if doc is None:
        log.warning(" %s has no %s (written before manifests existed): not verified", idir, manifest.MANIFEST)
    try:
        sd = _torch_load(path)
    except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt file
        raise ConfigError(f"checkpoint file {path} is corrupt or unreadable ({_first_line(e)})") from None
    if isinstance(sd, dict):
        sd["_manifest"] = doc is not None
    return sd


def _safe_globals() -> list:
    """What a trainer file holds besides tensors and containers: Megatron's ``args`` and numpy's RNG state."""
    import argparse  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    core = getattr(np, "_core", None) or np.core
    return [argparse.Namespace, core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _torch_load(path: str):
    """``torch.load`` memory-mapped (tensors stay in the file's pages until the restore copies them into the
    live buffers: a resume holds no second copy of the state) and weights-only with the few classes a trainer
    file holds; a file with other objects (another tool's) is unpickled in full."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError:
        log.info(" %s holds objects beyond weights and Megatron's args: unpickled in full", path)
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def require_manifest(path: str, sd: dict, has_manifest: bool) -> None:
    """Format 3 always writes a manifest: a format-3 file without one is an unfinished save or a removed file."""
    if not has_manifest and isinstance(sd, dict) and sd.get("format") == FORMAT:
        idir = os.path.dirname(os.path.dirname(path))
        raise ConfigError(f"checkpoint {idir} has no {manifest.MANIFEST} but its files are format {FORMAT}, "
                          "which always writes one: the save did not finish or the manifest was removed, so its files "
                          "cannot be verified")


def load_rank_file(load: str, iteration: int, t: int, d: int, tp: int, pp: int) -> dict:
    """This rank's checkpoint file, checked for layout, integrity and place (CPU tensors)."""
    idir = iteration_dir(load, iteration)
    if not os.path.isdir(idir):
        raise ConfigError(f"{os.path.join(load, TRACKER)} names iteration {iteration} but {idir} is missing")
    path = checkpoint_path(load, iteration, tp, pp, d)
    recorded = _manifest_layout(idir)  # before any shard: another t or d is a reshard, not a misplaced file
    if recorded is not None and recorded != (t, d):
        raise _layout_error(idir, recorded, (t, d))
    if not os.path.isfile(path):
        saved = saved_layout(idir)
        if saved is not None and saved != (t, d):
            raise _layout_error(idir, saved, (t, d))
        raise ConfigError(f"checkpoint file {path} is missing")
    sd = _verified_load(path, idir, f"{rank_dir_name(tp, pp, d)}/{FILENAME}", iteration, t, d)
    if _is_megatron_weights(sd):
        sd = _megatron_weights_file(sd, path, tp, pp)
    if not isinstance(sd, dict) or sd.get("format") not in READABLE_FORMATS or "stage" not in sd:
        got = sd.get("format") if isinstance(sd, dict) else None
        raise ConfigError(f"checkpoint file {path} is not a megatron_2bw checkpoint of format "
                          f"{' or '.join(map(str, TRAINER_FORMATS))} (format: {got})")
    lay = sd["layout"]
    if (lay["t"], lay["d"]) != (t, d):
        raise _layout_error(idir, (lay["t"], lay["d"]), (t, d))
    manifest.check_identity(path, {"tp_rank": lay.get("tp_rank"), "pp_rank": lay.get("pp_rank")},
                            {"tp_rank": tp, "pp_rank": pp})
    require_manifest(path, sd, sd.pop("_manifest", True))
    if sd["iteration"] != iteration:
        raise ConfigError(f"checkpoint file {path} holds iteration {sd['iteration']}, not {iteration}")
    sd["path"] = path
    return sd


def _is_megatron_weights(sd) -> bool:
    """A Megatron-LM file without this trainer's engine state (Megatron-LM's own, or checkpoint_util's)."""
    model = sd.get("model", sd.get("model0", {})) if isinstance(sd, dict) else {}  # model0..: interleaved
    return isinstance(sd, dict) and "format" not in sd and "args" in sd and "language_model" in model


def _megatron_weights_file(sd: dict, path: str, tp: int, pp: int) -> dict:
    """Weights only, at step 0: loadable with ``--finetune`` (no optimizer, RNG or older version to resume).

    Shape fields a stage's file cannot show (token types off the first stage, the unpadded vocabulary
    of a Megatron-LM file) are left out of the compatibility check; the weights' sizes are checked on load.
    """
    a = vars(sd["args"]) if not isinstance(sd["args"], dict) else sd["args"]
    cfg = megatron_format.config_from_args(sd["args"], sd.get("model", sd.get("model0")))
    model = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    if pp > 0:
        model.pop("num_tokentypes")
    if not a.get("vocab_size"):
        model.pop("vocab_size")
    t, d = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    return {**sd, "format": MEGATRON_WEIGHTS, "stage": None, "rng": None, "iteration": int(sd.get("iteration", 0)),
            "layout": {"t": t, "d": d, "w": 1, "tp_rank": tp, "pp_rank": pp, "schedule": None,
                       "split": a.get("pipeline_split")},
            "config": {"model": model}, "megatron_config": cfg}


def saved_step(sd: dict) -> int:
    if sd["stage"] is None:
        raise ConfigError(f"checkpoint {sd['path']} holds weights only (a Megatron-LM checkpoint): "
                          "load it with --finetune")
    return int(sd["stage"]["step"])


def _check_split(path: str, layout: dict, num_layers: int, split: tuple[int, ...] | None) -> None:
    """A shard holds the layers of its stage: another per-stage split would load the wrong layers."""
    d = layout["d"]
    saved, mine = layers_per_stage(num_layers, d, layout.get("split")), layers_per_stage(num_layers, d, split)
    if saved != mine:
        raise ConfigError(
            f"checkpoint {path} was saved with layers per stage {','.join(map(str, saved))} but this run uses "
            f"{','.join(map(str, mine))}: pass --pipeline-layer-split {','.join(map(str, saved))}"
        )


def check_compatible(sd: dict, model: dict, schedule: str, optimizer: dict, *, weights_only: bool = False,
                     split: tuple[int, ...] | None = None, chunks: int = 1) -> None:
    """Refuse a checkpoint whose model shape, schedule, optimizer or precision differs from this run's.

    ``weights_only`` (``--finetune``, ``--no-load-optim``): only the model shape must agree.
    """
    path = sd["path"]
    saved = sd["config"]
    check_model(path, saved, model)
    _check_split(path, sd["layout"], model["num_layers"], split)
    mega = sd.get("format") == MEGATRON_WEIGHTS
    saved_chunks = megatron_format.chunks_of(sd) if mega else sd["layout"].get("chunks", 1)
    if saved_chunks != chunks:
        raise ConfigError(
            f"checkpoint {path} holds {saved_chunks} model chunk(s) per pipeline rank but this run uses {chunks} "
            "(--virtual-pipeline-model-parallel-size): each rank's layers differ; convert it with "
            f"tools/checkpoint_util.py --target-schedule {schedule}"
            + (f" --target-virtual-pipeline-parallel-size {chunks}" if chunks > 1 else ""))
    if sd.get("format") == MEGATRON_WEIGHTS and not weights_only:
        saved_step(sd)  # weights only: a resume needs --finetune (--no-load-optim is refused in saved_step)
    if weights_only:
        return
    if sd["layout"]["schedule"] != schedule:
        raise ConfigError(
            f"checkpoint {path} was written by the {sd['layout']['schedule']} schedule but this run uses {schedule} "
            "(the schedules keep different weight versions): convert it with tools/checkpoint_util.py "
            f"--target-schedule {schedule}, or pass --no-load-optim or --finetune"
        )
    check_optimizer(path, saved, optimizer)


# --------------------------------------------------------------------------- writing
def atomic_torch_save(obj, path: str) -> tuple[str, int]:
    """Write ``obj`` to ``path`` so that ``path`` is either absent/old or complete, never partial.

    Returns (CRC-32, size) of the bytes written. A failed write (a full disk) is a one-line
    :class:`ConfigError` naming the file and the errno text.
    """
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise ConfigError(os_error_line(e, os.path.dirname(path), "creating")) from None
    cw = None
    try:
        with manifest.atomic_file(path, "wb") as f:
            cw = manifest.ChecksumWriter(f)
            torch.save(obj, cw)
    except (OSError, RuntimeError) as e:
        raise ConfigError(describe_save_failure(e, path, cw.error if cw is not None else None)) from None
    return cw.checksum, cw.size


def _named_state(stage) -> tuple[dict, dict] | None:
    """(the engine state by global name, the newest weights by global name) on data-parallel rank 0; None on
    the others, after their part of the gathers (a sharded optimizer state's over the data group; at
    expert-parallel size e > 1, the other expert pieces', so that the file holds every expert as at e = 1)."""
    state, w = stage.state, stage.weights
    named = newest = None
    skip: frozenset[int] = frozenset()
    if state.e > 1:  # data rank 0 holds its own experts only: every stack whole, as at expert-parallel size 1
        from .expert_gather import expert_segments, gather_expert_stacks  # noqa: PLC0415 - at a save only

        skip = expert_segments(w)  # gathered once, by the expert gather, not first by the updater's
    if state.dp_rank == 0:
        named, newest = trainer_format.named_engine_state(stage.state_dict(everywhere=False, copy=False, skip=skip),
                                                          w.state_views, w.numel, w.slot(stage.step))
    elif stage.updater.shard is not None:  # the gather to data-parallel rank 0 is a collective
        stage.updater.state_dict(everywhere=False, copy=False, skip=skip)
    if state.e > 1:
        gather_expert_stacks(stage, named, newest)
    return (named, newest) if state.dp_rank == 0 else None


def payload(stage, *, iteration: int, tracker, consumed_samples: int, global_batch: int,
            config: dict, args: dict, fingerprints: dict | None = None) -> dict | None:
    """Everything this rank's file holds (format 3), on writing ranks (data-parallel rank 0); None on
    the others, after their part of gathering a sharded optimizer state. Tensors are views of the live
    CPU buffers, or of one host copy of device buffers (nothing is copied on the device); the file must
    be written before training goes on."""
    state = stage.state
    gathered = _named_state(stage)
    if gathered is None:
        return None
    named, newest = gathered
    model = model_config(config)
    schedule = stage.pipe.schedule
    split = config.get("pipeline", {}).get("layer_split")
    split = list(split) if split else None
    chunks = stage.chunks  # model chunks per rank: an interleaved run's file holds model0, model1, ...
    if stage.placement.shape != "interleaved":
        raise ConfigError(f"--ckpt-format torch cannot hold {schedule}'s V layout yet (its model0/model1 would be "
                          "another run's virtual stages): use --ckpt-format torch_dist, whose tensors are global")
    margs = trainer_format.train_args(model, args, iteration=iteration, t=state.t, d=state.d, schedule=schedule,
                                      dtype=config.get("optimizer", {}).get("dtype", "fp32"), split=split,
                                      chunks=chunks)
    out = trainer_format.file_contents(
        model, newest, args=margs, iteration=iteration, t=state.t, pp=state.pp_rank, d=state.d, split=split,
        chunks=chunks,
        layout={"t": state.t, "d": state.d, "w": state.replicas, "tp_rank": state.tp_rank, "pp_rank": state.pp_rank,
                "schedule": schedule, "split": split, **({"chunks": chunks} if chunks > 1 else {})},
        stage=named,
        rng=RNGSnapshot.capture(state.device, tracker, host_libraries=True).as_dict(),
        data={"consumed_train_samples": consumed_samples, "global_batch_size": global_batch},
        config=config, time=time.time(),
    )
    if fingerprints is not None:
        out["fingerprints"] = fingerprints  # the data and tokenizer trained on (data/fingerprint.py)
    return out


def _gather(entry) -> list:
    if not dist.is_initialized():
        return [entry]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, entry)
    return out


def save(root: str, iteration: int, state, make_payload) -> str:
    """Write this iteration's checkpoint (dp rank 0 of each (tp, pp) writes), its manifest, then the pointer file.

    ``make_payload()`` is called on every rank (gathering a sharded optimizer state is collective) and
    returns the payload on writing ranks; its result elsewhere is ignored. Every rank must call this.
    A failed write on one rank becomes a one-line error on that rank (the others fail at the gather).
    """
    idir = iteration_dir(root, iteration)
    path = checkpoint_path(root, iteration, state.tp_rank, state.pp_rank, state.d)
    entry = None
    sd = make_payload()
    if state.dp_rank == 0:
        save_guard.check_pointer_advances(root, iteration, read_tracker(root))  # before a byte is overwritten
        crc, size = atomic_torch_save(sd, path)
        lay = sd["layout"]
        ident = manifest.shard_identity(iteration=iteration, t=lay["t"], d=lay["d"], w=lay["w"],
                                        tp_rank=lay["tp_rank"], pp_rank=lay["pp_rank"], schedule=lay["schedule"])
        entry = manifest.manifest_entry(idir, path, ident, crc, size)
    entries = _gather(entry)
    if state.rank == 0:
        try:
            manifest.write_manifest(idir, iteration, dict(e for e in entries if e))
        except OSError as e:
            raise ConfigError(os_error_line(e, os.path.join(idir, manifest.MANIFEST))) from None
        save_guard.check_pointer_advances(root, iteration, read_tracker(root))
        write_tracker(root, iteration)
    return idir


# --------------------------------------------------------------------------- restoring (after the stage is built)
_FRESH_OPTIMIZER = {"master": None, "optimizer": None, "scaler": None}  # the updater keeps its fresh state


def _engine_dict(sd: dict, stage) -> dict:
    """The engine's flat state dict from a file of any readable format."""
    if sd.get("format") == MEGATRON_WEIGHTS:
        return _weights_only_engine_dict(sd, stage)
    if sd.get("format", 1) < 3:
        return sd["stage"]
    w, st = stage.weights, stage.state
    return trainer_format.engine_state(sd, model_config(sd["config"]), w.global_names, w.sizes, w.names,
                                       len(w.flat), w.offsets, experts=(st.ep_rank, st.e))


def _weights_only_engine_dict(sd: dict, stage) -> dict:
    w, lay, cfg = stage.weights, sd["layout"], sd["megatron_config"]
    named = megatron_format.rank_weights(sd, cfg, t=lay["t"], d=lay["d"], pp=lay["pp_rank"], split=lay.get("split"))
    newest = trainer_format.flatten(named, w.global_names, w.sizes, "the weights", sd["path"],
                                    w.offsets).to(w.flat[0].dtype)
    return {"step": 0, "schedule": stage.pipe.schedule, "names": w.names, "versions": [newest] * len(w.flat),
            **_FRESH_OPTIMIZER}


def restore(sd: dict, stage, tracker, device: torch.device, *, load_optim: bool = True, load_rng: bool = True,
            finetune: bool = False) -> None:
    """Load the engine state and every RNG state from a file read by :func:`load_rank_file`.

    ``load_optim=False`` (``--no-load-optim``): weights and step only, a fresh optimizer and loss
    scaler, the fp32 master copied from the newest weights. ``finetune``: the newest weights only,
    in every version, at step 0 (``--finetune``; implies no optimizer and no RNG state).
    """
    if sd.get("format") == MEGATRON_WEIGHTS and not finetune:
        raise ConfigError(f"checkpoint {sd['path']} holds weights only (a Megatron-LM checkpoint): "
                          "load it with --finetune")
    esd = _engine_dict(sd, stage)
    if finetune or not load_optim:
        esd = {**esd, **_FRESH_OPTIMIZER}
    if finetune:
        newest = esd["versions"][stage.weights.slot(int(esd["step"]))]
        esd = {**esd, "step": 0, "versions": [newest] * len(esd["versions"])}
    try:
        stage.load_state_dict(esd)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ConfigError(f"checkpoint {sd['path']} does not match this stage's parameters "
                          f"({_first_line(e)})") from None
    if finetune or not load_optim:
        stage.updater.master_from(stage.weights.slot(stage.step))
    if load_rng and not finetune and sd.get("rng") is not None:
        RNGSnapshot.from_dict(sd["rng"]).restore(device, tracker)


def load_options(tc) -> dict:
    """:func:`restore`'s options from a TrainingConfig (``--finetune``, ``--no-load-optim``, ``--no-load-rng``)."""
    return {"finetune": bool(getattr(tc, "finetune", False)), "load_optim": not getattr(tc, "no_load_optim", False),
            "load_rng": not getattr(tc, "no_load_rng", False)}
