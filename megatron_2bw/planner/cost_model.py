"""Predicted time per batch of a candidate layout: the paper's throughput equation, extended.

The paper (Algorithm 1): with pipelining, one microbatch leaves the pipeline every
``max_i max(T_comp_i + T_comm_i, T_allreduce_i / m)``. Here, term by term (one GPU, one stage):

- ``compute``: forward + backward of the stage's blocks for one microbatch; with recomputation every
  block runs its forward twice (compute x 4/3 when backward = 2 x forward): our engine recomputes the
  whole stage, embedding and head included. A ``recompute_policy`` inside the stage instead adds the
  forward of what it re-runs: the attention cores (selective) or the recomputed layers (full).
- ``tensor_comm``: the tensor-parallel all-reduces of that microbatch (and of the recomputed forward),
  ring cost ``2(t-1)/t * bytes / bw`` over the server's NVLink. With sequence parallelism
  (``Candidate.sequence_parallel``) each all-reduce is an all-gather plus a reduce-scatter, each
  ``(t-1)/t`` of the buffer: the same time, so the same ``tp_allreduce_*`` bytes price it.
- ``p2p``: ``2 * (|A_in| / bw_in + |A_out| / bw_out)`` - the paper's ``2|A_in+out|/bw``: activations
  and their gradients. A boundary inside a server uses NVLink; one between servers shares the
  server's NIC with every GPU of the server sending across it at the same time (all ``t*w`` GPUs of
  a stage, at most a server's worth). Each tensor rank sends the whole activation.
- ``allreduce``: once per batch, the stage's gradients across its ``w`` replicas (with context parallelism
  ``w * c``: ``Candidate.replicas``; a context rank's attention exchange is in its layer's times,
  ``context_costs.py``). Ring cost
  ``2(n-1)/n * bytes / bw``; replicas inside one server (``t*w <= devices per server``) use NVLink,
  otherwise hierarchically: NVLink inside each server, then the NIC carries ``2(n_s-1)/n_s`` of the
  gradient of every data-parallel group on the server (``n_s`` servers). With several stages the
  first and last also all-reduce the tied word embedding between them (Megatron's scheme).
  With the distributed optimizer (ZeRO-1) the all-reduce becomes a reduce-scatter of the gradients
  and, after the step, an all-gather of the updated weights: each is half a ring all-reduce of its
  buffer (``(n-1)/n`` of it each way), so with gradients in the weights' precision they move the
  bytes of the all-reduce, and with fp32 gradients of half-precision weights 3/4 of them.
- ``optimizer``: the Adam step, memory-bound: ~32 bytes read/written per parameter over HBM (fp16
  gradients; 38 with fp32 ones); with the distributed optimizer only on this GPU's ``ceil(N/w)``.
- With experts (``moe_costs.py``): the token all-to-alls are inside the layer's forward and backward (on the
  critical path of every microbatch, every schedule: nothing overlaps them in this trainer); a rank's ``E/e``
  routed experts reduce their gradients over the expert-data group (``expert_sync_time``) and shard their
  optimizer state over it.

Per batch of ``m`` microbatches, with ``t_mb`` the slowest stage's ``compute + tensor_comm + p2p``
and the schedule's ideal bubble ``ScheduleSpec.bubble_time(d, m, f, b, w)``, priced from that stage's
``t_mb`` split three ways (``StageTime.fbw``): ``f`` the forward (its compute, its tensor all-reduces, the
activations' p2p), ``w`` the weight-gradient GEMMs (``BlockCost.weight_grad_s``), ``b`` the rest of the
backward (input-gradient GEMMs, every elementwise and attention kernel, a recomputed forward, the backward's
all-reduces, the gradients' p2p). The default ``bubble_time`` is ``bubble_slots * (f + b + w)``: Flush's and
GPipe's ``(d - 1) * t_mb``, 2BW's 0; zero-bubble schedules (ZB-H1: ``(d - 1)(f + b - w)``) and interleaved
ones state their own. A schedule with ``chunks`` model chunks per rank (interleaved, V) sends each
microbatch's activations and gradients across ``chunks`` boundaries per rank instead of one: its ``p2p`` is
``chunks`` times the boundary transfers (less one on the first rank's input and the last rank's output; the
first rank receives its later chunks' inputs from the last rank, at ``wrap_bandwidth``). A V layout's
turn stays on one rank, so this overcharges it by one boundary per microbatch.

- Schedules with a second gradient buffer (2BW): ``max(m * t_mb, allreduce) + optimizer``. No flush,
  so no bubble in steady state, and the all-reduce overlaps the next batch's microbatches (they run on
  the other weight version and accumulate into the other buffer). With the distributed optimizer the
  reduce-scatter and the all-gather both overlap them: the all-gather writes W(t+1) into the idle
  version buffer, which no microbatch reads before step t+2.
- Flushing schedules (Flush, GPipe, the zero-bubble and interleaved ones): ``m * t_mb + bubble_time +
  allreduce + optimizer``: the fill and drain (``d - 1`` extra microbatch times for Flush and GPipe), and
  the all-reduce waits for the drain.
  With the distributed optimizer the reduce-scatter waits for the drain and the all-gather is exposed
  too: the next step's first forward needs the whole new weights (an all-gather overlapped with the
  forward, as Megatron's ``--overlap-param-gather``, is not modelled).
- Sequential (inter-layer model parallelism without pipelining): one microbatch at a time through
  all stages, each boundary crossed once each way: ``m * sum_i t_mb_i`` (boundaries counted once).

Not modelled: overlap of p2p with compute (Megatron's sends are blocking), contention between p2p
and all-reduce on the NIC, network latency (messages here are megabytes), the first step's warm-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.stages import StageSlice
from .hardware import Cluster
from .layer_costs import MicrobatchCosts
from .memory_model import (
    DEFAULT_PARAM_BYTES,
    SEQUENTIAL,
    Candidate,
    ParamBytes,
    expert_numel,
    expert_shard_numel,
    rank_slice,
    shard_numel,
    slice_params,
)
from .spec_cache import spec_of

# Adam step traffic per parameter, in units of ParamBytes (see optimizer_traffic_bytes).
GRAD_PASSES = 3  # unscale + inf/NaN check, gradient norm for clipping, the update's read


def optimizer_traffic_bytes(pb: ParamBytes) -> int:
    """Bytes one parameter's optimizer step reads and writes: master and moments read and written,
    the half-precision weight written, the gradient read by each of its passes (32 for fp16 Adam)."""
    return 2 * (pb.master + pb.optimizer_state) + pb.weight + GRAD_PASSES * pb.grad


def optimizer_numel(params: int, cand: Candidate) -> int:
    """Parameters whose optimizer step this GPU runs: its shard with the distributed optimizer."""
    return shard_numel(params, cand)


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float) -> float:
    """NCCL ring all-reduce: each GPU sends and receives ``2(n-1)/n`` of the buffer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth


def p2p_time(in_bytes: float, out_bytes: float, in_bandwidth: float, out_bandwidth: float) -> float:
    """The paper's ``2|A_in+out|/bw``: each boundary tensor goes one way forward and its gradient back."""
    t = 0.0
    if in_bytes:
        t += 2 * in_bytes / in_bandwidth
    if out_bytes:
        t += 2 * out_bytes / out_bandwidth
    return t


def bubble_slots(schedule: str, d: int) -> int:
    """Extra microbatch slots per batch (the sequential baseline has none: it is never filled)."""
    return 0 if schedule == SEQUENTIAL else spec_of(schedule).bubble_slots(d)


def bubble_time(schedule: str, d: int, m: int, f: float, b: float, w: float) -> float:
    """The schedule's ideal idle time per batch (``ScheduleSpec.bubble_time``); the sequential baseline: 0."""
    return 0.0 if schedule == SEQUENTIAL else spec_of(schedule).bubble_time(d, m, f, b, w)


def chunks_of(schedule: str) -> int:
    """Model chunks per rank (``ScheduleSpec.chunks``); the sequential baseline: 1."""
    return 1 if schedule == SEQUENTIAL else spec_of(schedule).chunks


# ---- placement: rank = stage * (t*w) + replica * t + tensor_rank; server = rank // G ------------

def tensor_bandwidth(t: int, cluster: Cluster) -> float:
    """Bus bandwidth of a tensor group's ring: NVLink when it sits in one server.

    A group wider than a server (the search never builds one; the paper's tensor-MP baseline on
    64 GPUs did) fills its servers, and its ring crosses each server's NIC once each way.
    """
    G = cluster.devices_per_server
    if t <= G and G % t == 0:
        return cluster.intra_server_allreduce_bandwidth
    return cluster.inter_server_bandwidth


def boundary_bandwidth(t: int, w: int, boundary: int, cluster: Cluster) -> float:
    """Per-GPU bandwidth from stage ``boundary`` to stage ``boundary + 1``.

    Rank ``r`` of the sending stage talks to rank ``r + t*w``. Inside one server that is NVLink;
    across servers the sending server's NIC is shared by all of its GPUs that cross at once.
    """
    G, tw = cluster.devices_per_server, t * w
    if tw >= G:
        return cluster.inter_server_bandwidth / G
    first = boundary * tw
    crossing = sum(1 for r in range(first, first + tw) if r % G >= G - tw)
    if crossing == 0:
        return cluster.intra_server_p2p_bandwidth
    return cluster.inter_server_bandwidth / crossing


def wrap_bandwidth(t: int, w: int, d: int, cluster: Cluster) -> float:
    """Per-GPU bandwidth from the last stage back to the first (a chunked schedule's later chunks): NVLink
    when the whole pipeline sits in one server, else the NIC shared by the GPUs of a stage that cross."""
    G, tw = cluster.devices_per_server, t * w
    if tw * d <= G:
        return cluster.intra_server_p2p_bandwidth
    return cluster.inter_server_bandwidth / min(tw, G)


def data_parallel_allreduce_time(nbytes: float, t: int, w: int, cluster: Cluster) -> float:
    """All-reduce of ``nbytes`` per GPU across ``w`` replicas placed ``t`` ranks apart."""
    if w <= 1 or nbytes <= 0:
        return 0.0
    G = cluster.devices_per_server
    if t * w <= G and G % (t * w) == 0:
        return ring_allreduce_time(nbytes, w, cluster.intra_server_allreduce_bandwidth)
    k = max(1, min(w, G // t))          # replicas per server
    servers = -(-w // k)
    groups_per_server = max(1, G // k)  # data-parallel groups sharing one NIC
    intra = ring_allreduce_time(nbytes, k, cluster.intra_server_allreduce_bandwidth)
    inter = groups_per_server * ring_allreduce_time(nbytes, servers, cluster.inter_server_bandwidth)
    return intra + inter


def gradient_sync_time(params: int, cand: Candidate, cluster: Cluster, pb: ParamBytes) -> float:
    """The stage's data-parallel gradient traffic per batch: an all-reduce of the gradients, or
    with the distributed optimizer a reduce-scatter of them plus an all-gather of the weights (each
    half a ring all-reduce of its buffer)."""
    t, w = cand.tensor_parallel, cand.replicas  # the context ranks are replicas too
    if not cand.distributed_optimizer:
        return data_parallel_allreduce_time(params * pb.grad, t, w, cluster)
    scatter = data_parallel_allreduce_time(params * pb.grad, t, w, cluster) / 2
    gather = data_parallel_allreduce_time(params * pb.weight, t, w, cluster) / 2
    return scatter + gather


def expert_sync_time(numel: int, cand: Candidate, cluster: Cluster, pb: ParamBytes) -> float:
    """The routed experts' gradient traffic per batch: as :func:`gradient_sync_time`, over their expert-data
    group (the ``w c / e`` ranks holding the same experts, ``t e`` ranks apart)."""
    if not numel:
        return 0.0
    t, n = cand.tensor_parallel * cand.expert_parallel, cand.expert_replicas
    if not cand.distributed_optimizer:
        return data_parallel_allreduce_time(numel * pb.grad, t, n, cluster)
    return (data_parallel_allreduce_time(numel * pb.grad, t, n, cluster)
            + data_parallel_allreduce_time(numel * pb.weight, t, n, cluster)) / 2


def tied_embedding_sync_time(nbytes: float, t: int, w: int, d: int, cluster: Cluster) -> float:
    """All-reduce of the word-embedding gradient between the first and the last stage."""
    if d <= 1 or nbytes <= 0:
        return 0.0
    G, tw = cluster.devices_per_server, t * w
    if tw * d <= G and G % (tw * d) == 0:
        return ring_allreduce_time(nbytes, 2, cluster.intra_server_allreduce_bandwidth)
    return ring_allreduce_time(nbytes, 2, cluster.inter_server_bandwidth / min(tw, G))


# ---- per stage and per batch --------------------------------------------------------------------

@dataclass(frozen=True)
class StageTime:
    """One stage, one GPU: per-microbatch terms and per-batch terms, in seconds."""

    stage: int
    compute_s: float
    tensor_comm_s: float
    p2p_s: float
    allreduce_s: float
    optimizer_s: float
    # the parts of ``microbatch_s`` a split backward and the bubble formulas need (module docstring):
    # the forward (compute, its all-reduces, the activations' p2p) and the weight-gradient GEMMs
    forward_s: float = 0.0
    weight_grad_s: float = 0.0
    # with experts: the token all-to-alls of one microbatch, a recomputed forward's included (inside compute_s)
    alltoall_s: float = 0.0

    @property
    def microbatch_s(self) -> float:
        """Time this stage needs per microbatch."""
        return self.compute_s + self.tensor_comm_s + self.p2p_s

    @property
    def fbw(self) -> tuple[float, float, float]:
        """``(f, b, w)`` of one microbatch, the arguments of ``ScheduleSpec.bubble_time``: ``f + b + w`` is
        ``microbatch_s``, ``b`` what is neither forward nor weight gradient."""
        return self.forward_s, self.microbatch_s - self.forward_s - self.weight_grad_s, self.weight_grad_s


@dataclass(frozen=True)
class Prediction:
    """Per-batch time of a candidate and its parts; ``samples_per_sec`` is what the search ranks."""

    stages: tuple[StageTime, ...]
    microbatch_s: float  # the slowest stage's time per microbatch
    pipeline_s: float
    bubble_s: float
    exposed_allreduce_s: float
    optimizer_s: float
    batch_s: float
    samples_per_sec: float


def stage_time(costs: MicrobatchCosts, cand: Candidate, num_layers: int, stage: int, cluster: Cluster,
               in_bandwidth: float, out_bandwidth: float, param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> StageTime:
    """The terms of one stage (see the module docstring), under ``cand``'s split."""
    part = rank_slice(num_layers, cand, stage)
    return slice_time(costs, cand, part, stage, cluster, in_bandwidth, out_bandwidth, param_bytes)


def inner_recompute_cost(costs: MicrobatchCosts, num_layers: int, policy: RecomputePolicy | None) -> tuple[float, int]:
    """``(seconds, tensor all-reduce bytes)`` re-run in backward by a policy inside a stage.

    Selective re-runs each layer's attention core (no all-reduce inside it); full re-runs the
    forward of every layer of a recomputed chunk, its two all-reduces included.
    """
    lay = costs.layer
    if policy is None or not policy.active:
        return 0.0, 0
    if policy.granularity == "selective":
        return num_layers * lay.core_forward_s, 0
    redone = sum(n for _, n, rec in policy.segments(num_layers) if rec)
    return redone * lay.forward_s, redone * lay.tp_allreduce_forward_bytes


def slice_time(costs: MicrobatchCosts, cand: Candidate, part: StageSlice, stage: int, cluster: Cluster,
               in_bandwidth: float, out_bandwidth: float, param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> StageTime:
    """The terms of stage ``stage`` holding ``part`` (any number of layers: ``planner/split.py``)."""
    t, d, w = cand.tensor_parallel, cand.pipeline_parallel, cand.replicas  # placement: a stage spans t*c*w ranks
    passes = 2 if cand.recompute else 1  # our engine recomputes the whole stage, embedding and head included
    lay, emb, head = costs.layer, costs.embedding, costs.head
    blocks = [(lay, part.num_layers)] + ([(emb, 1)] if part.embedding else []) + ([(head, 1)] if part.head else [])
    fwd = bwd = wgrad = 0.0
    tp_forward = tp_backward = 0
    for blk, n in blocks:
        fwd += n * blk.forward_s
        bwd += n * blk.backward_s
        wgrad += n * blk.weight_grad_s
        tp_forward += n * blk.tp_allreduce_forward_bytes
        tp_backward += n * blk.tp_allreduce_backward_bytes
    compute = passes * fwd + bwd
    tp_bytes = passes * tp_forward + tp_backward
    extra_s, extra_tp = inner_recompute_cost(costs, part.num_layers, cand.recompute_policy)
    compute += extra_s
    tp_bytes += extra_tp
    # Token ids come from the data loader, and the loss stays on the last stage.
    in_bytes = 0 if part.embedding else lay.input_bytes
    out_bytes = 0 if part.head else lay.output_bytes
    chunks = chunks_of(cand.schedule)
    if chunks > 1:  # every chunk but the first rank's first receives, every chunk but the last rank's last sends
        wrap = wrap_bandwidth(t, w, d, cluster)
        in_bytes = (chunks - part.embedding) * lay.input_bytes
        out_bytes = (chunks - part.head) * lay.output_bytes
        in_bandwidth = in_bandwidth if in_bandwidth != float("inf") else wrap
        out_bandwidth = out_bandwidth if out_bandwidth != float("inf") else wrap
    p2p = p2p_time(in_bytes, out_bytes, in_bandwidth, out_bandwidth)
    tensor_comm = ring_allreduce_time(tp_bytes, t, tensor_bandwidth(t, cluster))
    # the forward's share: one forward pass, its all-reduces (the ring is linear in bytes), the activations' half of p2p
    forward = fwd + (tensor_comm * tp_forward / tp_bytes if tp_bytes else 0.0) + p2p / 2
    params = slice_params(costs, part)
    allreduce, numel = gradient_sync_time(params, cand, cluster, param_bytes), optimizer_numel(params, cand)
    if costs.moe is not None:  # a rank's E/e experts: reduced and sharded over their expert-data group
        experts = expert_numel(costs, part, cand)
        allreduce += expert_sync_time(experts, cand, cluster, param_bytes)
        numel += expert_shard_numel(experts, cand)
    if part.embedding or part.head:
        allreduce += tied_embedding_sync_time(costs.tied_params * param_bytes.grad, t, w, d, cluster)
    return StageTime(
        stage=stage,
        compute_s=compute,
        tensor_comm_s=tensor_comm,
        p2p_s=p2p,
        allreduce_s=allreduce,
        optimizer_s=numel * optimizer_traffic_bytes(param_bytes) / cluster.memory_bandwidth,
        forward_s=forward,
        weight_grad_s=wgrad,
        alltoall_s=stage_alltoall_s(costs, cand, part.num_layers) if costs.moe is not None else 0.0,
    )


def stage_alltoall_s(costs: MicrobatchCosts, cand: Candidate, num_layers: int) -> float:
    """The all-to-all seconds of one microbatch through ``num_layers`` layers: forward, a recomputed forward
    (whole stages, or the layers a ``full`` policy re-runs) and backward."""
    fwd, bwd = costs.alltoall_s
    if not fwd and not bwd:
        return 0.0
    p = cand.recompute_policy
    redone = num_layers if cand.recompute else sum(n for _, n, rec in p.segments(num_layers) if rec) \
        if p is not None and p.active and p.granularity == "full" else 0
    return num_layers * (fwd + bwd) + redone * fwd


def stage_times(costs: MicrobatchCosts, cand: Candidate, num_layers: int, cluster: Cluster,
                param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> tuple[StageTime, ...]:
    """Every distinct stage: the first, the last, and one middle stage per pattern of its links
    (every stage under an uneven split)."""
    t, d, w = cand.tensor_parallel, cand.pipeline_parallel, cand.replicas  # placement: a stage spans t*c*w ranks
    bw = [boundary_bandwidth(t, w, i, cluster) for i in range(d - 1)]
    picked: dict[tuple[float, float], int] = {}
    for i in range(1, d - 1):
        picked.setdefault((bw[i - 1], bw[i]) if cand.layer_split is None else (i, i), i)
    wanted = sorted({0, d - 1, *picked.values()})
    inf = float("inf")
    return tuple(
        stage_time(costs, cand, num_layers, i, cluster, bw[i - 1] if i > 0 else inf, bw[i] if i < d - 1 else inf,
                   param_bytes)
        for i in wanted
    )


def _sequential_microbatch_s(costs: MicrobatchCosts, cand: Candidate, num_layers: int, cluster: Cluster,
                             stages: tuple[StageTime, ...], param_bytes: ParamBytes) -> float:
    """One microbatch through every stage in turn: each stage's compute, each boundary's transfer once
    (both of its ends count it)."""
    d = cand.pipeline_parallel
    per_stage = {s.stage: s for s in stages}
    bw = [boundary_bandwidth(cand.tensor_parallel, cand.replicas, i, cluster) for i in range(d - 1)]
    inf = float("inf")
    total = 0.0
    for i in range(d):
        s = per_stage.get(i) or stage_time(costs, cand, num_layers, i, cluster,
                                           bw[i - 1] if i > 0 else inf, bw[i] if i < d - 1 else inf, param_bytes)
        total += s.compute_s + s.tensor_comm_s + s.p2p_s / 2
    return total


def predict(costs: MicrobatchCosts, cand: Candidate, num_layers: int, cluster: Cluster,
            param_bytes: ParamBytes = DEFAULT_PARAM_BYTES, max_batch_s: float = math.inf) -> Prediction | None:
    """Time per batch and samples per second of ``cand``; ``None`` when even without its bubble (which
    only adds, and is a replay of the programs for the zero-bubble schedules) the batch would take longer
    than ``max_batch_s`` (the search's threshold, ``planner/pruning.py``)."""
    d, m = cand.pipeline_parallel, cand.num_micro_batches
    stages = stage_times(costs, cand, num_layers, cluster, param_bytes)
    slowest = max(stages, key=lambda s: s.microbatch_s)
    per_mb = slowest.microbatch_s
    allreduce = max(s.allreduce_s for s in stages)
    optimizer = max(s.optimizer_s for s in stages)
    if max_batch_s < math.inf and cand.schedule != SEQUENTIAL:
        overlapped = spec_of(cand.schedule).grad_buffers > 1
        unbubbled = (max(m * per_mb, allreduce) if overlapped else m * per_mb + allreduce) + optimizer
        if unbubbled > max_batch_s * (1 + 1e-9):
            return None
    bubble = bubble_time(cand.schedule, d, m, *slowest.fbw)
    if cand.schedule == SEQUENTIAL:
        pipeline = m * _sequential_microbatch_s(costs, cand, num_layers, cluster, stages, param_bytes)
        exposed = allreduce
    elif spec_of(cand.schedule).grad_buffers > 1:  # the reduction overlaps the next step
        pipeline = m * per_mb + bubble
        exposed = max(0.0, allreduce - pipeline)
    else:
        pipeline = m * per_mb + bubble
        exposed = allreduce
    batch = pipeline + exposed + optimizer
    return Prediction(
        stages=stages, microbatch_s=per_mb, pipeline_s=pipeline, bubble_s=bubble, exposed_allreduce_s=exposed,
        optimizer_s=optimizer, batch_s=batch, samples_per_sec=cand.global_batch_size / batch,
    )
