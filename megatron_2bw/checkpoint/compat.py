"""What a checkpoint must share with the run that loads it, read the same way by every format."""

from __future__ import annotations

from dataclasses import fields

from ..config import ModelConfig
from ..errors import ConfigError

# Model fields that must agree to load weights (dropout and sequence length may change).
SHAPE_FIELDS = (
    "kind", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "vocab_size", "num_tokentypes",
    "position_embedding_type", "rotary_base", "rotary_percent", "swiglu", "normalization", "group_query_attention",
    "num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear",
)
SHAPE_FIELDS += ("make_vocab_size_divisible_by",)  # the embedding's padded rows (issue 19)


def model_config(config: dict) -> ModelConfig:
    """The ModelConfig a file's ``config`` (``argv.describe``) records."""
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in config["model"].items() if k in known})


def stage_model(config: dict) -> ModelConfig | None:
    """:func:`model_config`, or None for a run whose ``config`` records no model (a test model built by hand,
    whose parameters state their splits themselves: ``dist_checkpoint.shard_map.stage_params``)."""
    return model_config(config) if config.get("model") else None


def check_model(path: str, saved: dict, model: dict) -> None:
    """Every format: the saved model's shape equals this run's (dropout and sequence length may change)."""
    for field in (f for f in SHAPE_FIELDS if f in saved["model"]):
        a, b = saved["model"][field], model.get(field)
        if a != b:
            raise ConfigError(f"checkpoint {path} has {field}={a} but this run has {field}={b}")
    check_moe(path, saved["model"].get("moe"), model.get("moe"))


# MoE fields that shape the weights (config/moe.py): the experts, their width, which layers hold them
MOE_SHAPE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                    "moe_shared_expert_gate")


def _plain(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def check_moe(path: str, saved: dict | None, model: dict | None) -> None:
    """An MoE checkpoint is loaded into an MoE model of the same experts (the expert-parallel size may change)."""
    if (saved is None) != (model is None):
        what = lambda m: "a dense model" if m is None else f"an MoE model ({m['num_experts']} experts)"  # noqa: E731
        raise ConfigError(f"checkpoint {path} holds {what(saved)} but this run builds {what(model)}")
    for field in MOE_SHAPE_FIELDS if saved is not None else ():
        a, b = _plain(saved.get(field)), _plain(model.get(field))
        if a != b:
            raise ConfigError(f"checkpoint {path} has {field}={a} but this run has {field}={b}")


def check_optimizer(path: str, saved: dict, optimizer: dict) -> None:
    """Every format, unless only the weights are loaded: the same optimizer, precision and SGD momentum."""
    for field in ("optimizer", "dtype"):
        a, b = saved["optimizer"][field], optimizer[field]
        if a != b:
            raise ConfigError(f"checkpoint {path} has {field} {a} but this run uses {b} (--no-load-optim loads "
                              "the weights only)")
    sgd = optimizer["optimizer"] == "sgd"  # only SGD's records carry sgd_momentum
    if sgd and (saved["optimizer"]["sgd_momentum"] == 0) != (optimizer["sgd_momentum"] == 0):
        raise ConfigError(f"checkpoint {path} and this run disagree on whether SGD uses momentum")
