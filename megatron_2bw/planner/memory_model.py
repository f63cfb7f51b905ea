"""Bytes per GPU of a candidate layout, stage by stage: the paper's formulas plus what they omit.

The paper's formulas (``|W|/d`` a stage's weights, ``A_total/d`` the activations of one microbatch
through a stage, ``A_input`` a stage's input; docs/planner.md compares them with measurements)::

    2BW, recomputation:       2|W|/d + A_total/d     + d * A_input
    2BW, no recomputation:    2|W|/d + d * A_total/d  (+ d * A_input, inside A_total here)
    GPipe (recomputes):        |W|/d + A_total/d     + m * A_input
    PipeDream-Flush:           |W|/d and at most d microbatches in flight

Here ``A_total`` counts each layer's input (it is what the first LayerNorm keeps), so the no-
recomputation formula's separate ``d * A_input`` (the received tensor) is not counted twice.
Recomputation is our engine's: each in-flight microbatch keeps only what the stage received (token
ids on the first stage), and the backward re-runs the whole stage, embedding and head included. The
count of microbatches in flight per stage and the weight versions come from the schedule's
``ScheduleSpec`` (``schedule/schedules.py``); a non-pipelined sequential run holds one. The layers of
each stage come from ``schedule/stages.py``'s split: the even one, or ``Candidate.layer_split``. The
``slice_*`` functions take a stage's contents directly, so ``planner/split.py`` can price a stage with
any number of layers before a whole split exists.

Schedules beyond the paper's read the same ``ScheduleSpec`` (no schedule names here):

- ``inflight`` counts FORWARD actions not yet backwarded, as the checker counts them
  (``schedule/checker.py``): one unit is one microbatch through one *chunk*. With ``chunks`` model chunks
  per rank (interleaved 1F1B, V layouts) a rank's layers are split over its chunks, so a unit holds
  ``1/chunks`` of the rank's per-microbatch stash; the planner converts to whole-rank microbatches
  (``rank_units``). With one chunk a unit is a whole-rank microbatch, as before.
- Split-backward schedules (ZB-H1, ZB-H2, ZB-V): a microbatch keeps its stash until its input gradient
  (I), then only what its weight gradient (W) reads of it plus the gradients I caught for W (the engine
  frees the rest at I, ``pipeline/saved_release.py``; ``BlockCost.weight_read_bytes`` and
  ``deferred_bytes``). The peak is the largest sum over the schedule's (F..I, I..W) counts
  (``ScheduleSpec.held_pairs``); ``inflight`` (F..W) and ``deferred_weight_grads`` (I..W) bound them.
- ``weight_versions`` and ``grad_buffers`` as for the paper's schedules.

What real runs also pay, and the paper's formula leaves out:

- Gradients and optimizer state: mixed-precision Adam keeps an fp16 weight (2 bytes), fp16 gradient
  (2), fp32 master weight (4) and two fp32 moments (8): 16 bytes per parameter; 2BW adds its second
  fp16 weight version (2) and its second gradient buffer (2: step t+1's backwards accumulate while
  step t's gradient is reduced; ``ScheduleSpec.grad_buffers``). fp32 training: 4 + 4 + 0 + 8.
  With fp32 gradient accumulation (``--accumulate-allreduce-grads-in-fp32``, the default for bf16,
  ``OptimizerConfig.fp32_grads``) each gradient buffer holds 4 bytes per parameter.
- A 2BW stale-gradient compensation's own state (``ParamBytes.stale_correction``, charged to 2BW
  candidates only): ``ef`` one fp32 buffer (4 bytes per parameter, sharded like the optimizer state:
  the scratch of the optimizer's next iterate in bf16/fp16, the master iterate in fp32);
  ``extrapolate`` the previous step's fp32 gradient (4); ``predict`` in fp32 keeps an fp32 copy of
  the newest weights (4; in bf16/fp16 the master it uses exists anyway: 0); ``dc`` nothing
  (pipeline/compensation.py).
- The distributed optimizer (``--use-distributed-optimizer``, ZeRO-1): each of the ``w`` replicas of
  a stage keeps the master and the optimizer state of one contiguous shard of ``ceil(N/w)`` elements
  of the stage's flat parameter buffer (the last shard padded to the same size); weights (every
  version) and gradients stay whole.
- The embedding on the first stage and the head on the last, which with a 50k vocabulary weigh as
  much as several layers; with more than one stage the last stage holds its own copy of the tied
  word embedding (Megatron's scheme), with its own gradient and optimizer state.
- The head's logits: the fp32 softmax of every microbatch in flight on the last stage, and the
  fp16 logits plus their fp32 copy while the cross-entropy runs (``workspace``).
- The transient working memory of the block running (the gradients of its activations).
- A checkpoint save, at a drained boundary (no activations held): it copies nothing of the state on
  the device (gpu-review C4), except that with the distributed optimizer the torch format gathers
  the fp32 state to data-parallel rank 0 through one device buffer of at most
  ``CKPT_GATHER_CHUNK`` fp32 elements (``save``). The peak is the larger of the activations plus
  workspace and the save's buffer, so a plan whose save would not fit is refused like any other.
- ``--async-save`` (torch_dist): the host (pinned on CUDA) buffers that hold one copy of what the
  rank writes while the write runs (``host_save``, host memory, not in ``total``): every weight
  version, the master and the optimizer state of its 1/w range of the stage's flat buffers (the
  distributed optimizer's shard; replicas share the writing of replicated buffers the same way).
  An upper bound: tensor-replicated vectors and the last stage's tied embedding copy are written
  by one rank only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import (
    CKPT_GATHER_CHUNK,
    fp32_grads_for,  # noqa: F401 - the trainer's rule, re-exported to the planner
)
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.stages import Split, StageSlice, stage_slice
from .candidate import SEQUENTIAL, Candidate, ParamBytes  # noqa: F401 - re-exported: the planner's names
from .layer_costs import MicrobatchCosts
from .spec_cache import held_pairs, spec_of

# the default copies (mixed-precision Adam, fp16 gradients); ParamBytes is frozen, so one shared default is safe
DEFAULT_PARAM_BYTES = ParamBytes()


@dataclass(frozen=True)
class StageMemory:
    """One stage's bytes per GPU, term by term."""

    stage: int
    params: int
    weights: int
    second_weights: int
    grads: int  # every gradient buffer of the schedule
    master: int
    optimizer_state: int
    activations: int
    workspace: int
    save: int = 0  # device bytes a checkpoint save allocates (at a drained boundary: no activations then)
    host_save: int = 0  # host bytes of --async-save's copy of what this rank writes (not device memory)
    # optimizer post-validation: from a speculative update to its VALIDATE, the copy of the weights (the master
    # where there is one) and optimizer state it overwrote, beside the next step's warm-up stashes
    speculation: int = 0
    # the routed experts' share of weights + second_weights + grads + optimizer (E/e experts per MoE layer; their
    # master and optimizer state sharded over the expert-data group): already in the terms above, shown apart
    experts: int = 0

    @property
    def optimizer(self) -> int:
        """The master copy and the optimizer's state (this GPU's shard of them, when sharded)."""
        return self.master + self.optimizer_state

    @property
    def total(self) -> int:
        static = self.weights + self.second_weights + self.grads + self.optimizer
        return static + max(self.activations + self.workspace, self.save, self.speculation)


def save_bytes(shard: int, cand: "Candidate") -> int:
    """Device bytes of a save: the distributed optimizer's gather buffer (fp32, at most
    ``CKPT_GATHER_CHUNK`` elements) on data-parallel rank 0; nothing otherwise."""
    return 4 * min(shard, CKPT_GATHER_CHUNK) if cand.distributed_optimizer and cand.replicas > 1 else 0


def async_save_host_bytes(params: int, cand: "Candidate", param_bytes: "ParamBytes", experts: int = 0) -> int:
    """Host bytes of ``--async-save``'s buffers: every version, master and optimizer state of a 1/w range
    (of the ``experts`` a rank holds, a 1/(w/e) range: their replicas are the expert-data group)."""
    if not cand.async_save:
        return 0
    per_param = (weight_versions(cand.schedule) * param_bytes.weight + param_bytes.master
                 + param_bytes.optimizer_state + _stale_correction(cand, param_bytes))
    return (-(-params // cand.replicas) + -(-experts // cand.expert_replicas)) * per_param


def weight_versions(schedule: str) -> int:
    """Weight versions the executor keeps (the sequential baseline: one)."""
    return 1 if schedule == SEQUENTIAL else spec_of(schedule).weight_versions


def grad_buffers(schedule: str) -> int:
    """Gradient buffers the executor keeps (the sequential baseline: one)."""
    return 1 if schedule == SEQUENTIAL else spec_of(schedule).grad_buffers


def shard_numel(numel: int, cand: Candidate) -> int:
    """Elements of the flat parameter buffer whose master and optimizer state one GPU keeps:
    ``ceil(N/w)`` with the distributed optimizer (equal shards, the last one padded; ``w`` the weight replicas,
    ``Candidate.replicas``: the data width times the context-parallel size), else ``N``."""
    w = cand.replicas
    return -(-numel // w) if cand.distributed_optimizer else numel


def in_flight(schedule: str, d: int, m: int, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak."""
    return 1 if schedule == SEQUENTIAL else spec_of(schedule).inflight(d, stage, m)




def expert_numel(costs: MicrobatchCosts, part: StageSlice, cand: Candidate) -> int:
    """Routed-expert parameters on one GPU of a stage holding ``part``: ``E / e`` whole experts of each of its
    layers (every layer counted as an MoE layer: ``moe_costs``); 0 for a dense model."""
    return part.num_layers * (costs.moe.expert_params // cand.expert_parallel) if costs.moe else 0


def expert_shard_numel(numel: int, cand: Candidate) -> int:
    """The experts' elements whose master and optimizer state one GPU keeps: with the distributed optimizer
    ``ceil(x / (w c / e))``, sharded over the expert-data group (their replicas), else all ``x``."""
    return -(-numel // cand.expert_replicas) if cand.distributed_optimizer else numel


def rank_units(count: int, chunks: int) -> float:
    """``count`` chunk-microbatches as whole-rank microbatches (the module docstring); exact for one chunk."""
    return count if chunks == 1 else count / chunks


def muon_matrix_numel(costs: MicrobatchCosts, part: StageSlice) -> int:
    """Elements of a stage slice that Muon updates (its transformer layers' weights; the embedding, the
    head and the layers' few 1-D norms and biases go to AdamW; those last, about 13 h of a layer's 12 h^2,
    are counted as matrices here: the planner's costs do not split them out, an error of 1/h)."""
    return part.num_layers * costs.layer.params


def slice_params(costs: MicrobatchCosts, part: StageSlice) -> int:
    """Parameters on one GPU of a stage holding ``part``: its layers, the embedding, the head."""
    n = part.num_layers * costs.layer.params
    if part.embedding:
        n += costs.embedding.params
    if part.head:
        n += costs.head.params
        if part.embedding:
            n -= costs.tied_params  # one stage: the output layer *is* the embedding
    return n


def stage_params(costs: MicrobatchCosts, num_layers: int, d: int, stage: int, split: Split = None) -> int:
    """Parameters on one GPU of ``stage``: its layers (with experts, the ``E/e`` each holds at the costs'
    expert-parallel size), the embedding (first), the head (last)."""
    part = stage_slice(num_layers, d, stage, split)
    experts = part.num_layers * (costs.moe.expert_params // costs.expert_parallel) if costs.moe else 0
    return slice_params(costs, part) + experts


def layer_activation_bytes(costs: MicrobatchCosts, num_layers: int, d: int, stage: int, split: Split = None) -> int:
    """``A_total/d``: what one microbatch leaves for the backward in a stage's transformer layers."""
    return stage_slice(num_layers, d, stage, split).num_layers * costs.layer.stash_bytes


def _edge_bytes(costs: MicrobatchCosts, part: StageSlice) -> int:
    extra = 0
    if part.embedding:
        extra += costs.embedding.input_bytes + costs.embedding.stash_bytes
    if part.head:
        extra += costs.head.stash_bytes
    return extra


def edge_activation_bytes(costs: MicrobatchCosts, num_layers: int, d: int, stage: int, split: Split = None) -> int:
    """Per microbatch, the embedding's stash and token ids (first stage) and the head's (last)."""
    return _edge_bytes(costs, stage_slice(num_layers, d, stage, split))


def layer_stash_with(costs: MicrobatchCosts, num_layers: int, policy: RecomputePolicy | None) -> tuple[int, int]:
    """``(per microbatch, transient)`` bytes of ``num_layers`` transformer layers under ``policy``.

    Selective: each layer keeps all but its attention core; the core of the layer in backward is rebuilt
    (transient). Full: a recomputed chunk keeps only its input; the largest chunk's activations are rebuilt
    for one microbatch at a time (transient). Layers outside every recomputed chunk (``block``) keep all.
    """
    lay = costs.layer
    if policy is None or not policy.active:
        return num_layers * lay.stash_bytes, 0
    if policy.granularity == "selective":
        return num_layers * (lay.stash_bytes - lay.core_stash_bytes), lay.core_stash_bytes if num_layers else 0
    segs = policy.segments(num_layers)
    kept = sum(lay.input_bytes if rec else n * lay.stash_bytes for _, n, rec in segs)
    return kept, max((n * lay.stash_bytes for _, n, rec in segs if rec), default=0)


def _caught_bytes(costs: MicrobatchCosts, part: StageSlice) -> int:
    """The gradients one whole-rank microbatch's I catches for its W (``BlockCost.deferred_bytes``)."""
    n = part.num_layers * costs.layer.deferred_bytes
    if part.head:
        n += costs.head.deferred_bytes
    return n


def _read_bytes(costs: MicrobatchCosts, part: StageSlice) -> int:
    """What one whole-rank microbatch's W reads of its stash (``BlockCost.weight_read_bytes``)."""
    n = part.num_layers * costs.layer.weight_read_bytes
    if part.head:
        n += costs.head.weight_read_bytes
    return n


def deferred_bytes(costs: MicrobatchCosts, cand: Candidate, part: StageSlice, stash: int) -> int:
    """What one whole-rank microbatch holds from its I to its W on a stage holding ``part`` whose forwarded
    microbatch keeps ``stash`` (see :func:`_split_activation_bytes`)."""
    if cand.recompute_policy is not None and cand.recompute_policy.active:
        kept = stash + _caught_bytes(costs, part)
    else:
        kept = _read_bytes(costs, part) + _caught_bytes(costs, part)
    if not part.embedding:
        return kept
    first = stash + (costs.layer.output_bytes if part.num_layers else costs.embedding.output_bytes)
    # a rank whose other chunk is a later virtual stage (a V's rank 0 also holds the head) may hold either
    return max(first, kept) if spec_of(cand.schedule).chunks > 1 else first


def _split_activation_bytes(costs: MicrobatchCosts, cand: Candidate, part: StageSlice, stage: int) -> int:
    """A split-backward stage's peak: the largest ``a * stash + b * deferred`` over the schedule's
    (F..I, I..W) counts (``ScheduleSpec.held_pairs``), in chunk units (``rank_units``).

    ``stash``: what a forwarded microbatch keeps until its I (its input alone with recomputation; the one
    being recomputed rebuilds one chunk's stash). ``deferred``: what it keeps from I to W. The engine frees
    at I what W does not read (``pipeline/saved_release.py``), so that is what W reads plus the gradients I
    caught; with layer-level recomputation nothing is freed (torch checkpoint regions hold those tensors):
    the stash plus the caught gradients. The first stage's I has nothing to compute: its W runs the whole
    backward from the stash and the gradient it received for its output."""
    spec = spec_of(cand.schedule)
    d, m, chunks = cand.pipeline_parallel, cand.num_micro_batches, spec.chunks
    layers, transient = layer_stash_with(costs, part.num_layers, cand.recompute_policy)
    edge = _edge_bytes(costs, part)
    if cand.recompute:
        received = costs.embedding.input_bytes if part.embedding else costs.layer.input_bytes
        stash = received * chunks  # per whole-rank microbatch: each chunk keeps its own input
        transient = round((layers + edge) / chunks)
    else:
        stash = layers + edge
    deferred = deferred_bytes(costs, cand, part, stash)
    peak = max(rank_units(a, chunks) * stash + rank_units(b, chunks) * deferred
               for a, b in held_pairs(spec, d, stage, m))
    return round(peak) + transient


def slice_activation_bytes(costs: MicrobatchCosts, cand: Candidate, part: StageSlice, stage: int) -> int:
    """Activations held at the peak of a stage holding ``part`` (see :func:`activation_bytes`).

    A chunked schedule's in-flight count is in chunk-microbatches (the module docstring): each keeps
    ``1/chunks`` of the rank's stash, and with recomputation its chunk's input; the one being recomputed
    rebuilds one chunk. A split backward's stages: :func:`_split_activation_bytes`."""
    d, m = cand.pipeline_parallel, cand.num_micro_batches
    if cand.schedule == SEQUENTIAL:
        n, chunks = 1, 1
    else:
        spec = spec_of(cand.schedule)
        if spec.split_backward:
            return _split_activation_bytes(costs, cand, part, stage)
        n, chunks = spec.inflight(d, stage, m), spec.chunks
    layers, transient = layer_stash_with(costs, part.num_layers, cand.recompute_policy)
    edge = _edge_bytes(costs, part)
    if cand.recompute:
        # A_input: what the stage received (the first stage: the token ids)
        received = costs.embedding.input_bytes if part.embedding else costs.layer.input_bytes
        if chunks == 1:
            return n * received + layers + edge
        return n * costs.layer.input_bytes + round((layers + edge) / chunks)
    if chunks == 1:
        return n * (layers + edge) + transient
    return round(rank_units(n, chunks) * (layers + edge)) + transient


def activation_bytes(costs: MicrobatchCosts, cand: Candidate, num_layers: int, stage: int) -> int:
    """Activations held at the stage's peak: stashes of the microbatches in flight.

    Without recomputation every in-flight microbatch keeps all of its activations. With it, as
    our engine does it (the whole stage is re-run from what it received, embedding and head
    included), each in-flight microbatch keeps only the stage's input (token ids on stage 0),
    plus the full activations of the one microbatch being recomputed. A ``recompute_policy``
    shrinks each microbatch's layer stash instead (:func:`layer_stash_with`).
    """
    return slice_activation_bytes(costs, cand, rank_slice(num_layers, cand, stage), stage)


def _workspace(costs: MicrobatchCosts, part: StageSlice, chunks: int = 1) -> int:
    """The largest transient beyond the activations held. With one model chunk a layer's runs while its own
    microbatch's head stash does not exist (not yet built in forward, freed by the head's backward before the
    layers'), so on the head's stage it stands beside the activations less that stash (checked by a whole step's
    live-tensor count under context parallelism, ``benchmarks/cp_step_peak.py``)."""
    ws = costs.layer.workspace_bytes if part.num_layers else 0
    if part.head and chunks == 1:
        ws = max(0, ws - costs.head.stash_bytes)
    if part.embedding:
        ws = max(ws, costs.embedding.workspace_bytes)
    if part.head:
        ws = max(ws, costs.head.workspace_bytes)
    return ws


def workspace_bytes(costs: MicrobatchCosts, num_layers: int, d: int, stage: int, split: Split = None) -> int:
    """The largest transient of the blocks the stage runs."""
    return _workspace(costs, stage_slice(num_layers, d, stage, split))


def _stale_correction(cand: Candidate, param_bytes: ParamBytes) -> int:
    """Bytes per (sharded) parameter of the 2BW compensation: only schedules with a stale gradient pay it."""
    stale = cand.schedule != SEQUENTIAL and spec_of(cand.schedule).stale_steps > 0
    return param_bytes.stale_correction if stale else 0


def slice_memory(costs: MicrobatchCosts, cand: Candidate, part: StageSlice, stage: int,
                 param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> StageMemory:
    """Bytes per GPU of stage ``stage`` holding ``part``, term by term (with experts: ``E / e`` routed experts
    per layer beside the rest, their master and optimizer state sharded over the expert-data group)."""
    x, dense = expert_numel(costs, part, cand), slice_params(costs, part)
    xs = expert_shard_numel(x, cand) if x else 0
    p, shard = dense + x, shard_numel(dense, cand) + xs
    state = param_bytes.optimizer_state + _stale_correction(cand, param_bytes)
    muon = param_bytes.muon_saving * (muon_matrix_numel(costs, part) + x) * shard // p if p else 0
    versions, buffers = weight_versions(cand.schedule), grad_buffers(cand.schedule)
    return StageMemory(
        stage=stage,
        params=p,
        weights=p * param_bytes.weight,
        second_weights=(versions - 1) * p * param_bytes.weight,
        grads=buffers * p * param_bytes.grad,
        master=shard * param_bytes.master,
        optimizer_state=shard * state - muon,
        activations=slice_activation_bytes(costs, cand, part, stage),
        workspace=_workspace(costs, part, cand.axes.virtual),
        save=save_bytes(shard, cand),
        host_save=async_save_host_bytes(dense, cand, param_bytes, x),
        speculation=speculation_bytes(costs, cand, part, stage, shard, param_bytes),
        experts=x * (versions * param_bytes.weight + buffers * param_bytes.grad) + xs * (
            param_bytes.master + state - param_bytes.muon_saving),
    )


def speculation_bytes(costs: MicrobatchCosts, cand: Candidate, part: StageSlice, stage: int, shard: int,
                      param_bytes: ParamBytes) -> int:
    """Optimizer post-validation's transient (``Updater.speculate``): this GPU's copy of the weights (the fp32
    master where there is one) and of the optimizer state, held from the update until VALIDATE, with the
    ``d - 1 - stage`` forwards of the next step's warm-up that run meanwhile (their stashes, and a block's
    workspace); 0 for a schedule without it."""
    if cand.schedule == SEQUENTIAL or not spec_of(cand.schedule).post_validation:
        return 0
    kept = shard * ((param_bytes.master or param_bytes.weight) + param_bytes.optimizer_state)
    layers, _ = layer_stash_with(costs, part.num_layers, cand.recompute_policy)
    stash = layers + _edge_bytes(costs, part)
    if cand.recompute:
        stash = costs.embedding.input_bytes if part.embedding else costs.layer.input_bytes
    warm = min(cand.pipeline_parallel - 1 - stage, cand.num_micro_batches) * stash
    return kept + warm + _workspace(costs, part, cand.axes.virtual)


def rank_slice(num_layers: int, cand: Candidate, stage: int) -> StageSlice:
    """What rank ``stage`` holds under ``cand``: its share of the split's layers, and the embedding and the
    head where the schedule's placement puts them (a V layout keeps both on rank 0, none on rank d-1)."""
    part = stage_slice(num_layers, cand.pipeline_parallel, stage, cand.layer_split)
    if cand.schedule == SEQUENTIAL or cand.pipeline_parallel == 1:
        return part
    place = spec_of(cand.schedule).placement(cand.pipeline_parallel)
    emb, head = place.rank(0) == stage, place.rank(place.num_stages - 1) == stage
    return part if (emb, head) == (part.embedding, part.head) else replace(part, embedding=emb, head=head)


def stage_memory(costs: MicrobatchCosts, cand: Candidate, num_layers: int, stage: int,
                 param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> StageMemory:
    """Bytes per GPU of one stage, term by term."""
    part = rank_slice(num_layers, cand, stage)
    return slice_memory(costs, cand, part, stage, param_bytes)


def representative_stages(d: int) -> tuple[int, ...]:
    """Stages whose memory can differ: the first two and the last (the rest lie between)."""
    return tuple(sorted({0, min(1, d - 1), d - 1}))


def plan_memory(costs: MicrobatchCosts, cand: Candidate, num_layers: int,
                param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> tuple[StageMemory, ...]:
    """Memory of the stages that can be the peak.

    Stage 0 has the embedding and the most microbatches in flight; the last stage has the head;
    stage 1 is the fullest stage with neither. Every other stage holds fewer stashes than stage 1
    and the same weights, so it can never be the maximum. With an uneven split every stage counts.
    """
    d = cand.pipeline_parallel
    stages = representative_stages(d) if cand.layer_split is None else range(d)
    return tuple(stage_memory(costs, cand, num_layers, s, param_bytes) for s in stages)
