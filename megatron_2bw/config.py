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


SCHEDULES = ("2bw", "flush", "gpipe")
P2P_MODES = ("auto", "prefetch", "grouped")
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class PipelineConfig:
    """Schedule, microbatching and memory options of the pipeline engine."""

    schedule: str = "2bw"
    micro_batch_size: int = 1
    num_microbatches: int = 1  # m: microbatches per optimizer step per pipeline
    recompute: bool = False
    track_memory: bool = True  # measure stashed activation bytes via saved-tensor hooks
    # stage-to-stage transfers: "prefetch" posts receives ahead (gloo), "grouped" issues each run of
    # transfers with one peer as one batch_isend_irecv group (required by NCCL); "auto" picks by backend
    p2p_mode: str = "auto"

    def __post_init__(self) -> None:
        _require(self.schedule in SCHEDULES, f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        _require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _require(self.num_microbatches >= 1, f"microbatches per step must be >= 1, got {self.num_microbatches}")
        _require(self.p2p_mode in P2P_MODES, f"--p2p-mode must be one of {', '.join(P2P_MODES)}, got {self.p2p_mode!r}")

    def check_depth(self, d: int) -> None:
        _require(
            self.schedule != "2bw" or self.num_microbatches >= d,
            f"PipeDream-2BW needs at least d microbatches per step: m={self.num_microbatches} < d={d} "
            f"(raise --global-batch-size or lower --micro-batch-size)",
        )


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, precision and gradient handling (shared by every schedule)."""

    optimizer: str = "adam"
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0  # 0 disables clipping
    dtype: str = "fp32"
    loss_scale: float | None = None  # fp16: None = dynamic scaling
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    dp_bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        _require(self.optimizer in ("adam", "sgd"), f"--optimizer must be adam or sgd, got {self.optimizer!r}")
        _require(self.dtype in DTYPES, f"precision must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(self.lr >= 0, f"--lr must be >= 0, got {self.lr}")
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(self.loss_scale is None or self.loss_scale > 0, f"--loss-scale must be positive, got {self.loss_scale}")
        _require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "--adam-beta1/2 must be in [0, 1)")

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]
