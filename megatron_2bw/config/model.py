"""The model section: sizes, family features (Llama's RoPE, RMSNorm, SwiGLU, grouped queries) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .arith import num_parameters
from .context import CONTEXT_TYPES, P2P
from .families import FAMILIES, Family
from .moe import MoEConfig, moe_config_of
from .rules import _require, _require_finite


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
    # Llama-family layers (Megatron-Core's flags; the defaults are the GPT-2-style model)
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # fraction of each head's channels rotated
    swiglu: bool = False  # SiLU-gated MLP: fc2(silu(gate(x)) * up(x))
    normalization: str = "LayerNorm"  # or "RMSNorm"
    group_query_attention: bool = False
    num_query_groups: int | None = None  # key/value heads; None: one per attention head
    untie_embeddings_and_output_weights: bool = False  # a separate output layer on the last stage
    add_bias_linear: bool = True  # False: --disable-bias-linear
    # Megatron's sequence parallelism (t > 1): norms, dropout and the residual stream sharded along
    # the sequence over the tensor group; the pipeline carries [b, s/t, h]
    sequence_parallel: bool = False
    make_vocab_size_divisible_by: int = 128  # Megatron's: the embedding has a multiple of this * t rows
    moe: MoEConfig | None = None  # mixture of experts (--num-experts ...; config/moe.py); None: dense

    def __post_init__(self) -> None:
        _require(self.make_vocab_size_divisible_by >= 1,
                 f"--make-vocab-size-divisible-by must be >= 1, got {self.make_vocab_size_divisible_by}")
        _require(self.kind in FAMILIES, f"model kind must be {' or '.join(map(repr, FAMILIES))}, got {self.kind!r}")
        self._check_llama_fields()
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
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.swiglu))
        _require(self.ffn_hidden_size > 0, f"--ffn-hidden-size must be positive, got {self.ffn_hidden_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            _require(0.0 <= v < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {v}")
        _require_finite(self)
        _require(self.layernorm_epsilon > 0, f"--layernorm-epsilon must be positive, got {self.layernorm_epsilon}")
        _require(self.init_method_std >= 0, f"--init-method-std must be >= 0, got {self.init_method_std}")
        moe = moe_config_of(self.moe)  # a checkpoint's JSON holds it as a dict
        _require(moe is None or self.kind == "gpt", "--num-experts is implemented for GPT models only")
        object.__setattr__(self, "moe", moe and moe.for_model(self.num_layers, self.ffn_hidden_size))

    def _check_llama_fields(self) -> None:
        """Refuse contradictory or unsupported Llama-family options (one line each)."""
        _require(self.position_embedding_type in POSITION_EMBEDDING_TYPES,
                 f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDING_TYPES)}, "
                 f"got {self.position_embedding_type!r}")
        _require(self.normalization in NORMALIZATIONS,
                 f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}")
        _require(self.rotary_base > 0, f"--rotary-base must be positive, got {self.rotary_base}")
        _require(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ConfigError("--num-query-groups needs --group-query-attention")
        if self.group_query_attention:
            g = self.num_query_groups
            _require(g is not None, "--group-query-attention needs --num-query-groups N")
            _require(g > 0, f"--num-query-groups must be positive, got {g}")
            _require(self.num_attention_heads % g == 0,
                     f"--num-query-groups {g} does not divide --num-attention-heads {self.num_attention_heads}")
        if not self.family.gpt_options:
            llama = [f for f, v in (("--sequence-parallel", self.sequence_parallel),
                                    ("--position-embedding-type rope", self.position_embedding_type == "rope"),
                                    ("--swiglu", self.swiglu), ("--group-query-attention", self.group_query_attention),
                                    ("--untie-embeddings-and-output-weights", self.untie_embeddings_and_output_weights),
                                    ("--disable-bias-linear", not self.add_bias_linear)) if v]
            _require(not llama, f"{llama[0] if llama else ''} is implemented for GPT models only")

    def check_sequence_parallel(self, t: int) -> None:
        """--sequence-parallel needs a tensor group and a sequence it divides (checked at the layout)."""
        if self.sequence_parallel:
            _require(t > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
            _require(self.seq_length % t == 0,
                     f"--seq-length {self.seq_length} is not divisible by --tensor-model-parallel-size {t} "
                     "(--sequence-parallel shards the sequence)")

    def check_context_parallel(self, c: int, t: int, comm_type: str = P2P) -> None:
        """--context-parallel-size c cuts each sequence into 2c chunks (two per rank, for causal balance);
        under --sequence-parallel a rank's 2 chunks are then sharded over t; --cp-comm-type a2a scatters a
        tensor rank's heads and key/value groups over the c ranks."""
        CONTEXT_TYPES[comm_type].check(c, t, self.num_attention_heads, self.query_groups)
        if c > 1:
            _require(self.seq_length % (2 * c) == 0,
                     f"--seq-length {self.seq_length} is not divisible by 2 x --context-parallel-size {c} "
                     "(each rank holds two of 2c equal chunks of the sequence)")
            _require(not self.sequence_parallel or (self.seq_length // c) % t == 0,
                     f"--seq-length {self.seq_length} / --context-parallel-size {c} is not divisible by "
                     f"--tensor-model-parallel-size {t} (--sequence-parallel shards a rank's part of the sequence)")

    def stage_activation_shape(self, micro_batch: int, t: int, c: int = 1) -> tuple[int, int, int]:
        """What one pipeline stage sends the next: ``[b, s, h]``, the sequence sharded over c (context
        parallel), then over t with --sequence-parallel."""
        s = self.seq_length // c
        s = s // t if self.sequence_parallel else s
        return (micro_batch, s, self.hidden_size)

    @property
    def family(self) -> Family:
        """The family's facts (``families.py``): what the config, arithmetic, planner and names ask of ``kind``."""
        return FAMILIES[self.kind]

    @property
    def mlp_block(self) -> str:
        """The MLP block the layers are built with (``blocks.MLP_BLOCKS``, ``models/transformer.py:MLPS``)."""
        return "dense"

    @property
    def query_groups(self) -> int:
        """Key/value heads (= attention heads without grouped-query attention)."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (even), 0 without RoPE."""
        if self.position_embedding_type != "rope":
            return 0
        return int(self.head_dim * self.rotary_percent) // 2 * 2

    def features(self) -> list[str]:
        """The family's choices that change the model's numbers, as the start-up line names them (GPT-2 style
        when none is on). A new layer feature names itself here, beside its field."""
        feats = []
        if self.position_embedding_type == "rope":
            pct = f" {self.rotary_percent:g} of each head" if self.rotary_percent != 1.0 else ""
            feats.append(f"RoPE (base {self.rotary_base}{pct})")
        else:
            feats.append("learned positions")
        feats.append("SwiGLU" if self.swiglu else "GELU")
        feats.append(self.normalization)
        if self.group_query_attention:
            feats.append(f"GQA {self.query_groups} groups")
        if self.untie_embeddings_and_output_weights:
            feats.append("untied output")
        if not self.add_bias_linear:
            feats.append("no linear biases")
        if self.moe is not None:
            feats.append(f"MoE {self.moe.num_experts} experts top-{self.moe.moe_router_topk}")
        if self.hidden_dropout or self.attention_dropout:
            feats.append(f"dropout {self.hidden_dropout:g} hidden, {self.attention_dropout:g} attention")
        return feats

    def beyond_exports(self) -> tuple[str, ...]:
        """The flags of features this model has that no export format (Hugging Face, Megatron-Core) can
        write: an export of such a model is refused in one line rather than written as another model. A
        layer feature that the exporters do not map names itself here, beside its field."""
        return ()  # experts: Hugging Face (Mixtral, Qwen2-MoE) and Megatron-Core map them, refusing what they cannot

    @property
    def tied_output(self) -> bool:
        """The output layer is the word embedding (GPT-2, BERT); False with a separate output weight."""
        return not self.untie_embeddings_and_output_weights

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's padded vocabulary: a multiple of ``--make-vocab-size-divisible-by`` (128) * t
        (padded rows are masked out of the softmax)."""
        mult = self.make_vocab_size_divisible_by * tensor_parallel
        return ((self.vocab_size + mult - 1) // mult) * mult

    def check_tensor_parallel(self, t: int) -> None:
        _require(
            self.num_attention_heads % t == 0,
            f"--num-attention-heads {self.num_attention_heads} is not divisible by --tensor-model-parallel-size {t}",
        )
        _require(
            self.query_groups % t == 0,
            f"--num-query-groups {self.query_groups} is not divisible by --tensor-model-parallel-size {t}",
        )
        _require(
            self.ffn_hidden_size % t == 0,
            f"ffn hidden size {self.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {t}",
        )

    def num_parameters(self) -> int:
        """Parameter count of the full model (unpadded vocabulary, tied embeddings counted once)."""
        return num_parameters(self)

    @property
    def llama_style(self) -> bool:
        """Any Llama-family option on (the GPT-2-style formulas above do not hold)."""
        return (self.position_embedding_type != "learned_absolute" or self.swiglu or self.normalization != "LayerNorm"
                or self.group_query_attention or self.untie_embeddings_and_output_weights or not self.add_bias_linear)


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool = False) -> int:
    """Megatron-LM's default: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64 (same FLOPs)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


