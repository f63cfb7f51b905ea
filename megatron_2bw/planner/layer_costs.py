"""What one microbatch costs in each kind of block: time, parameters, activation bytes.

The planner's only view of the model. The model is ``num_layers`` identical transformer layers,
with the embedding on the first stage and the head (final LayerNorm, output layer, loss) on the
last. Costs come from one of two places, in the same ``LayerCosts`` table:

- ``analytic_layer_costs``: FLOPs and bytes counted from the model shape, timed with the device's
  peak FLOP/s times the efficiency curve of ``efficiency.py``. Stated as an estimate in the output.
- ``load_profile``: a JSON file a profiler wrote from measurements (its schema and reader: ``cost_table.py``).

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

The table these fill and the profile schema are ``cost_table.py``; the per-block terms (parameters, GEMMs,
stash) are the blocks' own (``config/blocks.py``), the family's head beyond its norm and output layer its
own (``config/families.py``); this module composes them into a layer, an embedding and a head.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from ..config import ModelConfig, attention_choice, blocks
from ..config.arith import (  # noqa: F401 - re-exported: the planner's counts are the one arithmetic
    core_forward_flops,
    embedding_params,
    head_forward_flops,
    head_params,
    layer_forward_flops,
    layer_params,
    linear_forward_flops,
    tied_params,
    word_params,
)
from ..config.blocks import ATTENTION_KERNELS, MATH_BYTES  # noqa: F401 - re-exported
from ..errors import ConfigError
from .cost_table import (  # noqa: F401 - re-exported: the table's home before the split
    PROFILE_FORMAT,
    BlockCost,
    LayerCosts,
    MicrobatchCosts,
    layer_costs_from_json,
    load_profile,
    read_profile_json,
)
from .hardware import Cluster
from .moe_costs import with_experts

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


# ---- counting: parameters and FLOPs are config/arith.py's, the blocks' stash terms config/blocks.py's --------

def attention_kernel(cluster: Cluster, model: ModelConfig, masked: bool = False) -> str:
    """The core the engine runs for the cluster's ``attention_backend`` (``models/attention_core.py``):
    flash/fused -> ``fused``; unfused/local -> ``unfused``; auto -> what scaled_dot_product_attention picks:
    on the CPU its flash kernel without attention dropout and its math path with it, on a GPU its fused
    kernels where the cluster says it has them (``flash_attention``), else the paper-era unfused core; with
    grouped-query heads and a ``masked`` attention (documents or a padding mask at c = 1) its math path
    (``config/attention_choice.py``, the choice the trainer logs at start-up)."""
    return attention_choice.attention_kernel_choice(cluster.attention_backend, cluster.is_cpu,
                                                    attention_choice.grouped(model), masked,
                                                    model.attention_dropout > 0, cluster.flash_attention)[0]


def attention_masked(cluster: Cluster, model: ModelConfig) -> bool:
    """Whether the attention of a c = 1 rank takes a mask tensor: documents (``Cluster.reset_attention_mask``,
    the run's ``--reset-attention-mask``) or the family's padding mask (BERT)."""
    return attention_choice.takes_mask(model, cluster.reset_attention_mask)


def dropout_mask_bytes(cluster: Cluster, e: int) -> int:
    """Bytes per element of a dropout mask kept for backward: CUDA's fused dropout keeps a bool mask;
    torch's CPU dropout keeps its scaled noise in the activations' dtype."""
    return e if cluster.is_cpu else 1


def core_stash_bytes(model: ModelConfig, b: int, t: int, e: int, flash: bool = False, kernel: str | None = None,
                     mask_bytes: int = 1) -> int:
    """What the attention core keeps beyond Q, K, V, split by ``t`` (``kernel`` None: ``fused`` with ``flash``,
    else ``unfused``): the attention block's ``core_stash_bytes`` (``config/blocks.py``)."""
    kernel = kernel or ("fused" if flash else "unfused")
    return blocks.SELF_ATTENTION.core_stash_bytes(model, b, t, e, kernel, mask_bytes)


def _sharded(model: ModelConfig, t: int) -> bool:
    return model.sequence_parallel and t > 1


def layer_stash_bytes(model: ModelConfig, b: int, t: int, e: int, flash: bool = False, kernel: str | None = None,
                      mask_bytes: int = 1) -> int:
    """Bytes one layer keeps for its backward, its input included (see the module docstring): its blocks'
    stash (``blocks.layer_terms``: the norms' and GEMMs' inputs, Q, K, V, the MLP's activations) and the
    two hidden-dropout masks (``mask_bytes`` per element); with ``flash`` (a fused attention kernel; or
    ``kernel``, see :func:`core_stash_bytes`) the core's ``s^2`` tensors give way to its log-sum-exp."""
    s, h = model.seq_length, model.hidden_size
    terms = blocks.layer_terms(model, "stash")
    replicated = terms.seq * b * s * e + (2 * b * s * h * mask_bytes if model.hidden_dropout > 0 else 0)
    split = terms.split * b * s * e
    core = core_stash_bytes(model, b, t, e, flash, kernel, mask_bytes)
    if _sharded(model, t):  # norms' and linears' inputs and dropout masks sharded too
        return (replicated + split) // t + core
    return replicated + split // t + core


def weight_grad_stash_bytes(model: ModelConfig, b: int, t: int, e: int) -> int:
    """What one layer keeps for a deferred weight gradient beyond its stash (``split_backward``: I keeps the
    graph, whose saved tensors hold the weight GEMMs' inputs, and the gradient arriving at each parameter's
    first-use node), its blocks' ``wgrad_stash``: the output gradients of QKV (``bs (a+2g) d_head / t``), of
    the first MLP GEMM (``bs f/t``, twice with SwiGLU), of the projection and the last MLP GEMM (``bsh`` each,
    replicated: the gradient of a row-parallel GEMM's partial sum is the whole one, sequence parallelism
    gathers it), and of the two norms (``bsh``, a sequence shard under sequence parallelism). A bias joins
    its GEMM's gradient (the same tensor). ``tests/test_planner_schedules.py`` checks this against what the
    engine keeps."""
    terms = blocks.layer_terms(model, "wgrad_stash")
    seq = terms.seq // t if _sharded(model, t) else terms.seq
    return (terms.full + seq + terms.split // t) * b * model.seq_length * e


def weight_grad_input_bytes(model: ModelConfig, b: int, t: int, e: int) -> int:
    """What one layer's W reads of its stash (all it keeps once I has freed the rest,
    ``pipeline/saved_release.py``), its blocks' ``wgrad_input``: the two norms' inputs (``bsh``) and, with
    LayerNorm, their fp32 mean and reciprocal deviation (``bs`` each); the inputs of QKV and the first MLP
    GEMM (the norms' outputs, ``bsh``), of the projection (``bsh/t``) and of the last MLP GEMM (``bsf/t``;
    SwiGLU's two first GEMMs share their input). Sequence parallelism shards the norms' and the column
    GEMMs' inputs. ``tests/test_saved_release.py`` checks this against what the engine keeps."""
    terms, s = blocks.layer_terms(model, "wgrad_input"), model.seq_length
    seq = terms.seq // t if _sharded(model, t) else terms.seq
    return (seq + terms.split // t) * b * s * e + blocks.layer_stats_bytes(model) * b * s


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
    """The last stage's head: final norm, logits and the vocab-parallel cross-entropy, and the family's head
    beyond them (BERT's LM transform, pooler and binary head: ``config/families.py``)."""
    s = model.seq_length
    logits = b * s * (model.padded_vocab_size(t) // t)
    head_fwd = head_forward_flops(model, b, t) / speed
    extra, hidden = model.family.head, b * s * model.hidden_size * e
    return BlockCost(
        forward_s=head_fwd + CE_FORWARD_BYTES * logits / cluster.memory_bandwidth,
        backward_s=2 * head_fwd + CE_BACKWARD_BYTES * logits / cluster.memory_bandwidth,
        backward_weight_s=head_fwd,  # the output layer's weight gradient: one logit-sized GEMM
        # the final norm's and the logits' gradients, and the family head's
        weight_grad_stash_bytes=shard + e * logits + extra.extra_wgrad_stash_bytes(model, b, e),
        # W reads the final norm's input and statistics and the output layer's input (the norm's output)
        weight_grad_input_bytes=(2 * shard + blocks.NORM.stats_bytes(model) * b * s
                                 + extra.extra_wgrad_input_bytes(model, b, e)),
        params=head_params(model, t),
        stash_bytes=2 * shard + SOFTMAX_BYTES * logits + extra.extra_stash_bytes(model, b, e),
        input_bytes=shard, output_bytes=0, workspace_bytes=(e + 4) * logits,
        tp_allreduce_forward_bytes=3 * b * s * 4 if t > 1 else 0,  # max, sum, target logit (fp32)
        tp_allreduce_backward_bytes=hidden if t > 1 else 0,
    )


def analytic_microbatch_costs(model: ModelConfig, cluster: Cluster, precision: str, t: int, b: int,
                              masked: bool | None = None) -> MicrobatchCosts:
    """Costs of one microbatch of ``b`` on one GPU of a ``t``-way tensor group, from FLOPs and bytes; ``masked``:
    whether the attention takes a mask tensor (None: :func:`attention_masked`)."""
    e = activation_bytes(precision)
    s, h = model.seq_length, model.hidden_size
    speed = cluster.peak(precision) * cluster.efficiency.layer_fraction(b, s, h, t)
    hidden = b * s * h * e  # one hidden-state tensor
    masked = attention_masked(cluster, model) if masked is None else masked
    kernel, mask = attention_kernel(cluster, model, masked), dropout_mask_bytes(cluster, e)
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
    costs = MicrobatchCosts(layer, embedding, head, tied_params=tied_params(model, t))
    # a model with experts: the MoE layers' MLP replaced (planner/moe_costs.py), at expert-parallel size 1
    return costs if model.moe is None else with_experts(costs, model, cluster, precision, e, t, b)


def analytic_layer_costs(model: ModelConfig, cluster: Cluster, precision: str,
                         tensor_sizes: Iterable[int], micro_batch_sizes: Iterable[int],
                         search_sequence_parallel: bool = False) -> LayerCosts:
    """The analytic estimate on a (t, b) grid; ``search_sequence_parallel``: both settings (``table`` off,
    ``sp_table`` on at t > 1) for a search that tries sequence parallelism as an axis."""
    sizes, tensor_sizes = tuple(micro_batch_sizes), tuple(tensor_sizes)
    sp_table: dict[tuple[int, int], MicrobatchCosts] = {}
    if search_sequence_parallel and model.family.gpt_options:  # sequence parallelism is GPT's only
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
