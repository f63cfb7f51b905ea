"""A config back to text: the trainer flags that rebuild it and the flat arguments checkpoints store.

Derived from the one flag table (``flags.py``), as ``cli.py`` derives the parser from it, but without
argparse: the planner, the trainer's report and its start-up checks print a config through here and never
import the command line. ``render`` turns ``{"section.field": value}`` into flags; ``to_argv`` and
``megatron_args`` apply it to a whole ``RunConfig``; ``pretrain_argv`` is the command the planner prints.
``shape_model`` is the one rule for a model without a preset, which ``cli.model_config`` builds and
``pretrain_argv`` leaves unstated. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from .config import Layout, ModelConfig, RunConfig
from .config.moe import MoEConfig
from .config.presets import GPT2_VOCAB
from .flags import FLAGS, MEGATRON_DROPOUT, Flag
from .schedule.schedules import parse_schedule_id

# Without a preset: the shape flags a model needs.
REQUIRED_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def trainer_flags(kind: str) -> Iterable[Flag]:
    """The rows of the flag table that ``pretrain_{kind}.py`` takes."""
    return (f for f in FLAGS if kind in f.kinds)


def shape_model(given: Mapping[str, Any], kind: str) -> ModelConfig:
    """The model that the fields ``given`` make without a preset: Megatron's dropouts and GPT-2's vocabulary
    unless given, token types for BERT."""
    defaults = {"hidden_dropout": MEGATRON_DROPOUT, "attention_dropout": MEGATRON_DROPOUT, "vocab_size": GPT2_VOCAB}
    return ModelConfig(kind=kind, num_tokentypes=2 if kind == "bert" else 0, **{**defaults, **given})


def _text(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, (tuple, list)) else [str(v)]


def render(values: Mapping[str, Any], kind: str) -> list[str]:
    """The trainer's flags that set each ``"section.field"`` in ``values`` (table order, no old spellings)."""
    argv: list[str] = []
    for f in trainer_flags(kind):
        if f.alias or not f.targets or f.targets[0] not in values:
            continue
        v = values[f.targets[0]]
        if f.const is not None:
            argv += [f.name] if v == f.const else []
        elif v is not None:
            argv += [f.name, *([f.show(v)] if f.show else _text(v))]
    return argv


def config_values(cfg: RunConfig) -> dict[str, Any]:
    """``{"section.field": value}`` of every field of ``cfg``; the model's MoE fields as ``moe.field`` (all None
    for a dense model, as Megatron stores ``num_experts = None``)."""
    values = {f"{sec}.{k}": v for sec, d in cfg.to_dict().items() if isinstance(d, dict) for k, v in d.items()}
    moe = values.pop("model.moe", None)
    values.update({f"moe.{f.name}": (moe or {}).get(f.name) for f in fields(MoEConfig)})
    return values


def to_argv(cfg: RunConfig) -> list[str]:
    """Trainer flags that rebuild ``cfg`` (its model explicitly; the vocabulary comes from the tokenizer)."""
    return render(config_values(cfg), cfg.kind)


def megatron_args(cfg: RunConfig) -> dict[str, Any]:
    """Megatron-style flat arguments (flag dest -> value) of ``cfg``, as checkpoints store them."""
    values = config_values(cfg)
    out: dict[str, Any] = {}
    for f in trainer_flags(cfg.kind):
        if not f.alias and f.targets and f.targets[0] in values:
            v = values[f.targets[0]]
            out[f.dest] = (v == f.const) if f.const is not None else list(v) if isinstance(v, tuple) else v
    return out


def model_values(model: ModelConfig) -> dict[str, Any]:
    """The model fields a command must state: the required shape and what the trainer would not imply."""
    implied = shape_model({k: getattr(model, k) for k in REQUIRED_SHAPE}, model.kind)
    names = [f.targets[0].split(".")[1] for f in FLAGS if f.targets and f.targets[0].startswith("model.")]
    return {f"model.{n}": getattr(model, n) for n in names
            if n in REQUIRED_SHAPE or getattr(model, n) != getattr(implied, n)}


def pretrain_argv(model: ModelConfig, layout: Layout, global_batch_size: int, precision: str = "fp32",
                  fp32_grads: bool | None = None) -> list[str]:
    """The ``pretrain_{gpt,bert}.py`` command line that trains ``model`` with ``layout`` (the planner's);
    ``fp32_grads`` None leaves the precision's default gradient accumulation unstated."""
    schedule, post_validation = parse_schedule_id(layout.schedule)
    values = {
        **model_values(model), "parallel.tensor": layout.tensor, "parallel.pipeline": layout.pipeline,
        "pipeline.schedule": schedule, "pipeline.post_validation": post_validation,
        "pipeline.micro_batch_size": layout.micro_batch_size,
        "pipeline.layer_split": layout.layer_split, "pipeline.virtual_stages": layout.virtual_stages,
        "training.global_batch_size": global_batch_size, "pipeline.recompute": layout.recompute,
        "optimizer.dtype": precision, "optimizer.accumulate_allreduce_grads_in_fp32": fp32_grads,
        "optimizer.use_distributed_optimizer": layout.distributed_optimizer,
    }
    return [f"pretrain_{model.kind}.py", *render(values, model.kind)]


def describe(cfg: RunConfig) -> dict[str, Any]:
    """The start-up description: every config field, nested by section (checkpoints and the metrics file)."""
    return cfg.to_dict()
