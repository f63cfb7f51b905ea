"""Checkpoints in Megatron's layout, written atomically, holding everything a bitwise resume needs.

Layout (as Megatron-LM)::

    SAVE/latest_checkpointed_iteration.txt          the iteration of the newest complete checkpoint
    SAVE/iter_0000100/mp_rank_TT/model_optim_rng.pt        d == 1 (TT = tensor rank)
    SAVE/iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt    d > 1  (PPP = pipeline rank)

One file per (tensor, pipeline) rank, written by data-parallel rank 0 of that pair (replicas
hold identical state). A file holds the newest weights (``model``, keyed by the parameter's name
in the full single-stage model, e.g. ``5.attn.qkv.weight`` on whichever stage holds layer 4),
the engine's state (both 2BW weight versions, the fp32 master copy, optimizer and loss-scaler
state, the step), every RNG state, the data position, the layout and the run's arguments.
Format 1 keyed ``model`` by stage-local names; the engine state is the same, so it still loads.

Atomicity: each file is written to a temporary name, flushed to disk and renamed; then all
ranks meet at a barrier; only then does rank 0 replace the pointer file (again by rename). A
crash at any moment leaves the pointer on the previous complete checkpoint, so what
``--load`` finds always loads right. Reading is done before ``init_process_group``, so a
missing, corrupt or mismatched checkpoint is a one-line error, never a hang.
"""

from __future__ import annotations

import os
import re
import time

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..pipeline.recompute import RNGSnapshot

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
FORMAT = 2
READABLE_FORMATS = (1, 2)
# Model fields that must agree to load weights (dropout and sequence length may change).
_SHAPE_FIELDS = (
    "kind", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "vocab_size", "num_tokentypes",
)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir_name(tp: int, pp: int, d: int) -> str:
    """Megatron's name: ``mp_rank_TT`` without pipelining, ``mp_rank_TT_PPP`` with it."""
    return f"mp_rank_{tp:02d}" if d == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


def checkpoint_path(root: str, iteration: int, tp: int, pp: int, d: int) -> str:
    return os.path.join(iteration_dir(root, iteration), rank_dir_name(tp, pp, d), FILENAME)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


# --------------------------------------------------------------------------- reading (before init)
def read_tracker(root: str) -> int | None:
    """The iteration the pointer file names, or None when ``root`` holds no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if not re.fullmatch(r"\d+", text):
        raise ConfigError(f"{path} does not hold an iteration number (got {text[:40]!r})")
    return int(text)


def saved_layout(iter_dir: str) -> tuple[int, int] | None:
    """(t, d) of the checkpoint in ``iter_dir`` as its directory names tell (a lower bound if files are
    missing): the highest tensor and pipeline ranks present; a ``_PPP`` suffix means d > 1."""
    t = d = 0
    for name in os.listdir(iter_dir) if os.path.isdir(iter_dir) else ():
        m = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", name)
        if m and os.path.isfile(os.path.join(iter_dir, name, FILENAME)):
            t = max(t, int(m.group(1)) + 1)
            d = max(d, 1 if m.group(2) is None else max(int(m.group(2)) + 1, 2))
    return (t, d) if t else None


def _layout_error(path: str, saved: tuple[int, int], mine: tuple[int, int]) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} was saved with layout t={saved[0]} d={saved[1]} (tensor x pipeline) but this run uses "
        f"t={mine[0]} d={mine[1]}; resharding checkpoints is not supported yet"
    )


def find_checkpoint(load: str, save: str | None) -> int | None:
    """The iteration to resume from; None to start fresh.

    ``--load`` equal to ``--save`` without a checkpoint in it starts fresh (Megatron's
    auto-resume pattern for the first run of a job); any other ``--load`` must hold one.
    """
    it = read_tracker(load)
    if it is not None:
        return it
    same = save is not None and os.path.abspath(save) == os.path.abspath(load)
    if same:
        return None
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load} does not exist")
    raise ConfigError(f"--load {load} holds no checkpoint (no {TRACKER})")


def load_rank_file(load: str, iteration: int, t: int, d: int, tp: int, pp: int) -> dict:
    """This rank's checkpoint file, checked for layout and integrity (CPU tensors)."""
    idir = iteration_dir(load, iteration)
    if not os.path.isdir(idir):
        raise ConfigError(f"{os.path.join(load, TRACKER)} names iteration {iteration} but {idir} is missing")
    path = checkpoint_path(load, iteration, tp, pp, d)
    if not os.path.isfile(path):
        saved = saved_layout(idir)
        if saved is not None and saved != (t, d):
            raise _layout_error(idir, saved, (t, d))
        raise ConfigError(f"checkpoint file {path} is missing")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt file
        raise ConfigError(f"checkpoint file {path} is corrupt or unreadable ({_first_line(e)})") from None
    if not isinstance(sd, dict) or sd.get("format") not in READABLE_FORMATS or "stage" not in sd:
        got = sd.get("format") if isinstance(sd, dict) else None
        raise ConfigError(f"checkpoint file {path} is not a megatron_2bw checkpoint of format "
                          f"{' or '.join(map(str, READABLE_FORMATS))} (format: {got})")
    lay = sd["layout"]
    if (lay["t"], lay["d"]) != (t, d):
        raise _layout_error(idir, (lay["t"], lay["d"]), (t, d))
    if sd["iteration"] != iteration:
        raise ConfigError(f"checkpoint file {path} holds iteration {sd['iteration']}, not {iteration}")
    sd["path"] = path
    return sd


def check_compatible(sd: dict, model: dict, schedule: str, optimizer: dict) -> None:
    """Refuse a checkpoint whose model shape, schedule, optimizer or precision differs from this run's."""
    path = sd["path"]
    saved = sd["config"]
    for field in _SHAPE_FIELDS:
        a, b = saved["model"].get(field), model.get(field)
        if a != b:
            raise ConfigError(f"checkpoint {path} has {field}={a} but this run has {field}={b}")
    if sd["layout"]["schedule"] != schedule:
        raise ConfigError(
            f"checkpoint {path} was written by the {sd['layout']['schedule']} schedule but this run uses {schedule} "
            "(the schedules keep different weight versions)"
        )
    for field in ("optimizer", "dtype"):
        a, b = saved["optimizer"][field], optimizer[field]
        if a != b:
            raise ConfigError(f"checkpoint {path} has {field} {a} but this run uses {b}")
    if optimizer["optimizer"] == "sgd" and (saved["optimizer"]["sgd_momentum"] == 0) != (optimizer["sgd_momentum"] == 0):
        raise ConfigError(f"checkpoint {path} and this run disagree on whether SGD uses momentum")


# --------------------------------------------------------------------------- writing
def _fsync_dir(path: str) -> None:
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


def atomic_torch_save(obj, path: str) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either absent/old or complete, never partial."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)


def payload(stage, *, iteration: int, tracker, consumed_samples: int, global_batch: int,
            config: dict, args: dict) -> dict:
    """Everything this rank's file holds. ``model`` shares storage with the saved newest version."""
    sd = stage.state_dict()
    state = stage.state
    return {
        "format": FORMAT,
        "iteration": iteration,
        "layout": {"t": state.t, "d": state.d, "w": state.w, "tp_rank": state.tp_rank, "pp_rank": state.pp_rank,
                   "schedule": stage.pipe.schedule},
        "model": stage.newest_state(sd),
        "stage": sd,
        "rng": RNGSnapshot.capture(state.device, tracker, host_libraries=True).as_dict(),
        "data": {"consumed_train_samples": consumed_samples, "global_batch_size": global_batch},
        "config": config,
        "args": args,
        "time": time.time(),
    }


def save(root: str, iteration: int, state, make_payload) -> str:
    """Write this iteration's checkpoint (dp rank 0 of each (tp, pp) writes), then the pointer file.

    ``make_payload()`` is called only on writing ranks. Every rank must call this.
    """
    path = checkpoint_path(root, iteration, state.tp_rank, state.pp_rank, state.d)
    if state.dp_rank == 0:
        atomic_torch_save(make_payload(), path)
    if dist.is_initialized():
        dist.barrier()
    if state.rank == 0:
        write_tracker(root, iteration)
    return iteration_dir(root, iteration)


def restore(sd: dict, stage, tracker, device: torch.device) -> None:
    """Load the engine state and every RNG state from a file read by :func:`load_rank_file`."""
    try:
        stage.load_state_dict(sd["stage"])
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"checkpoint {sd['path']} does not match this stage's parameters ({_first_line(e)})") from None
    RNGSnapshot.from_dict(sd["rng"]).restore(device, tracker)
