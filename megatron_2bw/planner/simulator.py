"""Event-driven simulation of the engine's pipeline schedules, with times and memory.

The simulator replays the very action lists the engine executes (``schedules.stage_actions``), one
per stage, through the checker's replay core (``schedule/replay.py``, FIFO channels) with a clock:

- ``FORWARD`` / ``BACKWARD`` take the stage's per-microbatch time (from a profile or from the
  cost model's per-block times); with recomputation the backward includes the re-run forward.
  A split backward's ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT`` take ``input_s`` / ``weight_s``
  (half of ``backward_s`` each unless given); a microbatch's stash is held until its I, then
  ``deferred_bytes`` (what its W reads and the gradients its I caught) until its W.
- ``SEND_ACT`` / ``SEND_GRAD`` never block (the engine's ``isend``). The message occupies its
  link (one per boundary and direction) for ``bytes / bandwidth`` after the later of the send and
  the link's previous message, and arrives ``latency`` after that.
- ``RECV_ACT`` / ``RECV_GRAD`` complete at ``max(the stage's clock, the message's arrival)``: the
  engine posts receives ahead, so only the wait for the data costs time.
- ``REDUCE_GRADS(t)`` starts the stage's asynchronous reduction chain at the stage's clock. The
  chain is collective over the model group (the global gradient norm and, with several stages,
  the tied-embedding all-reduce): it is done for every stage at
  ``max_r(launch_r + reduce_s_r) + collective_s``, and chains finish in step order. It costs the
  stage ``reduce_busy_s`` of its own time (0 where the collectives have their own engines, as
  NCCL on GPUs; on a CPU, gloo's threads take that from the compute).
- ``APPLY_UPDATE(t)`` waits for chain ``t`` and then takes ``update_s`` (the optimizer step).

Outputs (:class:`SimResult`): every action's start and end per stage; the steady-state time per
step; the bubble fraction; per-stage memory over time (weights, gradients and optimizer state,
plus the stashed activations of every microbatch in flight, plus the transient of a backward).

Step boundaries: ``S_t`` is when stage 0 starts the first forward of step ``t``. The steady-state
step time is ``(S_{n-1} - S_1) / (n - 2)`` over a segment of ``n >= 3`` steps: the intervals from
step 1 on, which leaves out the first step's pipeline fill and the segment's final drain (2BW has
both only there; the flushing schedules have them inside every interval anyway). The measured
engine times are taken at the same points (``tests/test_simulator.py``).

Recomputation, as our engine does it (``recompute_scope="stage"``, which ``memory_model`` and
``cost_model`` assume too): a stage's forward runs without autograd and keeps only its input; its
backward re-runs the whole stage's forward (embedding and head included) and then the backward, so
its transient is one microbatch's full activations. ``recompute_scope="layers"`` models Megatron's
``--recompute-activations`` for comparison (only the transformer layers re-run; the embedding's and
head's stashes stay per microbatch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from ..errors import ConfigError
from ..schedule.actions import Action, Op
from ..schedule.replay import Replay, Timing
from ..schedule.schedules import get_schedule, parse_schedule_id, spec_of, stage_actions, validate_pipeline
from ..schedule.stages import Split, stage_slice
from .cost_model import boundary_bandwidth, ring_allreduce_time, stage_time, tensor_bandwidth
from .hardware import Cluster
from .layer_costs import BlockCost, MicrobatchCosts
from .memory_model import Candidate, ParamBytes, deferred_bytes, rank_slice, stage_memory, stage_params

RECOMPUTE_SCOPES = ("stage", "layers")


# ---- inputs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCosts:
    """One stage's costs per microbatch (seconds, bytes)."""

    forward_s: float
    backward_s: float
    update_s: float = 0.0           # APPLY_UPDATE: the optimizer step
    reduce_s: float = 0.0           # REDUCE_GRADS: the stage's asynchronous gradient reductions
    reduce_busy_s: float = 0.0      # of which the stage's own processor is busy (CPU collectives)
    output_bytes: int = 0           # what SEND_ACT sends (and the next stage's SEND_GRAD sends back)
    static_bytes: int = 0           # weights (every version), gradients, optimizer state
    stash_bytes: int = 0            # kept per microbatch from its FORWARD's end to its BACKWARD's end
    backward_extra_bytes: int = 0   # held while a BACKWARD runs (recomputed activations)
    workspace_bytes: int = 0        # held while any FORWARD / BACKWARD runs
    input_s: float | None = None    # BACKWARD_INPUT of a split backward; None: half of backward_s
    weight_s: float | None = None   # BACKWARD_WEIGHT; None: half of backward_s
    # held from a split backward's I to its W in place of the stash (the engine frees at I what W does not
    # read); None: the stash and the recomputed activations stay until W
    deferred_bytes: int | None = None

    def __post_init__(self) -> None:
        for k in ("forward_s", "backward_s", "update_s", "reduce_s", "reduce_busy_s", "input_s", "weight_s"):
            v = getattr(self, k)
            if v is None:
                continue
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"stage cost {k} must be a finite number >= 0, got {v}")


@dataclass(frozen=True)
class Link:
    """One direction of one stage boundary."""

    bandwidth: float = math.inf  # bytes/s
    latency_s: float = 0.0

    def occupancy(self, nbytes: int) -> float:
        return nbytes / self.bandwidth if nbytes and math.isfinite(self.bandwidth) else 0.0


# ---- outputs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """One executed action of one stage. Receives record the wait for their message."""

    stage: int
    op: Op
    mb: int
    step: int
    version: int
    start: float
    end: float
    chunk: int = 0  # the rank's model chunk (interleaved schedules)

    @property
    def label(self) -> str:
        return str(Action(self.op, self.mb, self.step, self.version, self.chunk))


@dataclass
class SimResult:
    """What :func:`simulate` returns; times in seconds, memory in bytes per GPU."""

    schedule: str
    d: int
    m: int
    first_step: int
    num_steps: int
    events: list[list[Event]]                    # per stage, in program order
    step_starts: list[float]                     # S_t: stage 0 starts step t's first forward
    makespan: float
    memory: list[list[tuple[float, int]]]        # per stage: (time, bytes) after each change
    activation_memory: list[list[tuple[float, int]]]
    static_bytes: list[int]

    @property
    def step_time_s(self) -> float:
        """Steady-state time per step (see the module docstring)."""
        s, n = self.step_starts, self.num_steps
        if n >= 3:
            return (s[-1] - s[1]) / (n - 2)
        if n == 2:
            return s[1] - s[0]
        return self.makespan

    @property
    def window(self) -> tuple[float, float]:
        """The steady-state interval the step time and the bubble are measured over."""
        s, n = self.step_starts, self.num_steps
        if n >= 3:
            return s[1], s[-1]
        if n == 2:
            return s[0], s[1]
        return 0.0, self.makespan

    def busy_s(self, stage: int, ops=(Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT,
                                       Op.APPLY_UPDATE, Op.REDUCE_GRADS)) -> float:
        """Time ``stage`` spends in ``ops`` inside the steady-state window."""
        lo, hi = self.window
        return sum(max(0.0, min(e.end, hi) - max(e.start, lo)) for e in self.events[stage] if e.op in ops)

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the stages over the steady-state window: neither computing, updating,
        nor busy with a reduction (waiting for messages or for the pipeline)."""
        lo, hi = self.window
        if hi <= lo:
            return 0.0
        return 1.0 - sum(self.busy_s(r) for r in range(self.d)) / (self.d * (hi - lo))

    @property
    def peak_bytes(self) -> list[int]:
        return [max(b for _, b in mem) for mem in self.memory]

    @property
    def peak_activation_bytes(self) -> list[int]:
        """Per stage: most bytes of stashed activations (plus a backward's recomputed ones) at once;
        what the engine measures as ``stats.peak_stashed_bytes``."""
        return [max(b for _, b in mem) for mem in self.activation_memory]

    @property
    def max_inflight(self) -> list[int]:
        out = []
        for evs in self.events:
            n = best = 0
            for e in evs:
                if e.op is Op.FORWARD:
                    n += 1
                    best = max(best, n)
                elif e.op is Op.BACKWARD or e.op is Op.BACKWARD_WEIGHT:
                    n -= 1
            out.append(best)
        return out

    def summary(self) -> dict:
        return {
            "schedule": self.schedule, "d": self.d, "m": self.m, "num_steps": self.num_steps,
            "step_time_s": self.step_time_s, "bubble_fraction": self.bubble_fraction, "makespan_s": self.makespan,
            "step_starts_s": self.step_starts, "peak_bytes": self.peak_bytes,
            "peak_activation_bytes": self.peak_activation_bytes, "static_bytes": self.static_bytes,
            "max_inflight": self.max_inflight,
        }


# ---- the simulation -----------------------------------------------------------------------------

class SimulationError(RuntimeError):
    """The action lists deadlock or do not match (the checker would have refused them)."""


def _timing(stages: Sequence[StageCosts], links: Sequence[Link], collective_s: float) -> Timing:
    """The replay's clock: per-stage costs; a boundary's message is the sending side's output."""
    return Timing(
        forward_s=[s.forward_s for s in stages], backward_s=[s.backward_s for s in stages],
        input_s=[s.backward_s / 2 if s.input_s is None else s.input_s for s in stages],
        weight_s=[s.backward_s / 2 if s.weight_s is None else s.weight_s for s in stages],
        update_s=[s.update_s for s in stages], reduce_s=[s.reduce_s for s in stages],
        reduce_busy_s=[s.reduce_busy_s for s in stages],
        transfer_s=[link.occupancy(stages[b].output_bytes) for b, link in enumerate(links)],
        latency_s=[link.latency_s for link in links], collective_s=collective_s,
    )


def _memory(events: list[Event], st: StageCosts,
            chunks: int = 1) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(total, activations) over time: a FORWARD's stash is held until its BACKWARD (or W) ends; a
    backward also holds its recomputed activations (a split one from its I to its W), and any compute
    its workspace. With ``chunks`` chunks per rank each chunk's stash and backward transient are the
    stage's divided by ``chunks``."""
    total, acts = [(0.0, st.static_bytes)], [(0.0, 0)]
    stash: dict[tuple[int, int], int] = {}
    held = 0
    stash_bytes, extra_bytes = st.stash_bytes // chunks, st.backward_extra_bytes // chunks

    def record(t: float, activations: int, transient: int = 0) -> None:
        acts.append((t, activations))
        total.append((t, st.static_bytes + activations + transient))

    for e in events:
        if e.op is Op.FORWARD:
            if st.workspace_bytes:
                total.append((e.start, st.static_bytes + held + st.workspace_bytes))
            stash[(e.mb, e.chunk)] = stash_bytes
            held += stash_bytes
            record(e.end, held)
        elif e.op is Op.BACKWARD:
            record(e.start, held + extra_bytes, st.workspace_bytes)
            held -= stash.pop((e.mb, e.chunk), 0)
            record(e.end, held)
        elif e.op is Op.BACKWARD_INPUT:  # what W reads (or all its activations) stays until W
            key = (e.mb, e.chunk)
            record(e.start, held + extra_bytes, st.workspace_bytes)
            kept = stash.get(key, 0) + extra_bytes if st.deferred_bytes is None else st.deferred_bytes // chunks
            held += kept - stash.get(key, 0)
            stash[key] = kept
            record(e.end, held)
        elif e.op is Op.BACKWARD_WEIGHT:
            total.append((e.start, st.static_bytes + held + st.workspace_bytes))
            held -= stash.pop((e.mb, e.chunk), 0)
            record(e.end, held)
    return total, acts


def _links(links: Sequence[Link] | Link | None, d: int) -> Sequence[Link]:
    if links is None or isinstance(links, Link):
        links = [links or Link()] * max(d - 1, 0)
    if len(links) != max(d - 1, 0):
        raise ConfigError(f"need {d - 1} links for {d} stages, got {len(links)}")
    return links


def simulate(
    schedule: str, d: int, m: int, stages: Sequence[StageCosts], *, num_steps: int = 6, first_step: int = 0,
    links: Sequence[Link] | Link | None = None, collective_s: float = 0.0,
    actions: Sequence[Sequence[Action]] | None = None, chunks: int | None = None,
) -> SimResult:
    """Run every stage's action list with times; see the module docstring.

    ``chunks``: model chunks per rank for a schedule that takes a count (interleaved-1f1b; None: its own).
    ``stages`` then still give a whole rank's costs per microbatch; each chunk's compute, stash and
    transient are 1/chunks of them (equal chunks, as the even split makes them), and a transfer between
    rank d-1 and rank 0 (the next chunk) costs like the last boundary's.

    ``links[i]`` is the boundary between stages ``i`` and ``i+1`` (both directions alike); one
    ``Link`` applies to every boundary; ``None`` makes transfers free. ``actions`` overrides the
    generated programs (for hand-made schedules; they must pass the checker).
    """
    name, pv = parse_schedule_id(schedule)  # a schedule id: ``zb-h2+pv`` runs zb-h2 with post-validation
    validate_pipeline(name, d, m, chunks, pv)
    spec = get_schedule(name, chunks, pv)
    v = spec.chunks
    if len(stages) != d:
        raise ConfigError(f"need costs for {d} stages, got {len(stages)}")
    if num_steps < 1:
        raise ConfigError(f"simulate at least one step, got num_steps={num_steps}")
    timing = _timing(stages, _links(links, d), collective_s)
    if v > 1:
        timing = replace(timing, forward_s=[x / v for x in timing.forward_s],
                         backward_s=[x / v for x in timing.backward_s],
                         input_s=[x / v for x in timing.input_s], weight_s=[x / v for x in timing.weight_s])
    progs = [list(a) for a in actions] if actions is not None else [
        stage_actions(name, d, r, m, first_step, num_steps, chunks, pv) for r in range(d)]
    trace = Replay(progs, timing=timing, error=SimulationError, placement=spec.placement(d)).run()
    events = [[Event(r, a.op, a.mb, a.step, a.version, trace.start(r, i), trace.end[r][i], a.chunk)
               for i, a in enumerate(prog)] for r, prog in enumerate(progs)]
    step_starts: dict[int, float] = {}
    for e in events[0]:
        if e.op is Op.FORWARD and e.mb % m == 0 and e.chunk == 0:
            step_starts.setdefault(e.step, e.start)
    memory = [_memory(evs, st, v) for evs, st in zip(events, stages)]
    starts = [step_starts[t] for t in range(first_step, first_step + num_steps)]
    return SimResult(schedule, d, m, first_step, num_steps, events, starts, trace.makespan,
                     [mem for mem, _ in memory], [act for _, act in memory], [s.static_bytes for s in stages])


# ---- stage costs from block costs ---------------------------------------------------------------

Blocks = list[tuple[str, BlockCost, int]]  # (name, per-block costs, how many on the stage)


def _stage_blocks(costs: MicrobatchCosts, num_layers: int, d: int, r: int, split: Split = None,
                  cand: Candidate | None = None) -> Blocks:
    part = stage_slice(num_layers, d, r, split) if cand is None else rank_slice(num_layers, cand, r)
    blocks: Blocks = [("layer", costs.layer, part.num_layers)]
    if part.embedding:
        blocks.insert(0, ("embedding", costs.embedding, 1))
    if part.head:
        blocks.append(("head", costs.head, 1))
    return blocks


@dataclass(frozen=True)
class _Work:
    """One stage's compute per microbatch, before tensor-parallel communication."""

    forward_s: float
    backward_s: float
    tp_forward_bytes: int
    tp_backward_bytes: int
    stash_bytes: int
    backward_extra_bytes: int


def _stage_work(costs: MicrobatchCosts, blocks: Blocks, first: bool, recompute: str | None,
                nograd: Mapping[str, float]) -> _Work:
    """``recompute``: None, ``"stage"`` (the engine: the whole stage re-runs from its input) or
    ``"layers"`` (Megatron: the layers re-run; embedding and head keep their stashes)."""
    fwd = sum(n * b.forward_s for _, b, n in blocks)
    bwd = sum(n * b.backward_s for _, b, n in blocks)
    full_stash = sum(n * b.stash_bytes for _, b, n in blocks) + (costs.embedding.input_bytes if first else 0)
    tp_f = sum(n * b.tp_allreduce_forward_bytes for _, b, n in blocks)
    tp_b = sum(n * b.tp_allreduce_backward_bytes for _, b, n in blocks)
    if recompute == "stage":
        first_fwd = sum(n * nograd.get(name, b.forward_s) for name, b, n in blocks)
        stage_input = costs.embedding.input_bytes if first else costs.layer.input_bytes
        return _Work(first_fwd, bwd + fwd, tp_f, tp_b + tp_f, stage_input, full_stash)
    if recompute == "layers":
        _, lay, n = next(x for x in blocks if x[0] == "layer")
        edge = full_stash - n * lay.stash_bytes
        fwd_nograd = fwd - n * lay.forward_s + n * nograd.get("layer", lay.forward_s)
        return _Work(fwd_nograd, bwd + n * lay.forward_s, tp_f, tp_b + n * lay.tp_allreduce_forward_bytes,
                     costs.layer.input_bytes + edge, n * lay.stash_bytes)
    return _Work(fwd, bwd, tp_f, tp_b, full_stash, 0)


def _per_stage(x: Sequence[float] | float | None, r: int) -> float:
    if x is None:
        return 0.0
    return float(x[r]) if isinstance(x, Sequence) else float(x)


def stage_costs(
    costs: MicrobatchCosts, cand: Candidate, num_layers: int, *, recompute_scope: str = "stage",
    forward_nograd_s: Mapping[str, float] | None = None, update_s: Sequence[float] | float | None = None,
    reduce_s: Sequence[float] | float = 0.0, tensor_bandwidth_Bps: float | None = None,
    param_bytes: ParamBytes | None = None,
) -> list[StageCosts]:
    """Per-stage costs of ``cand`` (one pipeline: ``t`` and ``w`` only change the per-GPU numbers).

    ``forward_nograd_s``: per block (``embedding``/``layer``/``head``), the forward without autograd
    that a recomputing stage runs first (a profile measures it; default the training forward).
    ``update_s``/``reduce_s``: per stage (or one number for all); ``update_s=None`` leaves updates free.
    ``tensor_bandwidth_Bps``: adds the tensor-parallel all-reduces of ``tp_allreduce_*_bytes``.
    """
    if recompute_scope not in RECOMPUTE_SCOPES:
        raise ConfigError(f"recompute_scope must be one of {', '.join(RECOMPUTE_SCOPES)}, got {recompute_scope!r}")
    d, t = cand.pipeline_parallel, cand.tensor_parallel
    pb = param_bytes or ParamBytes()
    out = []
    for r in range(d):
        blocks = _stage_blocks(costs, num_layers, d, r, cand.layer_split, cand)
        w = _stage_work(costs, blocks, r == 0, recompute_scope if cand.recompute else None, forward_nograd_s or {})
        fwd, bwd = w.forward_s, w.backward_s
        if tensor_bandwidth_Bps and t > 1:
            fwd += ring_allreduce_time(w.tp_forward_bytes, t, tensor_bandwidth_Bps)
            bwd += ring_allreduce_time(w.tp_backward_bytes, t, tensor_bandwidth_Bps)
        sm = stage_memory(costs, cand, num_layers, r, pb)
        out.append(StageCosts(
            forward_s=fwd, backward_s=bwd, update_s=_per_stage(update_s, r), reduce_s=_per_stage(reduce_s, r),
            output_bytes=0 if r == d - 1 else costs.layer.output_bytes,
            static_bytes=sm.weights + sm.second_weights + sm.grads + sm.optimizer,
            stash_bytes=w.stash_bytes, backward_extra_bytes=w.backward_extra_bytes,
            workspace_bytes=max(b.workspace_bytes for _, b, n in blocks if n),
            # a split backward: the engine's first stage sends no gradient, so its W runs the whole backward
            input_s=0.0 if r == 0 else None, weight_s=bwd if r == 0 else None,
            deferred_bytes=_deferred(costs, cand, num_layers, r, w.stash_bytes),
        ))
    return out


def _deferred(costs: MicrobatchCosts, cand: Candidate, num_layers: int, r: int, stash: int) -> int | None:
    """What a split-backward stage's microbatch keeps from I to W (``memory_model.deferred_bytes``); None
    for whole backwards."""
    if not spec_of(cand.schedule).split_backward:
        return None
    return deferred_bytes(costs, cand, rank_slice(num_layers, cand, r), stash)


def cluster_links(cand: Candidate, cluster: Cluster) -> list[Link]:
    """The boundaries' per-GPU bandwidths of the cost model (``cost_model.boundary_bandwidth``)."""
    t, w = cand.tensor_parallel, cand.replicas
    return [Link(boundary_bandwidth(t, w, i, cluster)) for i in range(cand.pipeline_parallel - 1)]


def simulate_plan(
    costs: MicrobatchCosts, cand: Candidate, num_layers: int, cluster: Cluster, *, num_steps: int = 6,
    param_bytes: ParamBytes | None = None, recompute_scope: str = "stage",
    forward_nograd_s: Mapping[str, float] | None = None, optimizer=None,
) -> SimResult:
    """Simulate ``cand`` with the cost model's terms: block times per stage, p2p over the cluster's
    links, the data-parallel and tied-embedding all-reduces as the reduction chain, and the
    optimizer step (``optimizer``: a measured ``profiler.OptimizerCost``, else the cost model's
    memory-bandwidth estimate)."""
    pb = param_bytes or ParamBytes()
    d = cand.pipeline_parallel
    links = cluster_links(cand, cluster)
    inf = math.inf
    terms = [stage_time(costs, cand, num_layers, r, cluster, links[r - 1].bandwidth if r > 0 else inf,
                        links[r].bandwidth if r < d - 1 else inf, pb) for r in range(d)]
    if optimizer is not None:
        update = [optimizer.seconds(stage_params(costs, num_layers, d, r, cand.layer_split)) for r in range(d)]
    else:
        update = [s.optimizer_s for s in terms]
    stages = stage_costs(costs, cand, num_layers, recompute_scope=recompute_scope, forward_nograd_s=forward_nograd_s,
                         update_s=update, reduce_s=[s.allreduce_s for s in terms],
                         tensor_bandwidth_Bps=tensor_bandwidth(cand.tensor_parallel, cluster), param_bytes=pb)
    return simulate(cand.schedule, d, cand.num_micro_batches, stages, num_steps=num_steps, links=links)
