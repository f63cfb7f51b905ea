"""Named model sizes: the paper's GPT/BERT models and tiny ones for tests and the demo."""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from ..errors import ConfigError

GPT2_VOCAB = 50257
BERT_VOCAB = 30522

PRESETS: dict[str, ModelConfig] = {
    # The paper's models (sequence length 512).
    "gpt-355m": ModelConfig("gpt", 24, 1024, 16, 512, 512, GPT2_VOCAB),
    "gpt-1.3b": ModelConfig("gpt", 24, 2048, 16, 512, 512, GPT2_VOCAB),
    "gpt-2.2b": ModelConfig("gpt", 32, 2304, 32, 512, 512, GPT2_VOCAB),
    "gpt-3.8b": ModelConfig("gpt", 32, 3072, 32, 512, 512, GPT2_VOCAB),
    "bert-355m": ModelConfig("bert", 24, 1024, 16, 512, 512, BERT_VOCAB, num_tokentypes=2),
    # Small models: the demo (a few million parameters) and tests.
    "gpt-demo": ModelConfig("gpt", 4, 256, 4, 128, 128, 8000),
    "bert-demo": ModelConfig("bert", 4, 256, 4, 128, 128, 8000, num_tokentypes=2),
    "gpt-tiny": ModelConfig("gpt", 4, 64, 4, 16, 16, 300),
    "bert-tiny": ModelConfig("bert", 4, 64, 4, 16, 16, 300, num_tokentypes=2),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with field overrides (re-validated)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --model-preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
