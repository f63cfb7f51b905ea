"""Builds one rank's engine: its weight versions, transport, reducer, updater and statistics, constructed
here and handed to the :class:`~.executor.PipelineRank` that runs its programs (which builds nothing, so a
test can hand it a fake transport)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..config import OptimizerConfig, PipelineConfig
from ..errors import ConfigError
from ..parallel_state import ParallelState
from ..schedule.placement import Placement, group_key
from ..tensor_parallel.random import RNGTracker
from .accounting import StageStats
from .executor import PipelineRank
from .grad_reducer import GradReducer, SegmentReduction
from .parts import RankParts
from .transport import Transport
from .updater import Updater
from .weights import GlobalNames, RankWeights
from .zero import ShardLayout

if TYPE_CHECKING:
    from ..faults import Faults

NO_NAMES = GlobalNames()  # the default: a single stage's own names (frozen, so one shared instance)


def _weights(build: Callable, state: ParallelState, opt: OptimizerConfig, pipe: PipelineConfig, chunks: int,
             names: GlobalNames, cpu_init: bool) -> tuple[RankWeights, list[int]]:
    """The weight versions over every chunk's layers (one flat buffer: optimizer, reducer and checkpoints
    do not see the chunks), and each chunk's first layer index."""
    bounds = [0]
    if chunks > 1:
        parts = build()
        if len(parts) != chunks:
            raise ValueError(f"the stage builder gave {len(parts)} model chunks, the schedule runs {chunks}")
        for part in parts:
            bounds.append(bounds[-1] + len(part))
        layers = [layer for part in parts for layer in part]
        build = lambda: layers  # noqa: E731  (RankWeights builds from a callable)
    spec = pipe.spec
    weights = RankWeights(
        build, num_versions=spec.weight_versions, num_grad_buffers=spec.grad_buffers, dtype=opt.torch_dtype,
        device=state.device, tp_rank=state.tp_rank, count_shared_in_norm=state.is_first_stage, names=names,
        grad_dtype=opt.torch_grad_dtype,
        shards={n: dom.size for n, dom in state.domains().items()} if opt.use_distributed_optimizer else 1,
        cpu_init=cpu_init,  # the layout-independent CPU path unless the trainer asks for per-partition
    )
    return weights, bounds


def _transport(state: ParallelState, pipe: PipelineConfig, place: Placement, act_shape: tuple[int, ...],
               dtype: torch.dtype) -> Transport:
    if place.chunks > 1:  # a transfer's peer follows its chunk's virtual stage (rank d-1 feeds rank 0)
        ranks, r = state.pipeline_ranks, state.pp_rank
        return Transport(None, None, act_shape, dtype, state.device, mode=pipe.p2p_mode,
                         peer_of=lambda a: ranks[place.peer(r, a)], group_key=group_key(place))
    return Transport(state.prev_rank, state.next_rank, act_shape, dtype, state.device, mode=pipe.p2p_mode)


def reductions(weights: RankWeights, state: ParallelState, sharded: bool) -> list[SegmentReduction]:
    """How each segment of ``weights`` is reduced: over its domain's group (``state.domains()``), sharded by
    the distributed optimizer (``sharded``) over it; the last segment's range runs to the storage's end."""
    domains, out = state.domains(), []
    for k, seg in enumerate(weights.segments):
        if seg.domain not in domains:
            raise ConfigError(f"a parameter names reduction domain {seg.domain!r}; this layout has {sorted(domains)}")
        dom = domains[seg.domain]
        hi = None if k == len(weights.segments) - 1 else seg.start + seg.padded
        shard = ShardLayout(seg.numel, dom.size, dom.rank) if sharded else None
        out.append(SegmentReduction(seg.start, hi, dom.group, dom.size, shard, dom.copies))
    return out


def build_parts(build: Callable, state: ParallelState, pipe: PipelineConfig, opt: OptimizerConfig,
                act_shape: tuple[int, ...], *, names: GlobalNames = NO_NAMES, cpu_init: bool = True,
                transport: Transport | None = None) -> RankParts:
    """Every collaborator of a rank's engine, built for this rank of ``state``'s layout."""
    pipe.check_depth(state.d)
    place = pipe.spec.placement(state.d)
    state.loss_stage = place.rank(place.num_stages - 1)  # the loss's rank (rank 0 in a V)
    weights, bounds = _weights(build, state, opt, pipe, place.chunks, names, cpu_init)
    transport = transport or _transport(state, pipe, place, act_shape, opt.torch_dtype)
    bucket = int(opt.dp_bucket_mb * 2**20) // torch.finfo(weights.grad_dtype).bits * 8
    reducer = GradReducer(
        dp_group=state.groups.dp, embedding_group=state.groups.embedding, model_group=state.groups.model,
        replicas=state.replicas, shared_range=weights.shared_range, bucket_numel=bucket,
        # the tied word embedding is all-reduced between ranks only where the embedding and the head are apart
        has_embedding_group=state.groups.embedding is not None and place.ends_apart, device=state.device,
        segments=reductions(weights, state, opt.use_distributed_optimizer),
    )
    # while the reducer has links to run, no stream wait on an unmatched transfer sits ahead of them (its busy())
    transport.settle_while, reducer.before_issue = reducer.busy, transport.quiesce
    updater = Updater(weights, opt, pipe.compensation, pipe.dc_lambda, reducer=reducer,
                      tp=(state.groups.tp, state.tp_rank, state.t), ef_scale=pipe.ef_scale)
    stats = StageStats(stage=state.pp_rank, weight_versions=weights.num_versions,
                       weight_bytes=weights.weight_bytes + updater.master_bytes,
                       grad_bytes=weights.grad_bytes, optimizer_bytes=updater.state_bytes)
    return RankParts(place, weights, transport, reducer, updater, stats, bounds)


def build_stage(build: Callable[[], list[nn.Module]], loss_fn: Callable, state: ParallelState,
                pipe: PipelineConfig, opt: OptimizerConfig, act_shape: tuple[int, ...], *,
                rng_tracker: RNGTracker | None = None, names: GlobalNames = NO_NAMES,
                faults: "Faults | None" = None, cpu_init: bool = True,
                transport: Transport | None = None) -> PipelineRank:
    """This rank's engine: ``build()`` gives its layers (one list per model chunk where the schedule runs
    several), ``loss_fn(out, batch)`` the last stage's loss; ``transport``: a given one (tests)."""
    parts = build_parts(build, state, pipe, opt, act_shape, names=names, cpu_init=cpu_init, transport=transport)
    return PipelineRank(parts, loss_fn, state, pipe, opt, rng_tracker=rng_tracker, faults=faults)
