"""What one microbatch costs on a rank of a context-parallel group (``--context-parallel-size c``).

The engine (``context_parallel/``) cuts each sequence into ``2c`` chunks of ``n = s / 2c`` tokens, two per
rank, so every per-token tensor of a layer, the embedding and the head is ``s / c`` long: those terms are
the analytic estimate's (``layer_costs.analytic_microbatch_costs``) for a sequence of ``s / c``. Attention
differs, by ``--cp-comm-type``, in what its core keeps (counted tensor by tensor against the engine's
saved-tensor accounting, ``benchmarks/memory.py --context-parallel-size``; per GPU, heads and groups over t):

- ``p2p`` (the ring, ``context_parallel/ring.py``): its own autograd function keeps what a fused kernel
  keeps: this rank's Q, K and V (views of the layer's QKV output; with grouped heads Q is a regrouped copy,
  ``2n ab d e``), the output (``2n ab d e``) and one fp32 log-sum-exp per query row (``4 ab 2n``); the
  blocks' scores are recomputed in backward, where the keys and values go round the ring again.
- ``all_gather``: the keys and values of the whole sequence (``2 s bg d e``, the gather's output, which the
  core's inputs are views of) and, per local chunk, the ordinary core against the key prefix up to the
  chunk's end: the fused kernels keep their log-sum-exp and, causal, where the prefix is given as a mask
  (grouped heads; torch's CPU kernels materialize even the bottom-right causal bias) the mask ``[n, prefix]``
  in the activations' dtype (``(2c + 1) n^2`` elements over the fullest rank's two chunks); torch's CPU flash
  kernel also its output; the unfused core its ``a b`` score-sized tensors over those query x key elements
  and the bool mask.
- With grouped heads (and in the unfused core at ``all_gather``) the core's Q is a copy and K and V are the
  gathered or stacked ones, so the layer's QKV output is not kept: its ``K, V`` term leaves the count
  (:func:`keeps_layer_qkv`).

Time: the weight GEMMs and memory-bound passes at ``s / c`` tokens; the core's work is ``1/c`` of the whole
sequence's (``all_gather``, the fused kernels at the precision's speed) or the ring's blocks in fp32
(``B n^2`` query x key elements per head at the fp32 peak, run twice: backward recomputes them).
Communication, per layer, over the context group's link (``t * c`` ranks: NVLink when they fit a server,
else the server's NIC shared by all its GPUs): ``p2p`` sends a rank's K and V ``c - 1`` hops forward,
overlapped with the blocks' compute (only what the compute does not cover is added), and their gradients the
same hops back in backward, exposed (the ring's backward waits on each hop); ``all_gather`` gathers K and V
forward and reduce-scatters their gradients backward, ``c - 1`` rank shares each way on a ring, exposed.
The weights do not shrink with c: the c ranks are replicas (``Candidate.replicas``).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Iterable

from ..config import ModelConfig, attention_choice, blocks
from ..config.arith import core_forward_flops
from ..config.context import P2P
from ..config.context import PLANNED_CP_COMM_TYPES as PLANNED
from .hardware import Cluster
from .layer_costs import (
    SCORE_PASSES,
    BlockCost,
    LayerCosts,
    MicrobatchCosts,
    activation_bytes,
    analytic_microbatch_costs,
    attention_kernel,
    core_stash_bytes,
    dropout_mask_bytes,
)

FP32 = 4
INDEX_BYTES = 8  # the gather's int64 index into sequence order (kept by index_select, K and V)


# The search tries c only while each rank keeps at least this many tokens of a sequence (so from 8k tokens
# on: context parallelism is for long sequences): shorter shards make the K/V exchange as long as the GEMMs it
# should hide behind, and the planner's speed stays that of the search without c for short sequences.
MIN_TOKENS_PER_RANK = 4096


# the exchanges the planner prices (config/context.py's table): --cp-comm-type a2a trains but is not priced yet
PLANNED_CP_COMM_TYPES = PLANNED


def context_sizes(model: ModelConfig, num_gpus: int) -> tuple[int, ...]:
    """The context-parallel sizes the search tries: powers of two above one whose ``2c`` chunks divide the
    sequence and leave each rank ``MIN_TOKENS_PER_RANK`` tokens or more, within the GPUs."""
    out, c = [], 2
    while c <= num_gpus and model.seq_length % (2 * c) == 0 and model.seq_length // c >= MIN_TOKENS_PER_RANK:
        if num_gpus % c == 0:
            out.append(c)
        c *= 2
    return tuple(out)


def ring_written(model: ModelConfig, cluster: Cluster) -> bool:
    """Whether the ring's blocks run the written-out fp32 core (``context_parallel/blocks.block_kernel``): the
    unfused backend, the CPU with attention dropout (its flash kernel takes none), or a GPU block with documents
    (``Cluster.reset_attention_mask``: CUDA's flash op takes no mask); else a fused kernel."""
    return attention_choice.ring_written(cluster.attention_backend, cluster.is_cpu, cluster.reset_attention_mask,
                                         model.attention_dropout > 0, cluster.flash_attention) is not None


def ring_blocks(c: int, causal: bool) -> tuple[int, int]:
    """Key blocks each of the fullest rank's two query chunks sees: rank 0's early chunk only its own, its late
    chunk all ``2c`` (causal); every block of the ring without causality."""
    return (1, 2 * c) if causal else (2 * c, 2 * c)


def _per_gpu(model: ModelConfig, t: int) -> tuple[int, int, int]:
    """(query heads, key/value groups, head size) on one GPU of the tensor group."""
    return model.num_attention_heads // t, max(1, model.query_groups // t), model.head_dim


def ring_core_bytes(model: ModelConfig, b: int, t: int, c: int, e: int, causal: bool) -> int:
    """What the ``p2p`` core keeps per layer on each rank beyond the layer's own Q, K, V (module docstring):
    its output and log-sum-exp, and Q's regrouped copy with grouped heads; the same on every rank (the
    blocks' work differs, not what is kept), with or without causality."""
    a, g, hd = _per_gpu(model, t)
    rows = a * b * model.seq_length // c  # this rank's query rows, every head
    grouped = attention_choice.grouped(model)
    return rows * hd * e * (2 if grouped else 1) + FP32 * rows


RING_TILE_ROWS = 512  # context_parallel/blocks.py's TILE_ROWS: query rows per tile of a masked block


# The written-out core's fp32 score-sized tiles [b, a, TILE_ROWS, n] alive at its fullest moment (forward,
# backward), without and with dropout: counted by the live-tensor test (tests/test_context_parallel_long.py),
# e.g. the scores, their logsumexp's temporary and, with dropout, its draw and the dropped probabilities.
WRITTEN_TILES = {False: (1.125, 2.125), True: (4.0625, 4.0625)}


def ring_workspace_bytes(model: ModelConfig, b: int, t: int, c: int, e: int, tiled: bool = False,
                         written: bool = False, dropout: bool = False) -> int:
    """The ``p2p`` core's peak while it runs, beyond its inputs (Q, K, V), on one rank: the larger of its forward
    and its backward, each at its fullest moment (``context_parallel/ring.py``, ``blocks.py``; checked against a
    live-tensor count in ``tests/test_context_parallel_long.py``). ``tiled``: blocks with a mask the kernel takes
    in tiles (documents, padding): each tile's additive mask and boolean rows ``[b, TILE_ROWS, n]``, and the
    block's fp32 accumulators. ``written``: the written-out core (``--attention-backend unfused``, the CPU with
    dropout, a CUDA block with a mask): its fp32 score tiles (:data:`WRITTEN_TILES`).

    Forward: K and V stacked and the next hop's receive buffer, the two chunks' fp32 outputs being merged, one
    block's output (fp32; with a 2-byte dtype also the kernel's own) and a few log-sum-exp rows; at the end the
    fp32 output and its copy in the activations' dtype. Backward: dQ in fp32, K and V with their receive buffer,
    dK and dV in fp32, and either one block's gradients or dK and dV's receive buffer."""
    a, g, hd = _per_gpu(model, t)
    L = model.seq_length // c
    n = L // 2
    rows = min(n, RING_TILE_ROWS)
    kv, dkv = 2 * b * g * L * hd * e, 2 * b * g * L * hd * FP32
    out32, lse_n = FP32 * b * a * L * hd, FP32 * b * a * n
    half = e != FP32
    block_out = b * a * n * hd * (FP32 + (e if half else 0))
    grads = b * n * hd * (a + 2 * g) * e
    fwd_tile = 0
    if written:  # a tile's boolean rows (masked) and its fp32 score-sized tensors; the block's fp32 accumulators
        block_out, tiles = FP32 * b * a * n * hd, FP32 * b * a * rows * n
        keep = b * rows * n if tiled else 0
        fwd_tile = keep + round(WRITTEN_TILES[dropout][0] * tiles)
        grads = FP32 * b * n * hd * (a + 2 * g) + keep + round(WRITTEN_TILES[dropout][1] * tiles)
    elif tiled:  # the kernel: a tile's additive mask and boolean rows, its gradients; the block's fp32 accumulators
        block_out = FP32 * b * a * n * hd
        fwd_tile = b * rows * n * (e + 1)
        tile_grads = b * hd * (rows * a + 2 * n * g) * (e + (FP32 if half else 0))  # 2-byte: and fp32 copies
        grads = FP32 * b * n * hd * (a + 2 * g) + fwd_tile + tile_grads
    forward = max(2 * kv + out32 + block_out + fwd_tile + 4 * lse_n, kv + 2 * out32,
                  out32 + (b * a * L * hd * e if half else 0))
    backward = out32 + 2 * kv + dkv + max(dkv, grads)  # a block's gradients, or dK and dV's hop
    return max(forward, backward)


def gather_block_workspace_bytes(model: ModelConfig, b: int, t: int, c: int, e: int, written: bool = False,
                                 dropout: bool = False) -> int:
    """all_gather with documents (``context_parallel/attention.py``): each local chunk runs as one tiled block
    (``blocks.block_attention``) against its key prefix, the fullest rank's longest prefix the whole sequence
    (``nk = s``). Its peak beyond what the core keeps, the larger of forward and backward: forward the block's fp32
    output and log-sum-exp, a tile's additive mask and boolean rows ``[b, TILE_ROWS, nk]`` and its output (the
    written-out core: its fp32 score tiles, :data:`WRITTEN_TILES`); backward the output gradient's copy, dQ and,
    over the prefix, dK and dV in fp32, a tile's gradients and mask (the whole-sequence prefix is the gathered keys
    themselves: no slice's gradient buffer)."""
    a, g, hd = _per_gpu(model, t)
    s = model.seq_length
    n = s // (2 * c)
    rows = min(n, RING_TILE_ROWS)
    mask = b * rows * s * (e + 1)
    tiles = FP32 * b * a * rows * s
    fwd_tile, bwd_tile = (round(WRITTEN_TILES[dropout][0] * tiles), round(WRITTEN_TILES[dropout][1] * tiles)) \
        if written else (b * a * rows * hd * e, b * hd * (rows * a + 2 * s * g) * e)
    forward = FP32 * b * a * n * (hd + 1) + mask + fwd_tile
    backward = b * a * n * hd * (e + FP32) + 2 * FP32 * b * g * s * hd + mask + bwd_tile
    return max(forward, backward)


def gather_core_bytes(model: ModelConfig, b: int, t: int, c: int, e: int, kernel: str, mask_bytes: int,
                      causal: bool, mask_tensor: bool = True, cpu: bool = False) -> int:
    """What the ``all_gather`` core keeps per layer beyond the layer's own Q, K, V (module docstring) on the
    fullest rank; ``mask_tensor``: whether the fused kernels get a chunk's causal prefix as a tensor (the CPU,
    grouped heads) rather than torch's bottom-right causal bias, which they run without one; ``cpu``: torch's
    CPU flash kernel keeps its output ``[b, a, n, d]`` per chunk apart from the projection's input (on a GPU
    the projection's input is a view of it, which the layer counts)."""
    a, g, hd = _per_gpu(model, t)
    s = model.seq_length
    n, local = s // (2 * c), s // c
    elems = (2 * c + 1) * n * n if causal else local * s  # query x key elements per head, both chunks
    mask = (2 * c + 1) * n * n if causal else 0  # a rank's two prefixes, [n, end] each
    gathered = 2 * b * g * s * hd * e + 2 * INDEX_BYTES * s
    if kernel == "fused":
        return (gathered + FP32 * a * b * local + (mask * e if mask_tensor else 0)
                + (a * b * local * hd * e if cpu else 0))
    # the unfused (or CPU math) core's s^2 tensors over these elements, and the bool mask it keeps
    core = core_stash_bytes(model, b, t, e, kernel=kernel, mask_bytes=mask_bytes)
    return gathered + round(core * elems / (s * s)) + mask


def context_core_bytes(model: ModelConfig, cluster: Cluster, precision: str, t: int, b: int, c: int,
                       comm: str, causal: bool) -> int:
    """The core's bytes per layer at context size ``c`` by ``comm`` (the ring's include Q, K and V)."""
    e = activation_bytes(precision)
    if comm == P2P:
        return ring_core_bytes(model, b, t, c, e, causal)
    if causal and cluster.reset_attention_mask:  # documents: each chunk a tiled block, its output and lse kept
        return gather_core_bytes(model, b, t, c, e, "fused", 0, causal, mask_tensor=False, cpu=True)
    grouped = attention_choice.grouped(model)
    return gather_core_bytes(model, b, t, c, e, attention_kernel(cluster, model), dropout_mask_bytes(cluster, e),
                             causal, cluster.is_cpu or grouped, cluster.is_cpu)


def keeps_layer_qkv(model: ModelConfig, cluster: Cluster, comm: str) -> bool:
    """Whether the core keeps the layer's QKV output (Q, K and V, as the layer counts them): the ring keeps
    views of it always (with grouped heads K and V are views, Q a copy it counts). At all_gather, not with
    grouped heads (Q is a regrouped copy) nor in the unfused core (each chunk's Q, regrouped for its GEMM, is a
    copy): those keep Q's copy alone, and K and V are the gathered ones."""
    grouped = attention_choice.grouped(model)
    return comm == P2P or not grouped and attention_kernel(cluster, model) != "unfused"


def context_bandwidth(t: int, c: int, comm: str, cluster: Cluster) -> float:
    """Per-GPU bandwidth of the context group's exchange: inside a server NVLink (a ring's hops at the p2p
    rate, the all-gather at the collective's bus rate), else the server's NIC shared by all its GPUs."""
    G = cluster.devices_per_server
    if t * c <= G and G % (t * c) == 0:
        return cluster.intra_server_p2p_bandwidth if comm == P2P else cluster.intra_server_allreduce_bandwidth
    return cluster.inter_server_bandwidth / G


def _core_seconds(model: ModelConfig, cluster: Cluster, precision: str, t: int, b: int, c: int, comm: str,
                  causal: bool) -> float:
    """The core's forward on one rank: the ring's fp32 blocks, or 1/c of the whole sequence's core."""
    s, local = model.seq_length, model.seq_length // c
    eff = cluster.efficiency.layer_fraction(b, local, model.hidden_size, t)
    if comm == P2P:
        n = s // (2 * c)
        elems = sum(ring_blocks(c, causal)) * n * n
        flops = 4 * b * elems * model.hidden_size / t
        if not ring_written(model, cluster):  # the blocks on a fused kernel at the precision's speed
            return flops / (cluster.peak(precision) * eff)
        moved = SCORE_PASSES * FP32 * b * (model.num_attention_heads // t) * elems
        return flops / (cluster.peak("fp32") * eff) + moved / cluster.memory_bandwidth
    flops = core_forward_flops(model, b, t) / c
    flash = attention_kernel(cluster, model) == "fused"
    moved = 0.0 if flash else (SCORE_PASSES * b * model.num_attention_heads * s * s * activation_bytes(precision)
                               / (t * c))
    return flops / (cluster.peak(precision) * eff) + moved / cluster.memory_bandwidth


def _exchange_seconds(model: ModelConfig, cluster: Cluster, precision: str, t: int, b: int, c: int,
                      comm: str) -> float:
    """One direction of the K/V exchange of a layer: ``c - 1`` rank shares of K and V over the group's link."""
    _, g, hd = _per_gpu(model, t)
    kv = 2 * b * (model.seq_length // c) * g * hd * activation_bytes(precision)
    return (c - 1) * kv / context_bandwidth(t, c, comm, cluster)


def layer_grad_bytes(model: ModelConfig, b: int, t: int, e: int, hidden: int) -> int:
    """A layer's backward beyond what is left of its stash at its fullest: the gradients of the MLP's first GEMMs'
    outputs (``k f / t`` wide, k = 2 with SwiGLU's gate and up) less the ``hidden``-sized stash they replace, at
    least one hidden-sized gradient. Measured by a live-tensor count on one layer (GeLU with f = 2h, 4h, 8h: 1.06,
    3.06, 7.25 hidden-sized tensors; SwiGLU with f = 2h, 4h, 8h: 3.06, 7.12, 15.25), where the c = 1 estimate
    (``layer_costs``) takes a whole stash."""
    mlp = blocks.MLP_BLOCKS[model.mlp_block]
    k = len(mlp.first(model)) if hasattr(mlp, "first") else 1
    return max(b * model.seq_length * k * model.ffn_hidden_size * e // t - hidden, hidden)


def core_output_bytes(model: ModelConfig, b: int, t: int, e: int) -> int:
    """The core's output gradient ``[b, s, a d / t]``, alive while the core's backward runs."""
    return b * model.seq_length * model.hidden_size * e // t


def after_core_bytes(model: ModelConfig, b: int, t: int, e: int, mask_bytes: int) -> int:
    """What a layer keeps after its core (the second norm's and the MLP's stash, the two hidden-dropout masks of
    ``mask_bytes`` per element): not yet built while the core's forward runs, already freed when its backward
    runs (``model``: the rank's sequence)."""
    terms = blocks.NORM.stash(model) + blocks.MLP_BLOCKS[model.mlp_block].stash(model)
    seq = terms.seq * e + (2 * model.hidden_size * mask_bytes if model.hidden_dropout > 0 else 0)
    return b * model.seq_length * (seq // (t if model.sequence_parallel and t > 1 else 1) + terms.split * e // t)


def context_microbatch_costs(model: ModelConfig, cluster: Cluster, precision: str, t: int, b: int, c: int,
                             comm: str, causal: bool = True) -> MicrobatchCosts:
    """``analytic_microbatch_costs`` on a rank of a ``c``-way context group (module docstring)."""
    local = replace(model, seq_length=model.seq_length // c)
    base = analytic_microbatch_costs(local, cluster, precision, t, b, masked=False)  # documents travel as ids
    lay = base.layer
    core = context_core_bytes(model, cluster, precision, t, b, c, comm, causal)
    kv = 2 * model.query_groups * model.head_dim * b * (model.seq_length // c) * activation_bytes(precision) // t
    stash = lay.stash_bytes - lay.core_stash_bytes + core - (0 if keeps_layer_qkv(model, cluster, comm) else kv)
    core_s = _core_seconds(model, cluster, precision, t, b, c, comm, causal)
    hop = _exchange_seconds(model, cluster, precision, t, b, c, comm)
    fwd_comm = max(0.0, hop - core_s) if comm == P2P else hop
    forward = lay.forward_s - lay.core_forward_s + core_s + fwd_comm
    redo = core_s if comm == P2P else 0.0  # the ring's backward re-runs each block's forward
    backward = lay.backward_s - 2 * lay.core_forward_s + 2 * core_s + redo + hop
    e = activation_bytes(precision)
    workspace = layer_grad_bytes(local, b, t, e, lay.input_bytes)
    # a core's transient stands beside what the layer holds then: not what it keeps after its core
    after = after_core_bytes(local, b, t, e, dropout_mask_bytes(cluster, e))
    if comm == P2P:  # the ring's own peak, with the core's output gradient
        ring = ring_workspace_bytes(model, b, t, c, e, tiled=not causal or cluster.reset_attention_mask,
                                    written=ring_written(model, cluster), dropout=model.attention_dropout > 0)
        workspace = max(workspace, ring + core_output_bytes(local, b, t, e) - after)
    elif causal and cluster.reset_attention_mask:  # all_gather's tiled blocks for documents
        block = gather_block_workspace_bytes(model, b, t, c, e, written=ring_written(model, cluster),
                                             dropout=model.attention_dropout > 0)
        workspace = max(workspace, block + core_output_bytes(local, b, t, e) - after)
    elif causal and cluster.is_cpu:  # torch's CPU kernels build the prefix's boolean rows before its additive mask
        n = model.seq_length // (2 * c)
        workspace = max(workspace, 2 * c * n * n - after)
    layer = replace(lay, forward_s=forward, backward_s=backward, core_forward_s=core_s + fwd_comm,
                    core_stash_bytes=core, stash_bytes=stash, workspace_bytes=workspace)
    # the head's transient beyond its stash: the logits while the cross-entropy runs (their fp32 copy is the softmax
    # its stash counts), then their gradient in the activations' dtype
    head = replace(base.head, workspace_bytes=e * b * local.seq_length * (model.padded_vocab_size(t) // t))
    return replace(base, layer=layer, head=head)


def dominates(x: MicrobatchCosts, y: MicrobatchCosts) -> bool:
    """Whether every candidate priced with ``x`` is as fast and as small as with ``y``: the two differ only in
    the layer's attention (times, its stash, and what selective recomputation keeps and re-runs)."""
    a, b = x.layer, y.layer
    return (a.forward_s <= b.forward_s and a.backward_s <= b.backward_s and a.core_forward_s <= b.core_forward_s
            and a.stash_bytes <= b.stash_bytes
            and a.stash_bytes - a.core_stash_bytes <= b.stash_bytes - b.core_stash_bytes)


def context_table(model: ModelConfig, cluster: Cluster, precision: str, keys: Iterable[tuple[int, int, bool, int]],
                  comms: Iterable[str]) -> dict[tuple, MicrobatchCosts]:
    """``LayerCosts.cp_table``: costs per ``(c, comm, t, b, sequence_parallel)`` for every ``(t, b, sp, c)`` of
    ``keys`` where ``c`` splits the sequence (and, with sequence parallelism, its ``s / c`` over t). A
    communication type another one :func:`dominates` at the same point is left out: no plan could pick it."""
    causal, comms = model.kind != "bert", tuple(comms)
    out: dict[tuple, MicrobatchCosts] = {}
    for t, b, sp, c in keys:
        m = replace(model, sequence_parallel=sp and t > 1)
        if model.seq_length % (2 * c) or (m.sequence_parallel and (model.seq_length // c) % t):
            continue
        here = {comm: context_microbatch_costs(m, cluster, precision, t, b, c, comm, causal) for comm in comms}
        for i, comm in enumerate(comms):
            if not any(dominates(here[o], here[comm]) and (here[comm] != here[o] or j < i)
                       for j, o in enumerate(comms) if o != comm):
                out[(c, comm, t, b, sp)] = here[comm]
    return out


def _scaled(measured: BlockCost, plain: BlockCost, context: BlockCost) -> BlockCost:
    """``measured`` times context's over plain, field by field (context's own value where plain has none)."""
    out = {}
    for key, value in asdict(measured).items():
        p, c = getattr(plain, key), getattr(context, key)
        scaled = value * c / p if p else c
        out[key] = scaled if key.endswith("_s") else round(scaled)
    return BlockCost(**out)


def anchored_table(costs: LayerCosts, model: ModelConfig, cluster: Cluster, precision: str,
                   keys: Iterable[tuple[int, int, bool, int]], comms: Iterable[str]) -> dict[tuple, MicrobatchCosts]:
    """``cp_table`` for measured costs (a profile holds c = 1 only): each measured entry scaled by the analytic
    estimate's ratio, context rank over plain rank, block by block and field by field."""
    out = {}
    for key, ctx in context_table(model, cluster, precision, keys, comms).items():
        c, comm, t, b, sp = key
        measured = costs.at(t, b, sp)
        if measured is None:
            continue
        plain = analytic_microbatch_costs(replace(model, sequence_parallel=sp and t > 1), cluster, precision, t, b)
        out[key] = replace(measured, **{name: _scaled(getattr(measured, name), getattr(plain, name), getattr(ctx, name))
                                        for name in ("layer", "embedding", "head")})
    return out
