"""What one microbatch costs in each kind of block: time, parameters, activation bytes.

The planner's only view of the model. The model is ``num_layers`` identical transformer layers,
with the embedding on the first stage and the head (final LayerNorm, output layer, loss) on the
last. Costs come from one of two places, in the same ``LayerCosts`` table:

- ``analytic_layer_costs``: FLOPs and bytes counted from the model shape, timed with the device's
  peak FLOP/s times the efficiency curve of ``efficiency.py``. Stated as an estimate in the output.
- ``load_profile``: a JSON file a profiler wrote from measurements (schema below).

Counting rules of the analytic estimate (Megatron GPT/BERT layer, pre-LayerNorm, ``f`` = FFN size):

- Forward FLOPs of one layer: ``(2bs(4h^2 + 2hf) + 4bs^2h) / t`` (QKV, projection and the two MLP
  GEMMs, plus the two attention batched GEMMs); backward = 2 x forward. Head: ``2bshV/t``.
- Activation bytes one layer keeps for its backward (Korthikanti et al. 2022, "Reducing activation
  recomputation", generalised to ``f`` and to dropout being off), ``e`` = bytes per element.
  Replicated across the tensor group: the two LayerNorm inputs, the QKV
  input and the MLP input (``4bshe``) and the two hidden-dropout masks (``2bsh``, 1 byte each);
  split by ``t``: Q, K, V and the projection input (``4bshe``), the GeLU input and output
  (``2bsfe``), the softmax output (``ab s^2 e``) and, with attention dropout, its mask and output
  (``ab s^2 (1 + e)``). For fp16, f = 4h, dropout on, t = 1 this is the paper-era ``sbh(34 + 5as/h)``.
- With a fused attention kernel (``Cluster.flash_attention``: the engine's
  ``F.scaled_dot_product_attention`` on sm80+ GPUs) the ``s^2`` terms give way to the kernel's fp32
  log-sum-exp per row (``4abs/t``): Korthikanti's ``sbh(10 + 24/t)``. Which kernel runs follows the
  run's ``--attention-backend`` (``Cluster.attention_backend``, ``attention_kernel``): flash/fused keep
  no ``s^2`` tensor, unfused/local keep Korthikanti's, and auto on the CPU is torch's flash kernel
  without attention dropout and its fp32 math path (three fp32 ``s^2`` tensors: ``12abs^2/t``) with it.
  A dropout mask is 1 byte on GPUs (fused dropout) and ``e`` bytes on the CPU (torch keeps the scaled
  noise there).
- With an efficiency curve in ``macs`` (efficiency.py) the curve prices the GEMMs and the
  memory-bound kernels between them are timed on HBM (``layer_memory_bound_bytes``); the earlier
  ``elements`` curve folds them into its fixed cost.
- The head keeps the final LayerNorm's input and output and the fp32 softmax of the logits
  (Megatron's vocab-parallel cross-entropy runs in fp32): ``2bshe + 4bsV/t``; while it runs it also
  holds the fp16 logits and their fp32 copy (``(e + 4) bsV/t`` transient).
- Llama-family options (``g`` query groups, SwiGLU, no biases, RMSNorm, untied output layer): QKV
  has ``(a + 2g) h/a`` outputs instead of ``3h`` (FLOPs, parameters; K and V keep ``2gh/a`` instead of
  ``2h``), SwiGLU's gate and up make three MLP GEMMs and keep four ``bsf`` tensors instead of two,
  RoPE adds no parameters or stash beyond tables, an untied output layer is a second vocab matrix
  (``tied_params`` 0).
- Sequence parallelism (``--sequence-parallel``, Korthikanti et al.): the replicated part is sharded
  too, so a layer keeps its whole stash over ``t``; layer inputs and outputs (what the pipeline sends)
  and the head's norm tensors are ``bshe / t``. Its all-gathers and reduce-scatters move the bytes the
  all-reduces did, so the ``tp_allreduce_*`` terms stay.
- Tensor parallelism all-reduces ``bshe`` twice per layer forward and twice backward, once in the
  embedding forward and once in the head backward. These are *not* in ``forward_s``/``backward_s``:
  the cost model times them on the links they use.

Profile JSON (``--profile FILE``), one entry per (tensor-parallel size, microbatch size) measured::

    {
      "format": "megatron_2bw-profile-v1",
      "source": "who measured what, where",
      "entries": [
        {"tensor_parallel": 1, "micro_batch_size": 4,
         "tied_params": 115909632,          # word-embedding params per GPU shared by embedding and head
         "layer":     {"forward_s": 0.0052, "backward_s": 0.0104, "params": 63713280,
                       "stash_bytes": 328204288, "input_bytes": 9437184, "output_bytes": 9437184,
                       "workspace_bytes": 328204288,
                       "tp_allreduce_forward_bytes": 0, "tp_allreduce_backward_bytes": 0},
         "embedding": {...same keys...},
         "head":      {...same keys...}}
      ]
    }

Per block: ``forward_s``/``backward_s`` are seconds for one microbatch on one GPU (a profiler at
``t > 1`` measures them including the tensor-parallel all-reduces and writes
``tp_allreduce_*_bytes = 0``); optional ``backward_weight_s`` (the weight-gradient GEMMs inside
``backward_s``, what a split backward's W runs; absent: half the backward) and
``weight_grad_stash_bytes`` (the gradients a split backward's input-gradient pass catches at the weight
GEMMs and norms for W; absent: the whole stash again) and ``weight_grad_input_bytes`` (what W reads of
the stash, kept after I frees the rest: the weight GEMMs' and norms' inputs; absent: the whole stash); ``params`` are parameters held by one GPU; ``stash_bytes`` what the
forward keeps for the backward, including the block's input; ``input_bytes``/``output_bytes`` the
tensors crossing its boundaries; ``workspace_bytes`` the extra peak while it runs. The search only
considers the (t, b) pairs a profile has.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..config import ModelConfig
from ..config.arith import (  # noqa: F401 - re-exported: the planner's counts are the one arithmetic
    _llama_terms, core_forward_flops, embedding_params, head_forward_flops, head_params, layer_forward_flops, layer_params,
    linear_forward_flops, tied_params, word_params,
)
from ..errors import ConfigError
from .hardware import Cluster

PROFILE_FORMAT = "megatron_2bw-profile-v1"
ACTIVATION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
TOKEN_ID_BYTES = 8          # int64 token ids: the first stage's input
SOFTMAX_BYTES = 4           # the cross-entropy keeps its softmax in fp32
# Memory traffic of the fp32 cross-entropy per logit (cast, max, subtract, exp, sum, divide; then
# the backward's in-place gradient and its cast back): about a dozen passes over 2-4 byte elements.
CE_FORWARD_BYTES = 30
CE_BACKWARD_BYTES = 14
# The embedding is a gather and an add: read the rows, read the positions, write the sum, dropout.
EMBEDDING_PASSES = 4
# Memory-bound passes of one layer forward over b*s*h elements (two LayerNorms: read + write each;
# two fused bias-dropout-adds: two reads, a write and a 1-byte mask each) and over the a*b*s^2
# attention scores without a fused attention kernel (fused scale-mask-softmax: read + write;
# dropout: read, write and a mask). Counted only with an efficiency curve in ``macs``, whose GEMM
# curve leaves them out (see efficiency.py).
HIDDEN_PASSES = 11
SCORE_PASSES = 4.5


def activation_bytes(precision: str) -> int:
    """Bytes per activation element for a training precision."""
    if precision not in ACTIVATION_BYTES:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(ACTIVATION_BYTES)}")
    return ACTIVATION_BYTES[precision]


@dataclass(frozen=True)
class BlockCost:
    """One block (a transformer layer, the embedding or the head) for one microbatch on one GPU."""

    forward_s: float
    backward_s: float
    params: int
    stash_bytes: int
    input_bytes: int
    output_bytes: int
    workspace_bytes: int = 0
    tp_allreduce_forward_bytes: int = 0
    tp_allreduce_backward_bytes: int = 0
    # the attention core (QK^T, softmax, dropout, times V) inside ``forward_s``/``stash_bytes``:
    # what selective recomputation re-runs and frees (0: unknown, e.g. a profile without it)
    core_forward_s: float = 0.0
    core_stash_bytes: int = 0
    # the weight-gradient GEMMs inside ``backward_s`` (what a split backward's W runs; the rest of the
    # backward, input-gradient GEMMs and every elementwise and attention kernel, is its I), and the
    # output gradients I catches at the weight GEMMs and norms for a deferred W (0: unknown, see
    # ``weight_grad_s`` / ``deferred_bytes``)
    backward_weight_s: float = 0.0
    weight_grad_stash_bytes: int = 0
    # what W reads of the stash, all a deferred microbatch keeps of it once I has freed the rest
    # (``pipeline/saved_release.py``; 0: unknown, the whole stash)
    weight_grad_input_bytes: int = 0

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if value < 0:
                raise ConfigError(f"block cost {key} must be >= 0, got {value}")

    @property
    def weight_grad_s(self) -> float:
        """Seconds of the weight-gradient half of the backward; a profile that does not state it gets half
        the backward (a linear layer's input- and weight-gradient GEMMs have the same FLOPs)."""
        return min(self.backward_weight_s, self.backward_s) if self.backward_weight_s else self.backward_s / 2

    @property
    def input_grad_s(self) -> float:
        """Seconds of the input-gradient half: the rest of the backward."""
        return self.backward_s - self.weight_grad_s

    @property
    def deferred_bytes(self) -> int:
        """The gradients a microbatch's I catches for its deferred W (kept until W, on top of whatever it
        keeps of its stash); a profile that does not state them gets the whole stash."""
        return self.weight_grad_stash_bytes or self.stash_bytes

    @property
    def weight_read_bytes(self) -> int:
        """What a deferred W reads of the stash (the rest is freed at I); unstated: the whole stash."""
        return self.weight_grad_input_bytes or self.stash_bytes


@dataclass(frozen=True)
class MicrobatchCosts:
    """The three block kinds at one (tensor-parallel size, microbatch size).

    ``tied_params``: word-embedding parameters (per GPU) that the embedding and the head share.
    With one stage they are one tensor; with several, the last stage holds a copy (counted in
    ``head.params``) whose gradient is all-reduced with the first stage's every step.
    """

    layer: BlockCost
    embedding: BlockCost
    head: BlockCost
    tied_params: int = 0


@dataclass(frozen=True)
class LayerCosts:
    """Costs per (t, b). ``source`` says where they came from, for the output.

    ``sequence_parallel``: the setting ``table`` was counted or measured with (the model's). ``sp_table``:
    where the search tries sequence parallelism as an axis, the same (t > 1, b) with it on (``table``
    then holds them with it off); empty otherwise. ``cp_table``: a rank's costs under context parallelism
    per ``(c, cp_comm_type, t, b, sequence_parallel)`` (``context_costs.context_table``; analytic only).
    """

    source: str
    table: Mapping[tuple[int, int], MicrobatchCosts]
    sequence_parallel: bool = False
    sp_table: Mapping[tuple[int, int], MicrobatchCosts] = field(default_factory=dict)
    cp_table: Mapping[tuple, MicrobatchCosts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.table:
            raise ConfigError(f"layer costs from {self.source} have no entries")

    def at(self, tensor_parallel: int, micro_batch_size: int, sequence_parallel: bool | None = None,
           context: tuple[int, str] | None = None) -> MicrobatchCosts | None:
        """The costs at (t, b); with ``sequence_parallel`` given, those of that setting (None where unknown).
        At t = 1 sequence parallelism changes nothing, so both settings read ``table``. ``context``: (c, comm)."""
        key = (tensor_parallel, micro_batch_size)
        if context is not None:
            sp = bool(sequence_parallel if sequence_parallel is not None else self.sequence_parallel)
            return self.cp_table.get((*context, *key, sp and tensor_parallel > 1))
        if sequence_parallel is None or tensor_parallel == 1 or sequence_parallel == self.sequence_parallel:
            return self.table.get(key)
        return self.sp_table.get(key) if sequence_parallel else None

    def tensor_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({t for t, _ in self.table}))

    def micro_batch_sizes(self, tensor_parallel: int) -> tuple[int, ...]:
        return tuple(sorted(b for t, b in self.table if t == tensor_parallel))

    def to_json(self) -> dict[str, Any]:
        """The profile schema of this module's docstring (what ``load_profile`` reads back)."""
        entries = []
        for (t, b), c in sorted(self.table.items()):
            entries.append({"tensor_parallel": t, "micro_batch_size": b, "tied_params": c.tied_params,
                            "layer": asdict(c.layer), "embedding": asdict(c.embedding), "head": asdict(c.head)})
        return {"format": PROFILE_FORMAT, "source": self.source, "entries": entries}


# ---- counting: parameters and FLOPs are config/arith.py's; bytes ---------------------------------

# What the attention core keeps, by kernel (``attention_kernel``): ``fused`` (flash / memory-efficient:
# a log-sum-exp per row), ``unfused`` (Megatron's softmax and dropout: the s^2 probabilities, mask and
# dropped probabilities), ``math`` (torch's SDPA fallback on the CPU, in fp32: three fp32 s^2 tensors).
ATTENTION_KERNELS = ("fused", "unfused", "math")
MATH_BYTES = 4  # torch's CPU math path computes the scores, softmax and dropout in fp32


def attention_kernel(cluster: Cluster, model: ModelConfig) -> str:
    """The core the engine runs for the cluster's ``attention_backend`` (``models/attention_core.py``):
    flash/fused -> ``fused``; unfused/local -> ``unfused``; auto -> what scaled_dot_product_attention picks:
    on the CPU its flash kernel without attention dropout and its math path with it, on a GPU its fused
    kernels where the cluster says it has them (``flash_attention``), else the paper-era unfused core."""
    backend = cluster.attention_backend
    if backend in ("flash", "fused"):
        return "fused"
    if backend in ("unfused", "local"):
        return "unfused"
    if cluster.is_cpu:
        return "math" if model.attention_dropout > 0 else "fused"
    return "fused" if cluster.flash_attention else "unfused"


def dropout_mask_bytes(cluster: Cluster, e: int) -> int:
    """Bytes per element of a dropout mask kept for backward: CUDA's fused dropout keeps a bool mask;
    torch's CPU dropout keeps its scaled noise in the activations' dtype."""
    return e if cluster.is_cpu else 1


def core_stash_bytes(model: ModelConfig, b: int, t: int, e: int, flash: bool = False, kernel: str | None = None,
                     mask_bytes: int = 1) -> int:
    """What the attention core keeps beyond Q, K, V, split by ``t`` (``kernel`` None: ``fused`` with ``flash``,
    else ``unfused``). ``unfused``: the softmax output and, with attention dropout, its mask (``mask_bytes``)
    and output: ``ab s^2 e (+ ab s^2 (mask_bytes + e))``. ``fused`` (flash or memory-efficient) keeps none of
    them, only its fp32 log-sum-exp per row: ``4abs``. ``math``: the unfused tensors in fp32 (``MATH_BYTES``
    each, the mask too), and Q, K and V promoted to fp32 with K and V repeated for every query head (they
    replace the ``e``-byte Q, K, V the layer counts: ``(4 * 3h - e(h + 2g head_dim)) bs``)."""
    s, a = model.seq_length, model.num_attention_heads
    kernel = kernel or ("fused" if flash else "unfused")
    if kernel not in ATTENTION_KERNELS:
        raise ConfigError(f"unknown attention kernel {kernel!r}; one of {', '.join(ATTENTION_KERNELS)}")
    if kernel == "fused":
        return 4 * a * b * s // t
    promoted = 0
    if kernel == "math":
        h, kv = model.hidden_size, 2 * model.query_groups * model.head_dim
        promoted = max(0, MATH_BYTES * 3 * h - e * (h + kv)) * b * s
        e = mask_bytes = max(e, MATH_BYTES)
    n = a * b * s * s * e + (a * b * s * s * (mask_bytes + e) if model.attention_dropout > 0 else 0)
    return (n + promoted) // t


def layer_stash_bytes(model: ModelConfig, b: int, t: int, e: int, flash: bool = False, kernel: str | None = None,
                      mask_bytes: int = 1) -> int:
    """Bytes one layer keeps for its backward, its input included (see the module docstring); with
    ``flash`` (a fused attention kernel; or ``kernel``, see :func:`core_stash_bytes`) the core's ``s^2``
    tensors give way to its log-sum-exp. ``mask_bytes``: per element of each dropout mask."""
    s, h, f = model.seq_length, model.hidden_size, model.ffn_hidden_size
    replicated = 4 * b * s * h * e + (2 * b * s * h * mask_bytes if model.hidden_dropout > 0 else 0)
    # Q and the projection input (2h) plus K and V (2 g head_dim: 2h without grouped-query attention);
    # the MLP keeps GeLU's input and output (2f), or SwiGLU's gate, silu(gate), up and their product (4f)
    kv = 2 * model.query_groups * model.head_dim
    split = (2 * h + kv) * b * s * e + (4 if model.swiglu else 2) * b * s * f * e
    core = core_stash_bytes(model, b, t, e, flash, kernel, mask_bytes)
    if model.sequence_parallel and t > 1:  # norms' and linears' inputs and dropout masks sharded too
        return (replicated + split) // t + core
    return replicated + split // t + core


def weight_grad_stash_bytes(model: ModelConfig, b: int, t: int, e: int) -> int:
    """What one layer keeps for a deferred weight gradient beyond its stash (``split_backward``: I keeps the
    graph, whose saved tensors hold the weight GEMMs' inputs, and the gradient arriving at each parameter's
    first-use node): the output gradients of QKV (``bs (a+2g) d_head / t``), of the first MLP GEMM
    (``bs f/t``, twice with SwiGLU), of the projection and the last MLP GEMM (``bsh`` each, replicated: the
    gradient of a row-parallel GEMM's partial sum is the whole one, sequence parallelism gathers it), and
    of the two norms (``bsh``, a sequence shard under sequence parallelism). A bias joins its GEMM's
    gradient (the same tensor). ``tests/test_planner_schedules.py`` checks this against what the engine
    keeps."""
    s, h = model.seq_length, model.hidden_size
    qkv, mlp_in, _, _ = _llama_terms(model)
    norms = 2 * h // t if model.sequence_parallel and t > 1 else 2 * h
    return (2 * h + norms + (qkv + mlp_in) // t) * b * s * e


def weight_grad_input_bytes(model: ModelConfig, b: int, t: int, e: int) -> int:
    """What one layer's W reads of its stash (all it keeps once I has freed the rest,
    ``pipeline/saved_release.py``): the two norms' inputs (``bsh``) and, with LayerNorm, their fp32 mean
    and reciprocal deviation (``bs`` each); the inputs of QKV and the first MLP GEMM (the norms' outputs,
    ``bsh``), of the projection (``bsh/t``) and of the last MLP GEMM (``bsf/t``; SwiGLU's two first GEMMs
    share their input). Sequence parallelism shards the norms' and the column GEMMs' inputs.
    ``tests/test_saved_release.py`` checks this against what the engine keeps."""
    s, h, f = model.seq_length, model.hidden_size, model.ffn_hidden_size
    sp = model.sequence_parallel and t > 1
    replicated = 4 * h // t if sp else 4 * h
    stats = 2 * 2 * b * s * 4 if model.normalization == "LayerNorm" else 0
    return (replicated + (h + f) // t) * b * s * e + stats


def layer_memory_bound_bytes(model: ModelConfig, b: int, t: int, e: int, flash: bool = False) -> tuple[float, float]:
    """``(layer, attention core)`` bytes the memory-bound kernels of one layer's forward move on one
    GPU (Megatron's fused kernels): ``HIDDEN_PASSES`` over ``bsh`` (LayerNorms, bias-dropout-adds),
    two over ``bsf/t`` (bias-GeLU) and, without a fused attention kernel, ``SCORE_PASSES`` over the
    ``abs^2/t`` attention scores (scale-mask-softmax, dropout). The core's share is its part."""
    s, h, f, a = model.seq_length, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    core = 0.0 if flash else SCORE_PASSES * a * b * s * s * e / t
    return e * (HIDDEN_PASSES * b * s * h + 2 * b * s * f / t) + core, core


# ---- the analytic estimate ----------------------------------------------------------------------

def _head_cost(model: ModelConfig, cluster: Cluster, b: int, t: int, e: int, speed: float, shard: int) -> BlockCost:
    """The last stage's head: final norm, logits and the vocab-parallel cross-entropy (BERT: its LM head)."""
    s, h = model.seq_length, model.hidden_size
    hidden, vocab = b * s * h * e, model.padded_vocab_size(t) // t
    logits = b * s * vocab
    head_fwd = head_forward_flops(model, b, t) / speed
    bert_extra = 3 * hidden if model.kind == "bert" else 0
    return BlockCost(
        forward_s=head_fwd + CE_FORWARD_BYTES * logits / cluster.memory_bandwidth,
        backward_s=2 * head_fwd + CE_BACKWARD_BYTES * logits / cluster.memory_bandwidth,
        backward_weight_s=head_fwd,  # the output layer's weight gradient: one logit-sized GEMM
        # the final norm's and the logits' gradients; BERT's LM-head transform adds its GEMM's and norm's
        # output gradients and the pooler's and binary head's ([b, h] and [b, 2])
        weight_grad_stash_bytes=shard + e * logits + (2 * hidden + e * b * (h + 2) if model.kind == "bert" else 0),
        # W reads the final norm's input and statistics and the output layer's input (the norm's output);
        # BERT's LM-head transform adds its GEMM's input and its norm's, and the binary head's input (the
        # pooler's is a view of hidden states already counted)
        weight_grad_input_bytes=(2 * shard + (2 * b * s * 4 if model.normalization == "LayerNorm" else 0)
                                 + (2 * hidden + 2 * b * s * 4 + e * b * h if model.kind == "bert" else 0)),
        params=head_params(model, t), stash_bytes=2 * shard + SOFTMAX_BYTES * logits + bert_extra,
        input_bytes=shard, output_bytes=0, workspace_bytes=(e + 4) * logits,
        tp_allreduce_forward_bytes=3 * b * s * 4 if t > 1 else 0,  # max, sum, target logit (fp32)
        tp_allreduce_backward_bytes=hidden if t > 1 else 0,
    )


def analytic_microbatch_costs(model: ModelConfig, cluster: Cluster, precision: str, t: int, b: int) -> MicrobatchCosts:
    """Costs of one microbatch of ``b`` on one GPU of a ``t``-way tensor group, from FLOPs and bytes."""
    e = activation_bytes(precision)
    s, h = model.seq_length, model.hidden_size
    speed = cluster.peak(precision) * cluster.efficiency.layer_fraction(b, s, h, t)
    hidden = b * s * h * e  # one hidden-state tensor
    kernel, mask = attention_kernel(cluster, model), dropout_mask_bytes(cluster, e)
    flash = kernel == "fused"
    # what crosses stage boundaries and sits between layers: a sequence shard under sequence parallelism
    shard = hidden // t if model.sequence_parallel and t > 1 else hidden

    # The "macs" curve prices the GEMMs; the memory-bound kernels between them are timed on HBM.
    mem_layer, mem_core = (layer_memory_bound_bytes(model, b, t, e, flash) if cluster.efficiency.unit == "macs"
                           else (0.0, 0.0))
    layer_fwd = layer_forward_flops(model, b, t) / speed + mem_layer / cluster.memory_bandwidth
    stash = layer_stash_bytes(model, b, t, e, kernel=kernel, mask_bytes=mask)
    layer = BlockCost(
        # the weight-gradient GEMMs: as many FLOPs as the weight GEMMs of the forward (memory-bound kernels
        # and the attention core's backward belong to the input gradient)
        backward_weight_s=linear_forward_flops(model, b, t) / speed,
        weight_grad_stash_bytes=weight_grad_stash_bytes(model, b, t, e),
        weight_grad_input_bytes=weight_grad_input_bytes(model, b, t, e),
        core_forward_s=core_forward_flops(model, b, t) / speed + mem_core / cluster.memory_bandwidth,
        core_stash_bytes=core_stash_bytes(model, b, t, e, kernel=kernel, mask_bytes=mask),
        forward_s=layer_fwd, backward_s=2 * layer_fwd, params=layer_params(model, t),
        stash_bytes=stash, input_bytes=shard, output_bytes=shard,
        # The gradients of a layer's activations exist while its backward runs: about its stash again.
        workspace_bytes=stash,
        tp_allreduce_forward_bytes=2 * hidden if t > 1 else 0,
        tp_allreduce_backward_bytes=2 * hidden if t > 1 else 0,
    )

    emb_time = EMBEDDING_PASSES * hidden / cluster.memory_bandwidth
    embedding = BlockCost(
        # the embedding's backward is all weight gradient (a scatter-add into the table): nothing upstream
        forward_s=emb_time, backward_s=emb_time, backward_weight_s=emb_time, params=embedding_params(model, t),
        # the first stage's input-gradient pass does nothing (nothing upstream): its deferred W keeps the
        # gradient it received for its output, the size of what it sent (``memory_model._deferred_bytes``)
        weight_grad_stash_bytes=shard,
        weight_grad_input_bytes=b * s * TOKEN_ID_BYTES,  # the token ids the table's gradient scatters by
        stash_bytes=(b * s * h * mask * shard // hidden if model.hidden_dropout > 0 else 0),
        input_bytes=b * s * TOKEN_ID_BYTES, output_bytes=shard,
        tp_allreduce_forward_bytes=hidden if t > 1 else 0,
    )

    head = _head_cost(model, cluster, b, t, e, speed, shard)
    return MicrobatchCosts(layer, embedding, head, tied_params=tied_params(model, t))


def analytic_layer_costs(model: ModelConfig, cluster: Cluster, precision: str,
                         tensor_sizes: Iterable[int], micro_batch_sizes: Iterable[int],
                         search_sequence_parallel: bool = False) -> LayerCosts:
    """The analytic estimate on a (t, b) grid; ``search_sequence_parallel``: both settings (``table`` off,
    ``sp_table`` on at t > 1) for a search that tries sequence parallelism as an axis."""
    sizes, tensor_sizes = tuple(micro_batch_sizes), tuple(tensor_sizes)
    sp_table: dict[tuple[int, int], MicrobatchCosts] = {}
    if search_sequence_parallel and model.kind == "gpt":  # sequence parallelism is GPT's only
        on = replace(model, sequence_parallel=True)
        sp_table = {(t, b): analytic_microbatch_costs(on, cluster, precision, t, b)
                    for t in tensor_sizes if t > 1 and model.seq_length % t == 0 for b in sizes}
        model = replace(model, sequence_parallel=False)
    table = {(t, b): analytic_microbatch_costs(model, cluster, precision, t, b) for t in tensor_sizes for b in sizes}
    eff = cluster.efficiency
    source = (f"analytic estimate from FLOPs and bytes ({cluster.device}, {precision} peak "
              f"{cluster.peak(precision) / 1e12:g} TFLOP/s x efficiency curve max {eff.max_fraction:g}, "
              f"half at {eff.half_work:g} {eff.unit}); no profile")
    return LayerCosts(source, table, model.sequence_parallel, sp_table)


# ---- profiles -----------------------------------------------------------------------------------

def _block(data: Any, where: str) -> BlockCost:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected an object")
    required = ("forward_s", "backward_s", "params", "stash_bytes", "input_bytes", "output_bytes")
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    unknown = set(data) - set(BlockCost.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    try:
        return BlockCost(**{k: (float(v) if k.endswith("_s") else int(v)) for k, v in data.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def layer_costs_from_json(data: Any, source: str) -> LayerCosts:
    """Parse the profile schema (the module docstring); every problem is a one-line ``ConfigError``."""
    if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"profile {source}: expected a JSON object with \"format\": \"{PROFILE_FORMAT}\"")
    entries = data.get("entries")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"profile {source}: 'entries' must be a non-empty list")
    table: dict[tuple[int, int], MicrobatchCosts] = {}
    for i, entry in enumerate(entries):
        where = f"profile {source} entry {i}"
        try:
            t, b = int(entry["tensor_parallel"]), int(entry["micro_batch_size"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}: needs integer tensor_parallel and micro_batch_size") from None
        if t < 1 or b < 1:
            raise ConfigError(f"{where}: tensor_parallel and micro_batch_size must be >= 1")
        if (t, b) in table:
            raise ConfigError(f"{where}: duplicate (tensor_parallel={t}, micro_batch_size={b})")
        table[(t, b)] = MicrobatchCosts(
            _block(entry.get("layer"), f"{where} layer"), _block(entry.get("embedding"), f"{where} embedding"),
            _block(entry.get("head"), f"{where} head"), tied_params=int(entry.get("tied_params", 0)),
        )
    label = data.get("source") or "unnamed"
    return LayerCosts(f"profile {source} ({label})", table)


def read_profile_json(path: str | Path) -> dict:
    """The JSON of a ``--profile FILE``; a missing or unreadable file is a one-line ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--profile file {str(path)!r} does not exist")
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--profile {str(path)!r} is not readable JSON: {exc}".replace("\n", " ")) from None


def load_profile(path: str) -> LayerCosts:
    """Read a ``--profile FILE``."""
    return layer_costs_from_json(read_profile_json(path), path)
