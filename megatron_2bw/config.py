"""Validated configuration dataclasses of one training run (model, layout, pipeline, optimizer, ...).

Every check happens where the object is built, so a bad layout is refused before any
process group or collective exists. The command-line flags that fill these fields are one
table in ``cli.py``; nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .errors import ConfigError
from .schedule.stages import canonical_split, check_virtual_split, layers_per_stage
from .schedule.recompute_policy import RecomputePolicy, check_recompute
from .schedule.schedules import SCHEDULE_NAMES, ScheduleSpec, get_schedule, parse_schedule_id


# fp16's largest finite value: a constant loss scale above it overflows every scaled loss >= 1.
FP16_MAX = 65504.0
# numpy's seeds (the data order) are 32-bit.
MAX_SEED = 2**32 - 1


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require_finite(obj: object) -> None:
    """Refuse inf/nan in any float field of a config dataclass (a flag typed ``float`` accepts them)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float):
            _require(math.isfinite(v), f"{_flag(f.name)} must be a finite number, got {v}")


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

    def __post_init__(self) -> None:
        _require(self.make_vocab_size_divisible_by >= 1,
                 f"--make-vocab-size-divisible-by must be >= 1, got {self.make_vocab_size_divisible_by}")
        _require(self.kind in ("gpt", "bert"), f"model kind must be 'gpt' or 'bert', got {self.kind!r}")
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
        if self.kind == "bert":
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

    def stage_activation_shape(self, micro_batch: int, t: int) -> tuple[int, int, int]:
        """What one pipeline stage sends the next: ``[b, s, h]``, the sequence sharded over t with
        --sequence-parallel."""
        s = self.seq_length // t if self.sequence_parallel else self.seq_length
        return (micro_batch, s, self.hidden_size)

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
        if self.llama_style:
            return self.llama_num_parameters()
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+proj, mlp, 2 LayerNorms
        emb = self.vocab_size * h + self.max_position_embeddings * h + self.num_tokentypes * h
        head = 2 * h  # final LayerNorm
        if self.kind == "bert":
            head += h * h + h + 2 * h + self.vocab_size + h * 2 + 2 + h * h + h  # lm transform, bias, SOP pooler
        return L * per_layer + emb + head

    @property
    def llama_style(self) -> bool:
        """Any Llama-family option on (the GPT-2-style formulas above do not hold)."""
        return (self.position_embedding_type != "learned_absolute" or self.swiglu or self.normalization != "LayerNorm"
                or self.group_query_attention or self.untie_embeddings_and_output_weights or not self.add_bias_linear)

    def llama_num_parameters(self) -> int:
        """Parameter count for any combination of the Llama-family options (GQA, SwiGLU, RMSNorm, untied)."""
        h, f, L, hd = self.hidden_size, self.ffn_hidden_size, self.num_layers, self.head_dim
        qkv_out = (self.num_attention_heads + 2 * self.query_groups) * hd
        mlp_in = 2 * f if self.swiglu else f
        bias = self.add_bias_linear
        norm = h if self.normalization == "RMSNorm" else 2 * h
        per_layer = (h * qkv_out + qkv_out * bias + h * h + h * bias
                     + h * mlp_in + mlp_in * bias + f * h + h * bias + 2 * norm)
        emb = self.vocab_size * h + self.num_tokentypes * h
        if self.position_embedding_type == "learned_absolute":
            emb += self.max_position_embeddings * h
        head = norm + (self.vocab_size * h if self.untie_embeddings_and_output_weights else 0)
        return L * per_layer + emb + head


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool = False) -> int:
    """Megatron-LM's default: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64 (same FLOPs)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


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


P2P_MODES = ("auto", "prefetch", "grouped")
DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd", "muon")  # optimizer/flat.py, optimizer/muon.py
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
COMPENSATIONS = ("none", "predict", "dc", "ef", "extrapolate")  # 2BW stale-gradient compensation (pipeline/compensation.py)
AUTO_COMPENSATION = "auto"  # --2bw-compensation's default: resolve_compensation picks by the measurements


def resolve_compensation(mode: str, schedule: str, optimizer: str, dtype: str, distributed_optimizer: bool,
                         sgd_momentum: float = 0.0) -> str:
    """``--2bw-compensation auto`` (the flag's default) as the measurements favour it
    (``docs/data/convergence_optimizers.json``, ``docs/benchmarks.md`` section 3): none for a schedule
    without stale gradients; ``ef`` with Muon (2BW + ef matched or beat Flush where plain 2BW did not);
    ``predict`` with Adam, or SGD with momentum, in bf16/fp16 without the distributed optimizer (better
    than plain 2BW in every measured regime and seed, and free there: the master holds the newest
    weights anyway); otherwise none (predict would cost a weight copy in fp32, and is refused with the
    distributed optimizer). Any other ``mode`` is returned as given."""
    if mode != AUTO_COMPENSATION:
        return mode
    if schedule not in SCHEDULE_NAMES or get_schedule(schedule).stale_steps == 0:
        return "none"
    if optimizer == "muon":
        return "ef"
    if dtype != "fp32" and not distributed_optimizer and (optimizer == "adam" or sgd_momentum > 0):
        return "predict"
    return "none"


CKPT_FORMATS = ("torch", "torch_dist")  # --ckpt-format (Megatron-LM's names; checkpoint/dist_checkpoint/)
# elements per message when the distributed optimizer's state is gathered for a torch-format save: the
# only device buffer a save allocates (pipeline/zero.gather_full; counted by planner/memory_model)
CKPT_GATHER_CHUNK = 1 << 24


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
    compensation: str = "none"  # 2BW only: none, predict, dc, ef or extrapolate (pipeline/compensation.py)
    dc_lambda: float = 0.04  # lambda of compensation "dc"
    ef_scale: float = 1.0  # gamma of "ef" (applied D_t + gamma (D_t - D_{t-1})) and of "extrapolate" (g_t + gamma (g_t - g_{t-1}))
    # transformer layers of each stage (schedule/stages.py); None: the even split
    layer_split: tuple[int, ...] | None = None
    # recomputation inside a stage (schedule/recompute_policy.py); ``recompute`` re-runs whole stages
    recompute_granularity: str | None = None  # full or selective
    recompute_method: str | None = None  # uniform or block (full only)
    recompute_num_layers: int | None = None
    # model chunks per rank (Megatron's --virtual-pipeline-model-parallel-size; interleaved-1f1b); None: the
    # schedule's own count (1 for the one-chunk schedules, 2 for interleaved-1f1b)
    virtual_stages: int | None = None
    # --enable-optimizer-post-validation: speculative updates checked in the next step's warm-up (zb-h1, zb-h2, zb-v)
    post_validation: bool = False

    @property
    def chunks(self) -> int:
        """Model chunks per rank the schedule runs."""
        return get_schedule(self.schedule, self.virtual_stages).chunks

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule as this configuration runs it (its chunks, its post-validation)."""
        return get_schedule(self.schedule, self.virtual_stages, self.post_validation)

    def __post_init__(self) -> None:
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(int(n) for n in self.layer_split))
        check_recompute(self.recompute, self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        _require(
            self.schedule in SCHEDULE_NAMES,
            f"--pipeline-schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}",
        )
        _require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _require(self.num_microbatches >= 1, f"microbatches per step must be >= 1, got {self.num_microbatches}")
        _require(self.p2p_mode in P2P_MODES, f"--p2p-mode must be one of {', '.join(P2P_MODES)}, got {self.p2p_mode!r}")
        _require(
            self.compensation in COMPENSATIONS + (AUTO_COMPENSATION,),
            f"--2bw-compensation must be one of {', '.join(COMPENSATIONS + (AUTO_COMPENSATION,))}, "
            f"got {self.compensation!r}",
        )
        _require(
            self.compensation in ("none", AUTO_COMPENSATION) or get_schedule(self.schedule).stale_steps > 0,
            f"--2bw-compensation {self.compensation} only applies to --pipeline-schedule 2bw, not {self.schedule}",
        )
        _ = self.spec  # refuses chunks or post-validation the schedule does not take (one line)
        _require(math.isfinite(self.dc_lambda) and self.dc_lambda >= 0,
                 f"--2bw-dc-lambda must be finite and >= 0, got {self.dc_lambda}")
        _require(math.isfinite(self.ef_scale) and self.ef_scale >= 0,
                 f"--2bw-ef-scale must be finite and >= 0, got {self.ef_scale}")

    def check_depth(self, d: int) -> None:
        """Refuse fewer microbatches per step than the schedule needs at depth ``d``."""
        need = get_schedule(self.schedule).min_microbatches(d)
        m = self.num_microbatches
        at_least = f"d microbatches per step: m={m} < d={d}" if need == d else f"{need} microbatches per step: m={m}"
        _require(
            m >= need,
            f"PipeDream-{self.schedule.upper()} needs at least {at_least} "
            "(raise --global-batch-size or lower --micro-batch-size)",
        )
        get_schedule(self.schedule, self.virtual_stages).check_layout(d, m)


def fp32_grads_for(dtype: str, given: bool | None = None) -> bool:
    """The gradient-accumulation rule: fp32 in fp32 training; with bf16 unless ``given`` is False (Megatron
    forces it there); with fp16 only when ``given`` is True."""
    if dtype == "fp32":
        return True
    return dtype == "bf16" if given is None else bool(given)


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
    # --optimizer muon (optimizer/muon.py): Muon on the tensor-parallel linear weights, AdamW elsewhere
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_lr: float | None = None  # the matrices' peak learning rate; None: --lr
    muon_adjust_lr_fn: str = "original"  # torch.optim.Muon's shape scale: original or match_rms_adamw
    clip_grad: float = 1.0  # 0 disables clipping
    dtype: str = "fp32"
    loss_scale: float | None = None  # fp16: None = dynamic scaling
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    dp_bucket_mb: float = 25.0
    # gradients accumulate over the microbatches and are all-reduced in fp32 (Megatron's
    # --accumulate-allreduce-grads-in-fp32); None: on for bf16 (as Megatron forces it), off for fp16
    accumulate_allreduce_grads_in_fp32: bool | None = None
    # ZeRO-1 (Megatron's --use-distributed-optimizer): fp32 master and optimizer state sharded over the
    # data-parallel group; gradients reduce-scattered, updated shards all-gathered
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        _require(self.optimizer in OPTIMIZERS, f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _require(self.dtype in DTYPES, f"precision must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require_finite(self)
        _require(self.lr >= 0, f"--lr must be >= 0, got {self.lr}")
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.adam_eps > 0,
                 f"--adam-eps must be positive (it keeps Adam's denominator off zero), got {self.adam_eps}")
        _require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "--adam-beta1/2 must be in [0, 1)")
        _require(0 <= self.sgd_momentum < 1, f"--sgd-momentum must be in [0, 1), got {self.sgd_momentum}")
        self._check_muon()
        self._check_loss_scale()

    def _check_muon(self) -> None:
        _require(0 <= self.muon_momentum < 1, f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        _require(isinstance(self.muon_ns_steps, int) and 1 <= self.muon_ns_steps < 100,
                 f"--muon-ns-steps must be an integer in [1, 100), got {self.muon_ns_steps}")
        _require(self.muon_lr is None or self.muon_lr >= 0, f"--muon-lr must be >= 0, got {self.muon_lr}")
        _require(self.muon_adjust_lr_fn in MUON_ADJUST_LR_FNS,
                 f"--muon-adjust-lr-fn must be one of {', '.join(MUON_ADJUST_LR_FNS)}, got {self.muon_adjust_lr_fn!r}")

    def _check_loss_scale(self) -> None:
        s = self.loss_scale
        _require(s is None or s > 0, f"--loss-scale must be positive, got {s}")
        _require(
            s is None or self.dtype != "fp16" or s <= FP16_MAX,
            f"--loss-scale {s} is above fp16's largest value {FP16_MAX:g}: every scaled loss >= 1 would overflow "
            "and every step be skipped (leave --loss-scale unset for dynamic scaling)",
        )
        _require(self.initial_loss_scale > 0, f"--initial-loss-scale must be positive, got {self.initial_loss_scale}")
        _require(self.min_loss_scale > 0, f"--min-loss-scale must be positive, got {self.min_loss_scale}")
        _require(self.loss_scale_window >= 1, f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def fp32_grads(self) -> bool:
        """Whether gradients accumulate and are all-reduced in fp32 (always, when the model is fp32)."""
        return fp32_grads_for(self.dtype, self.accumulate_allreduce_grads_in_fp32)

    @property
    def grad_dtype(self) -> str:
        """The precision of the gradient buffers: ``fp32`` or the model's."""
        return "fp32" if self.fp32_grads else self.dtype

    @property
    def torch_grad_dtype(self):
        import torch

        return torch.float32 if self.fp32_grads else self.torch_dtype


DECAY_STYLES = ("linear", "cosine", "constant", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")  # Megatron's --lr-wsd-decay-style


@dataclass(frozen=True)
class LRConfig:
    """Megatron's learning-rate schedule: linear warm-up, then linear/cosine/constant/inverse-square-root/WSD
    decay to min_lr (training/lr_schedule.py)."""

    lr: float
    min_lr: float = 0.0
    decay_style: str = "linear"
    warmup_iters: int = 0
    decay_iters: int = 1
    samples_per_step: int | None = None  # --train-samples: warm-up and decay are counted in samples
    wsd_decay_style: str = "exponential"  # WSD: the shape of the final anneal
    wsd_decay_iters: int | None = None  # WSD: length of the anneal that ends at decay_iters (samples with --train-samples)
    # inverse-square-root without warm-up: Megatron divides by sqrt(consumed samples), which needs the batch
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        _require(self.decay_style in DECAY_STYLES, f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}")
        _require(self.wsd_decay_style in WSD_DECAY_STYLES,
                 f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}")
        if self.decay_style == "WSD":
            w = self.wsd_decay_iters
            _require(w is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
            _require(1 <= w <= self.decay_iters,
                     f"--lr-wsd-decay-iters {w} must be in [1, the decay iterations {self.decay_iters}]")
        _require_finite(self)
        _require(self.lr > 0, f"--lr must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        _require(self.warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.warmup_iters}")
        _require(self.decay_iters >= 1, f"--lr-decay-iters must be >= 1, got {self.decay_iters}")
        _require(
            self.warmup_iters <= self.decay_iters,
            f"--lr-warmup-iters {self.warmup_iters} exceeds the decay iterations {self.decay_iters}",
        )


def lr_by_samples(given: dict[str, Any], train_samples: int, decay_samples: int | None, warmup_samples: int | None,
                  global_batch: int) -> LRConfig:
    """Megatron's sample-based schedule (``--train-samples``): warm-up and decay counted in consumed samples."""
    decay = decay_samples if decay_samples is not None else train_samples
    return LRConfig(**{**given, "decay_iters": decay, "warmup_iters": warmup_samples or 0,
                       "samples_per_step": global_batch})


def train_iters_of(train_iters: int | None, train_samples: int | None, global_batch: int) -> int:
    """``--train-iters``, or Megatron's ``--train-samples // --global-batch-size``."""
    if train_samples is None:
        _require(train_iters is not None, "the following arguments are required: --train-iters (or --train-samples)")
        return train_iters
    _require(train_iters is None, "give --train-iters or --train-samples, not both")
    _require(train_samples >= global_batch, f"--train-samples {train_samples} is less than one global batch ({global_batch})")
    return train_samples // global_batch


@dataclass(frozen=True)
class TrainingConfig:
    """Length of the run, its batch, and when to log, evaluate, save and exit."""

    train_iters: int
    global_batch_size: int
    seed: int = 1234
    train_samples: int | None = None  # given instead of --train-iters (train_iters = train_samples // batch)
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    override_resumed_settings: bool = False  # resume although data or schedule settings changed
    exit_signal_handler: bool = True  # SIGTERM/SIGHUP/exit_signal: save at the next boundary, exit 0 (--no-exit-signal-handler: off)
    exit_signal: str = "SIGUSR1"  # the extra signal handled like SIGTERM (SLURM's --signal warning)
    exit_duration_in_mins: float | None = None  # save and exit 0 after this long
    max_skipped_steps: int | None = None  # None: the precision's default (training/health.py)
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    finetune: bool = False  # load the weights only: iteration 0, fresh optimizer
    no_load_optim: bool = False  # resume weights and iteration with a fresh optimizer
    no_load_rng: bool = False  # keep this run's seeds instead of the checkpoint's RNG states
    skip_train: bool = False  # evaluate the loaded checkpoint and exit
    ckpt_format: str = "torch"  # what --save writes: torch (Megatron v2 files) or torch_dist (DCP)
    async_save: bool = False  # torch_dist: write in the background while training goes on
    overwrite_save: bool = False  # --save holds another run's checkpoints: delete them and start over
    # Megatron's logging and memory flags (issue 19): see megatron_2bw/flags.py for what each does here
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    tensorboard_log_interval: int = 1
    empty_unused_memory_level: int = 0
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _require(self.tensorboard_log_interval >= 1,
                 f"--tensorboard-log-interval must be >= 1, got {self.tensorboard_log_interval}")
        _require(self.empty_unused_memory_level in (0, 1, 2),
                 f"--empty-unused-memory-level must be 0, 1 or 2, got {self.empty_unused_memory_level}")
        _require(0 <= self.profile_step_start < self.profile_step_end,
                 f"--profile-step-start {self.profile_step_start} must be >= 0 and below --profile-step-end "
                 f"{self.profile_step_end}")
        if self.profile_ranks is not None:
            object.__setattr__(self, "profile_ranks", tuple(int(r) for r in self.profile_ranks))
        from .training.health import check_max_skipped_steps  # noqa: PLC0415 - torch-free modules
        from .training.signals import parse_signal  # noqa: PLC0415

        _require(self.train_iters >= 1, f"--train-iters must be >= 1, got {self.train_iters}")
        object.__setattr__(self, "exit_signal", parse_signal(self.exit_signal).name)
        _require(self.exit_signal not in ("SIGKILL", "SIGSTOP"), f"--exit-signal {self.exit_signal} cannot be handled")
        d = self.exit_duration_in_mins
        _require(d is None or 0 < d < math.inf, f"--exit-duration-in-mins must be a positive number, got {d}")
        check_max_skipped_steps(self.max_skipped_steps)
        _require(0 <= self.seed <= MAX_SEED,
                 f"--seed must be in [0, 2**32 - 1] (numpy seeds the data order), got {self.seed}")
        _require(self.global_batch_size >= 1, f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        for name in ("log_interval", "eval_interval", "save_interval", "exit_interval"):
            v = getattr(self, name)
            _require(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        _require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        _require(self.save_interval is None or self.save is not None, "--save-interval needs --save DIR")
        for name in ("finetune", "no_load_optim", "no_load_rng", "skip_train"):
            _require(not getattr(self, name) or self.load is not None, f"--{name.replace('_', '-')} needs --load DIR")
        _require(self.ckpt_format in CKPT_FORMATS,
                 f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, got {self.ckpt_format}")
        _require(not self.async_save or self.ckpt_format == "torch_dist", "--async-save needs --ckpt-format torch_dist")
        _require(not self.async_save or self.save is not None, "--async-save needs --save DIR")
        _require(not self.overwrite_save or self.save is not None, "--overwrite-save needs --save DIR")


@dataclass(frozen=True)
class DataConfig:
    """Indexed dataset prefixes (or a weighted blend), the split, and the tokenizer's files."""

    data_path: tuple[str, ...]
    split: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    mask_prob: float = 0.15  # BERT only
    short_seq_prob: float = 0.1  # BERT only
    # GPT batches as Megatron's get_ltor_masks_and_position_ids (models/gpt.py): no loss on the token
    # after an EOD, positions restarting after each EOD, attention not crossing an EOD
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    mock_data: bool = False  # synthetic documents (data/mock.py) instead of --data-path
    vocab_size: int | None = None  # --tokenizer-type NullTokenizer: ids 0..N-1, eod N
    data_cache_path: str | None = None  # where the GPT sample indices are cached (default: not cached)


# Megatron's --attention-backend: auto (torch's scaled_dot_product_attention picks its kernel), flash and fused
# (only its fused kernels: flash / memory-efficient, no s^2 tensor kept), unfused and local (softmax(QK^T) with
# dropout written out, Megatron's DotProductAttention: the s^2 scores, mask and probabilities are kept)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


@dataclass(frozen=True)
class SystemConfig:
    """Where the run executes: the resolved device, the process-group backend and kernels."""

    device: str  # resolved: "cpu" or "cuda"
    backend: str
    timeout_minutes: float = 10.0
    fused_kernels: str = "auto"
    stall_timeout_s: float = 45.0  # name a rank that stops making progress this long (0: off)
    # --use-cpu-initialization: full weights drawn on the CPU and split (layout-independent); off
    # (Megatron's default): each rank draws its own shards on its device (tensor_parallel/init.py)
    use_cpu_initialization: bool = False
    attention_backend: str = "auto"  # Megatron's --attention-backend (ATTENTION_BACKENDS)

    def __post_init__(self) -> None:
        _require(self.attention_backend in ATTENTION_BACKENDS, f"--attention-backend must be one of "
                 f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        from .training.watchdog import check_stall_timeout  # noqa: PLC0415 - imports no torch at module level

        check_stall_timeout(self.stall_timeout_s)
        _require(self.stall_timeout_s < math.inf, f"--stall-timeout-s must be finite, got {self.stall_timeout_s}")
        _require(
            0 < self.timeout_minutes < math.inf,
            f"--distributed-timeout-minutes must be a positive finite number, got {self.timeout_minutes}",
        )
        _require(
            not (self.backend == "nccl" and self.device != "cuda"),
            "--distributed-backend nccl needs --device cuda (use gloo on CPU)",
        )
        _require(  # gloo has no CUDA reduce-scatter / all-gather-into-tensor and is slow for CUDA p2p
            not (self.backend == "gloo" and self.device == "cuda"),
            "--distributed-backend gloo is not supported with --device cuda (use nccl on GPUs)",
        )


@dataclass(frozen=True)
class Layout:
    """The choices the layout flags make and ``--auto-plan`` makes instead: t, d, b, recompute, schedule,
    the stage split (``None``: even) and whether the optimizer is distributed over the replicas."""

    tensor: int
    pipeline: int
    micro_batch_size: int | None
    recompute: bool
    schedule: str
    layer_split: tuple[int, ...] | None = None
    distributed_optimizer: bool = False  # the planner's choice of --use-distributed-optimizer
    # the planner's recomputation inside stages (--recompute-granularity/-method/-num-layers); None: none
    recompute_policy: RecomputePolicy | None = None
    virtual_stages: int | None = None  # model chunks per rank (--virtual-pipeline-model-parallel-size)


def layout_configs(
    layout: Layout, model: ModelConfig, global_batch_size: int | None, world_size: int, p2p_mode: str = "auto",
) -> tuple[ParallelConfig, PipelineConfig, int]:
    """(ParallelConfig, PipelineConfig, global batch B) of ``layout``, checked against the model and world.

    ``B`` defaults to ``b * w * d`` (``m = d``: the fewest microbatches PipeDream-2BW allows, and a
    small bubble for the flushing schedules); the microbatches per step and pipeline are ``m = B / (b * w)``.
    """
    par = ParallelConfig(layout.tensor, layout.pipeline)
    model.check_tensor_parallel(par.tensor)
    model.check_sequence_parallel(par.tensor)
    split = canonical_split(model.num_layers, par.pipeline, layout.layer_split)
    layers_per_stage(model.num_layers, par.pipeline, split)  # refuses an even split that does not divide
    par = par.resolve(world_size)
    b, w = layout.micro_batch_size, par.data
    _require(b is not None, "--micro-batch-size is required (or give --auto-plan)")
    _require(b >= 1, f"--micro-batch-size must be >= 1, got {b}")
    B = global_batch_size if global_batch_size is not None else b * w * par.pipeline
    _require(B >= 1, f"--global-batch-size must be >= 1, got {B}")
    _require(
        B % (b * w) == 0,
        f"--global-batch-size {B} is not divisible by --micro-batch-size {b} x data-parallel size {w}",
    )
    policy = layout.recompute_policy
    inner = ({"recompute_granularity": policy.granularity, "recompute_method": policy.method,
              "recompute_num_layers": policy.num_layers} if policy is not None and policy.active else {})
    name, pv = parse_schedule_id(layout.schedule)  # the planner's id: zb-h2+pv is zb-h2 with post-validation
    pipe = PipelineConfig(name, b, B // (b * w), recompute=layout.recompute, p2p_mode=p2p_mode,
                          layer_split=split, virtual_stages=layout.virtual_stages, post_validation=pv, **inner)
    pipe.check_depth(par.pipeline)
    if pipe.chunks > 1:
        _require(split is None, f"{layout.schedule} runs {pipe.chunks} model chunks per rank: it needs the even stage "
                                "split (no --pipeline-layer-split)")
        check_virtual_split(model.num_layers, par.pipeline, pipe.chunks)
    return par, pipe, B


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, validated; ``parallel.data`` is resolved against the world size."""

    kind: str
    model: ModelConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    optimizer: OptimizerConfig
    lr: LRConfig
    training: TrainingConfig
    data: DataConfig
    system: SystemConfig

    SECTIONS = ("model", "parallel", "pipeline", "optimizer", "lr", "training", "data", "system")

    def __post_init__(self) -> None:
        if self.pipeline.compensation == AUTO_COMPENSATION:  # the flag's default: what the measurements favour
            o = self.optimizer
            mode = resolve_compensation(AUTO_COMPENSATION, self.pipeline.schedule, o.optimizer, o.dtype,
                                        o.use_distributed_optimizer, o.sgd_momentum)
            object.__setattr__(self, "pipeline", replace(self.pipeline, compensation=mode))
        _require(not (self.optimizer.use_distributed_optimizer and self.pipeline.compensation == "predict"),
                 "--use-distributed-optimizer does not support --2bw-compensation predict (its predicted weights "
                 "would need a full gather at every drain); use dc or none")
        _require(not (self.training.save and self.training.ckpt_format == "torch" and self.parallel.pipeline > 1
                      and get_schedule(self.pipeline.schedule, self.pipeline.virtual_stages).placement(
                          self.parallel.pipeline).shape != "interleaved"),
                 f"--ckpt-format torch cannot hold {self.pipeline.schedule}'s V layout yet: save with --ckpt-format "
                 "torch_dist (its tensors are global)")
        _require(not (self.optimizer.optimizer == "muon" and self.pipeline.compensation == "predict"),
                 "--2bw-compensation predict extrapolates Adam or SGD steps only: use ef or dc with --optimizer muon")
        _require(not (self.data.reset_position_ids and self.model.position_embedding_type == "rope"),
                 "--reset-position-ids resets learned absolute positions; with --position-embedding-type rope the "
                 "rotary positions are not reset (use --reset-attention-mask to keep documents apart)")
        _require(not (self.pipeline.p2p_mode == "prefetch" and self.system.backend == "nccl"),
                 "--p2p-mode prefetch deadlocks on NCCL (its receives posted ahead of the sends to the same peer "
                 "block each other); use --p2p-mode grouped or auto with --distributed-backend nccl")
        _require(not (self.system.attention_backend in ("flash", "fused") and self.system.device == "cpu"
                       and self.model.attention_dropout > 0),
                 f"--attention-backend {self.system.attention_backend} with --attention-dropout "
                 f"{self.model.attention_dropout} on the CPU: torch's CPU flash kernel has no dropout (use auto, "
                 "unfused or --attention-dropout 0)")
        masked = "BERT's padding mask" if self.kind == "bert" else \
            "--reset-attention-mask's mask" if self.data.reset_attention_mask else None
        _require(not (self.system.attention_backend == "flash" and masked),
                 f"--attention-backend flash takes no attention mask ({masked}): use fused, auto or unfused")

    def with_vocab(self, vocab_size: int) -> "RunConfig":
        """The model's vocabulary is the tokenizer's (as in Megatron)."""
        return replace(self, model=replace(self.model, vocab_size=vocab_size))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able nested dict of every section (stored in checkpoints and the metrics file)."""
        return {"kind": self.kind, **{name: asdict(getattr(self, name)) for name in self.SECTIONS}}
