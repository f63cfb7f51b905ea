"""The one place checkpoint_util and generate read and write whole models.

Formats read: a Megatron-LM v2.x directory (``latest_checkpointed_iteration.txt`` or an
iteration dir of ``mp_rank_*`` files, any t x d), a trainer checkpoint of this project
(``format`` 1 files: per-stage parameter names and engine state; or ``--ckpt-format torch_dist``), and a
Hugging Face model directory. Every reader returns the tokenizer the checkpoint recorded (flags and
fingerprint, ``data.fingerprint.recorded_tokenizer``). Formats written: Megatron-LM v2.x (any t x d) and
Hugging Face. Megatron-Core's torch format (flat ``decoder.layers.N`` names, ``mcore_format.py``) is
read and written too: ``mcore`` or Megatron's newer name ``core``.
"""

from __future__ import annotations

import os
from dataclasses import fields

import torch

from ..checkpoint.dist_checkpoint import is_dist_checkpoint
from ..checkpoint.dist_checkpoint.router_state import newest_bias
from ..checkpoint.megatron_format import (
    Exported,
    find_iteration_dir,
    rank_weights,
    read_megatron_dir,
    write_megatron_dir,
)
from ..checkpoint.names import WORD, Split
from ..checkpoint.reshard import unshard, whole_model_config
from ..checkpoint.trainer_format import verified_rank_files
from ..checkpoint.trainer_reshard import TrainerCheckpoint, read_dist_checkpoint
from ..config import ModelConfig
from ..data.fingerprint import recorded_tokenizer
from ..errors import ConfigError
from ..schedule.stages import stage_range
from .hf_io import load_hf_dir, save_hf_dir
from .mcore_format import TRANSFORMER_IMPLS, is_mcore_file, read_mcore_files, write_mcore_dir

LOADERS = ("auto", "megatron", "hf", "mcore", "core")
SAVERS = ("megatron", "hf", "mcore", "core")
MCORE = ("mcore", "core")  # Megatron-LM's tools/checkpoint/convert.py takes both for saver_core/loader_core


def is_trainer_file(sd: dict) -> bool:
    """A file written by this project's trainer (engine state beside the weights)."""
    return isinstance(sd, dict) and "stage" in sd and "layout" in sd and "config" in sd


def trainer_model_config(config: dict) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in config["model"].items() if k in known})


def _global_names(sd: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A trainer file's ``model`` by global name.

    Format 1 files name parameters by their index in the stage's own layer list (the head's
    tied copy is ``{i}.word_weight``); later ones use global names, flat or nested as Megatron's
    ``model``. A stage that starts past the embedding tells flat local from flat global names:
    local indices start at 0.
    """
    lay = sd["layout"]
    if "model0" in sd or "language_model" in sd["model"]:  # Megatron-format contents (model0..: interleaved)
        return {n: v.detach().float().clone() for n, v in rank_weights(
            sd, cfg, t=lay["t"], d=lay["d"], pp=lay["pp_rank"], split=lay.get("split")).items()}
    start = stage_range(cfg.num_layers, lay["d"], lay["pp_rank"], lay.get("split"))[0]
    indices = [int(n.split(".", 1)[0]) for n in sd["model"] if n != WORD]
    offset = start if start > 0 and min(indices) < start else 0
    out = {}
    for name, value in sd["model"].items():
        idx, rest = name.split(".", 1)
        out[WORD if rest == "word_weight" else f"{offset + int(idx)}.{rest}"] = value.detach().float().clone()
    return out


def read_trainer_iteration(iter_dir: str, files: dict | None = None) -> tuple[Exported, bool]:
    """A trainer checkpoint's iteration dir as a whole model; also whether it holds optimizer state.
    ``files``: its rank files already read by :func:`verified_rank_files`."""
    files = verified_rank_files(iter_dir) if files is None else files
    first = files[min(files)]
    cfg = whole_model_config(trainer_model_config(first["config"]))
    parts = {k: _global_names(sd, cfg) for k, sd in files.items()}
    tok = recorded_tokenizer(first.get("args"), first.get("fingerprints"))
    dtype = first["config"].get("optimizer", {}).get("dtype", "fp32")
    return Exported(cfg, unshard(cfg, parts), int(first["iteration"]), tok, dtype), True


def is_dist_path(path: str) -> bool:
    """Whether ``path`` (a root or an iteration dir) holds a torch_dist checkpoint."""
    try:
        return is_dist_checkpoint(path) or is_dist_checkpoint(find_iteration_dir(path))
    except (ConfigError, OSError):
        return False


def dist_exported(ckpt: TrainerCheckpoint) -> Exported:
    """A torch_dist checkpoint's newest weights as a whole model, with the tokenizer it recorded."""
    tok = recorded_tokenizer(ckpt.first.get("args"), ckpt.first.get("fingerprints"))
    dtype = ckpt.first["config"].get("optimizer", {}).get("dtype", "fp32")
    cfg = whole_model_config(ckpt.cfg)
    router = newest_bias(ckpt.families)
    return Exported(cfg, ckpt.families["model"], int(ckpt.first["iteration"]), tok, dtype, router)


def load_checkpoint(path: str, loader: str = "auto") -> tuple[Exported, bool]:
    """The whole model at ``path``; also whether the source held optimizer state."""
    if loader not in LOADERS:
        raise ConfigError(f"--loader must be one of {', '.join(LOADERS)}, got {loader!r}")
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint directory {path} does not exist")
    is_hf = os.path.isfile(os.path.join(path, "config.json"))
    if loader == "hf" or (loader == "auto" and is_hf):
        return load_hf_dir(path), False
    if loader in ("auto", "megatron") and is_dist_path(path):
        return dist_exported(read_dist_checkpoint(path)), True
    idir = find_iteration_dir(path)
    first = verified_rank_files(idir)
    if is_trainer_file(first[min(first)]):
        return read_trainer_iteration(idir, first)
    if loader in MCORE or (loader == "auto" and is_mcore_file(first[min(first)])):
        return read_mcore_files(first, path), any("optimizer" in f for f in first.values())
    has_optimizer = any("optimizer" in f for f in first.values())
    return read_megatron_dir(path), has_optimizer


def refuse_legacy_experts(cfg: ModelConfig) -> None:
    """Megatron-LM v2.x's weights-only layout has no layer with experts (a trainer checkpoint keeps them under names
    of this project, with the config that says so)."""
    if cfg.moe is not None:
        raise ConfigError(f"--saver megatron cannot write an MoE model ({cfg.moe.num_experts} experts) as weights "
                          "only: Megatron-LM v2.x's layout has no expert layers; use --saver mcore, --saver hf, or "
                          "keep the optimizer state (a trainer checkpoint)")


def save_checkpoint(ex: Exported, path: str, saver: str, *, t: int = 1, d: int = 1, schedule: str | None = None,
                    split: Split = None, transformer_impl: str = TRANSFORMER_IMPLS[0], chunks: int = 1) -> str:
    """Write ``ex`` to ``path`` as ``saver`` says; returns what was written."""
    if saver not in SAVERS:
        raise ConfigError(f"--saver must be one of {', '.join(SAVERS)}, got {saver!r}")
    beyond = ex.cfg.beyond_exports()
    if beyond and (saver in MCORE or saver == "hf"):
        raise ConfigError(f"--saver {saver} cannot write a model with {', '.join(beyond)} (no such layer in its "
                          "format); save it with --saver megatron (this trainer's layout) instead")
    if saver == "megatron":
        refuse_legacy_experts(ex.cfg)
    if saver in MCORE:
        if chunks > 1:
            raise ConfigError("--saver mcore writes one model chunk per rank: drop the virtual pipeline target")
        return write_mcore_dir(path, ex, t, d, split, transformer_impl)
    if saver == "hf":
        if (t, d) != (1, 1):
            raise ConfigError("--saver hf writes one whole model: drop --target-tensor/pipeline-parallel-size")
        note = save_hf_dir(path, ex)
        return f"{path} ({note})"
    return write_megatron_dir(path, ex, t, d, schedule, split, chunks)
