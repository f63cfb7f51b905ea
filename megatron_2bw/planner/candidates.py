"""The search space of ``search.py``: every candidate layout of a ``PlanRequest`` (that module's docstring).

Context parallelism (``--context-parallel-size c``) is one more axis: world = ``t * c * w * d``, the data
width ``w = N / (t c d)``; ``c`` is a power of two whose ``2c`` chunks divide the sequence
(``context_costs.context_sizes``), each with the ``cp_comm_types`` asked for, where the costs know it
(``LayerCosts.cp_table``: the analytic estimate's; a measured profile holds ``c = 1`` only).
"""

from __future__ import annotations

from typing import Any, Iterator

from ..config import ModelConfig
from ..errors import ConfigError
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.schedules import parse_schedule_id, spec_of, validate_pipeline
from .candidate import SEQUENTIAL, Candidate
from .cost_model import inner_recompute_cost
from .hardware import Cluster
from .layer_costs import LayerCosts, MicrobatchCosts
from .moe_costs import expert_choices


def tensor_sizes(model: ModelConfig, cluster: Cluster, num_gpus: int) -> tuple[int, ...]:
    """``t`` that fit in a server, divide the heads, the query groups and FFN, and divide ``N``."""
    G = cluster.devices_per_server
    return tuple(t for t in range(1, G + 1)
                 if G % t == 0 and num_gpus % t == 0 and model.num_attention_heads % t == 0
                 and model.query_groups % t == 0 and model.ffn_hidden_size % t == 0)


def pipeline_depths(model: ModelConfig, num_gpus: int, t: int, uneven: bool = False) -> tuple[int, ...]:
    """``d`` that leave a whole number of replicas and divide the layers (any ``d <= L`` when ``uneven``)."""
    return tuple(d for d in range(1, model.num_layers + 1)
                 if (uneven or model.num_layers % d == 0) and num_gpus % (t * d) == 0)


def micro_batch_sizes(limit: int) -> tuple[int, ...]:
    """Powers of two up to ``limit``."""
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    return tuple(out)


def sequence_parallel_choices(request: Any, costs: LayerCosts, t: int, b: int) -> tuple[bool, ...]:
    """The sequence-parallel settings tried at (t, b): none but off at t = 1 (nothing to shard), and only
    those the costs know (``LayerCosts.at``); costs of one setting only (a profile) are that setting."""
    if not costs.sp_table:
        return (costs.sequence_parallel and t > 1,)
    wanted = dict.fromkeys(sp and t > 1 for sp in request.sequence_parallel_choices)
    return tuple(sp for sp in wanted if costs.at(t, b, sp) is not None)


def distributed_optimizer_choices(request: Any, w: int) -> tuple[bool, ...]:
    """The optimizer settings tried over ``w`` weight replicas: sharding one replica changes nothing."""
    return tuple(o for o in dict.fromkeys(request.distributed_optimizer_options) if w > 1 or not o) or (False,)


def context_choices(request: Any, costs: LayerCosts, t: int, b: int, sp: bool, c: int) -> list[tuple[int, str] | None]:
    """At context size ``c``: ``[None]`` for 1, else each ``(c, cp_comm_type)`` of the request whose costs
    are known at (t, b, sp)."""
    if c == 1:
        return [None]
    return [(c, comm) for comm in request.cp_comm_types if costs.at(t, b, sp, (c, comm)) is not None]


def candidates(request: Any, costs: LayerCosts) -> Iterator[Candidate]:
    """Every candidate of the search space of ``request`` (a ``search.PlanRequest``; the module docstring)."""
    N, B = request.num_gpus, request.global_batch_size
    valid_t = set(tensor_sizes(request.model, request.cluster, N))
    for t in (t for t in costs.tensor_sizes() if t in valid_t):
        for c in (c for c in request.context_choices if N % (t * c) == 0):
            for d in pipeline_depths(request.model, N, t * c, request.balance_stages):
                if d > 1 or request.no_pipelining:
                    yield from _layout_candidates(request, costs, t, c, d, N // (t * c * d), B)


def _layout_candidates(request: Any, costs: LayerCosts, t: int, c: int, d: int, w: int, B: int) -> Iterator[Candidate]:
    """The candidates of one ``(t, c, d, w)``: microbatches, schedules, sequence parallelism, the context's
    communication type, the optimizer's sharding, the expert-parallel size (a model with experts: each ``e``
    dividing the experts and the ``w * c`` replicas) and recomputation, cheapest recomputation first (search())."""
    schedules = ("flush",) if d == 1 else request.schedules  # one stage: Flush stands for every schedule
    for b in costs.micro_batch_sizes(t):
        if b > request.max_micro_batch_size or B % (b * w):
            continue
        m = B // (b * w)
        for schedule, sp in ((x, y) for x in schedules for y in sequence_parallel_choices(request, costs, t, b)):
            if schedule != SEQUENTIAL and not runs(schedule, request.model.num_layers, d, m):
                continue
            for ctx in context_choices(request, costs, t, b, sp, c):
                mc = costs.at(t, b, sp, ctx)
                policies = sorted((p for p in request.recompute_policies if not _saves_nothing(p, mc)),
                                  key=lambda p: inner_recompute_cost(mc, request.model.num_layers, p)[0])
                cp = dict(context_parallel=c, cp_comm_type=ctx[1]) if ctx else {}
                for zero, e in ((z, e) for z in distributed_optimizer_choices(request, w * c)
                                for e in expert_choices(request.model, w * c, request.expert_parallel_options)):
                    kw = dict(distributed_optimizer=zero, sequence_parallel=sp, async_save=request.async_save,
                              expert_parallel=e, **cp)
                    if False in request.recompute_options:
                        yield Candidate(t, d, w, b, m, False, schedule, **kw)
                    for policy in policies:
                        yield Candidate(t, d, w, b, m, False, schedule, recompute_policy=policy, **kw)
                    if True in request.recompute_options:
                        yield Candidate(t, d, w, b, m, True, schedule, **kw)


# Selective recomputation is skipped where it frees less than this share of a layer's stash: with a
# fused attention kernel (``Cluster.flash_attention``) the core keeps no s^2 tensors, so re-running
# it costs its forward and saves next to nothing.
SELECTIVE_MIN_SAVING = 0.01


def _saves_nothing(policy: RecomputePolicy, costs: MicrobatchCosts | None) -> bool:
    """Whether ``policy`` is selective and frees (almost) none of the layer's stash."""
    return (policy.granularity == "selective" and costs is not None
            and costs.layer.core_stash_bytes < SELECTIVE_MIN_SAVING * costs.layer.stash_bytes)


def runs(schedule: str, num_layers: int, d: int, m: int) -> bool:
    """Whether the trainer would run ``schedule`` at depth ``d`` with ``m`` microbatches: its own layout rules
    (``validate_pipeline``: interleaved's m a multiple of d, zb-v's m >= 2d - 1, ...) and, with several
    chunks per rank, layers that divide evenly into the d * chunks virtual stages (uneven splits are refused
    there, so the search keeps chunked schedules on even splits)."""
    try:
        name, pv = parse_schedule_id(schedule)
        validate_pipeline(name, d, m, post_validation=pv)
    except ConfigError:
        return False
    chunks = spec_of(schedule).chunks
    return chunks == 1 or num_layers % (d * chunks) == 0
