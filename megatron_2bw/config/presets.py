"""Named model sizes: the paper's GPT/BERT models and tiny ones for tests and the demo.

Data about configs, so it lives with them: the flag table, the command line and the planner read it
without importing the models."""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from .model import ModelConfig

GPT2_VOCAB = 50257
BERT_VOCAB = 30522
LLAMA3_VOCAB = 128256
# Llama: RoPE, SwiGLU, RMSNorm, no linear biases, grouped-query attention (Megatron-Core's flags)
_LLAMA = dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", add_bias_linear=False,
              group_query_attention=True)
_LLAMA3 = dict(_LLAMA, rotary_base=500000, untie_embeddings_and_output_weights=True)

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
    # Llama-3-like shapes (no weights; vocabulary of Llama 3's tokenizer). 1B ties its embeddings (Llama 3.2).
    "llama-1b": ModelConfig("gpt", 16, 2048, 32, 8192, 8192, LLAMA3_VOCAB, ffn_hidden_size=8192,
                            **dict(_LLAMA3, untie_embeddings_and_output_weights=False), num_query_groups=8),
    "llama-8b": ModelConfig("gpt", 32, 4096, 32, 8192, 8192, LLAMA3_VOCAB, ffn_hidden_size=14336, **_LLAMA3,
                            num_query_groups=8),
    "llama-70b": ModelConfig("gpt", 80, 8192, 64, 8192, 8192, LLAMA3_VOCAB, ffn_hidden_size=28672, **_LLAMA3,
                             num_query_groups=8),
    "llama-demo": ModelConfig("gpt", 4, 256, 4, 128, 128, 8000, ffn_hidden_size=704, **_LLAMA3, num_query_groups=2),
    "llama-tiny": ModelConfig("gpt", 4, 64, 4, 16, 16, 300, ffn_hidden_size=128, **_LLAMA3, num_query_groups=2),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with field overrides (re-validated)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --model-preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
