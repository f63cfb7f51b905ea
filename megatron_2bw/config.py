"""Validated configuration dataclasses: model shape and parallel layout.

Every check happens where the object is built, so a bad layout is refused before any
process group or collective exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT or BERT model. ``vocab_size`` is the tokenizer's (unpadded) size."""

    kind: str = "gpt"  # "gpt" or "bert"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    max_position_embeddings: int | None = None
    vocab_size: int = 512
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    num_tokentypes: int = 0  # BERT: 2

    def __post_init__(self) -> None:
        _require(self.kind in ("gpt", "bert"), f"model kind must be 'gpt' or 'bert', got {self.kind!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            _require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}",
        )
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        _require(
            self.max_position_embeddings >= self.seq_length,
            f"--max-position-embeddings {self.max_position_embeddings} is smaller than --seq-length {self.seq_length}",
        )
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            _require(0.0 <= v < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {v}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Vocabulary padded to a multiple of 128 * t (padded rows are masked out of the softmax)."""
        mult = 128 * tensor_parallel
        return ((self.vocab_size + mult - 1) // mult) * mult

    def check_tensor_parallel(self, t: int) -> None:
        _require(
            self.num_attention_heads % t == 0,
            f"--num-attention-heads {self.num_attention_heads} is not divisible by --tensor-model-parallel-size {t}",
        )
        _require(
            self.ffn_hidden_size % t == 0,
            f"ffn hidden size {self.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {t}",
        )

    def num_parameters(self) -> int:
        """Parameter count of the full model (unpadded vocabulary, tied embeddings counted once)."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+proj, mlp, 2 LayerNorms
        emb = self.vocab_size * h + self.max_position_embeddings * h + self.num_tokentypes * h
        head = 2 * h  # final LayerNorm
        if self.kind == "bert":
            head += h * h + h + 2 * h + self.vocab_size + h * 2 + 2 + h * h + h  # lm transform, bias, SOP pooler
        return L * per_layer + emb + head


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: tensor ``t``, pipeline depth ``d``, data width ``w``; world = t*d*w."""

    tensor: int = 1
    pipeline: int = 1
    data: int | None = None  # None: derived from the world size

    def __post_init__(self) -> None:
        _require(self.tensor >= 1, f"--tensor-model-parallel-size must be >= 1, got {self.tensor}")
        _require(self.pipeline >= 1, f"--pipeline-model-parallel-size must be >= 1, got {self.pipeline}")
        _require(self.data is None or self.data >= 1, f"data-parallel size must be >= 1, got {self.data}")

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``data`` derived from the world size, refusing a layout that does not divide."""
        tp = self.tensor * self.pipeline
        _require(
            world_size % tp == 0,
            f"world size {world_size} is not divisible by tensor-model-parallel-size {self.tensor} "
            f"x pipeline-model-parallel-size {self.pipeline}",
        )
        w = world_size // tp
        _require(
            self.data is None or self.data == w,
            f"world size {world_size} != tensor {self.tensor} x pipeline {self.pipeline} x data {self.data}",
        )
        return ParallelConfig(self.tensor, self.pipeline, w)

    @property
    def world_size(self) -> int:
        _require(self.data is not None, "ParallelConfig.data is unresolved; call resolve(world_size)")
        return self.tensor * self.pipeline * self.data
