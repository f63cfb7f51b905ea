"""What a checkpoint must share with the run that loads it, read the same way by every format."""

from __future__ import annotations

from dataclasses import fields

from ..config import ModelConfig

# Model fields that must agree to load weights (dropout and sequence length may change).
SHAPE_FIELDS = (
    "kind", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
    "vocab_size", "num_tokentypes",
    "position_embedding_type", "rotary_base", "rotary_percent", "swiglu", "normalization", "group_query_attention",
    "num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear",
)
SHAPE_FIELDS += ("make_vocab_size_divisible_by",)  # the embedding's padded rows (issue 19)


def model_config(config: dict) -> ModelConfig:
    """The ModelConfig a file's ``config`` (``cli.describe``) records."""
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in config["model"].items() if k in known})
