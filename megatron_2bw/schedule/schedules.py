"""Pipeline schedules as data: one :class:`ScheduleSpec` per schedule, the only place schedule facts live.

A spec carries what every other module needs to know about its schedule: weight versions and gradient
buffers the executor keeps, how stale the weights are, the microbatches it needs and keeps in flight,
its ideal bubble, and the generator of each stage's ordered actions for a drained segment of steps.
Generating the whole program up front lets the checker prove deadlock freedom, the in-flight bound and
the exact 2BW weight-version semantics for every (d, m) before a process runs it, and lets the executor
be a dumb loop.

Conventions (see :class:`~megatron_2bw.schedule.actions.Action`): microbatches of step ``t`` are
``t*m .. t*m+m-1``; RECV_ACT(i) sits just before FORWARD(i), SEND_ACT(i) just after it; RECV_GRAD(j)
just before BACKWARD(j), SEND_GRAD(j) just after it; stage 0 has no RECV_ACT / SEND_GRAD, stage d-1
no SEND_ACT / RECV_GRAD. A schedule that splits its backward (``split_backward``) runs BACKWARD_INPUT(j)
in BACKWARD(j)'s place, between the same transfers, and BACKWARD_WEIGHT(j) on its own later.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import ConfigError
from .actions import Action, Op
from .placement import Placement
from .replay import Replay, Timing

Order = list[tuple[bool, int]]  # (is_forward, microbatch) in the order a stage runs them


@functools.lru_cache(maxsize=1 << 16)
def _fragment(forward: bool, mb: int, step: int, version: int, has_prev: bool, has_next: bool,
              chunk: int = 0) -> tuple[Action, ...]:
    """One compute action with the point-to-point communication wrapped around it.

    Interned: every stage (and every (d, m) with the same m) shares these immutable
    objects, which keeps generating all schedules for the exhaustive checker cheap.
    ``has_prev``/``has_next``: whether the chunk's virtual stage has a stage before / after it.
    """
    c = chunk
    if forward:
        recv = (Action(Op.RECV_ACT, mb, step, chunk=c),) if has_prev else ()
        send = (Action(Op.SEND_ACT, mb, step, chunk=c),) if has_next else ()
        return (*recv, Action(Op.FORWARD, mb, step, version, c), *send)
    recv = (Action(Op.RECV_GRAD, mb, step, chunk=c),) if has_next else ()
    send = (Action(Op.SEND_GRAD, mb, step, chunk=c),) if has_prev else ()
    return (*recv, Action(Op.BACKWARD, mb, step, version, c), *send)


def _one_f_one_b(lo: int, count: int, warmup: int) -> Order:
    """Order of 1F1B over microbatches lo..lo+count-1 with ``warmup`` forwards first."""
    warmup = min(warmup, count)
    order = [(True, lo + i) for i in range(warmup)]
    for i in range(count - warmup):
        order.append((True, lo + warmup + i))
        order.append((False, lo + i))
    order.extend((False, i) for i in range(lo + count - warmup, lo + count))
    return order


@dataclass(frozen=True)
class ScheduleSpec:
    """A flushing 1F1B schedule (PipeDream-Flush); subclasses change what differs.

    ``grad_buffers``: gradient buffers the executor keeps (2 lets step t+1's backwards accumulate
    while step t's reduction runs); ``stale_steps``: how many updates behind the newest weights a
    step's microbatches run.
    """

    name: str
    weight_versions: int = 1
    grad_buffers: int = 1
    stale_steps: int = 0
    chunks: int = 1  # model chunks (virtual stages) per rank: 2 for interleaved and V layouts
    split_backward: bool = False  # backwards run as BACKWARD_INPUT then BACKWARD_WEIGHT (zero-bubble)
    # optimizer post-validation (--enable-optimizer-post-validation, :meth:`with_post_validation`): each update
    # but a segment's last is speculative, checked against the global norm in the next step's warm-up
    post_validation: bool = False

    def min_microbatches(self, d: int) -> int:
        """Fewest microbatches per step the schedule runs at depth ``d``."""
        return 1

    def inflight(self, d: int, r: int, m: int) -> int:
        """Most microbatches stage ``r`` holds forwarded but not backwarded (activation stashes).

        Counted as the checker counts them, per FORWARD action: with ``chunks`` > 1 in chunk-microbatches
        (each ``1/chunks`` of the rank's stash; the planner converts), and with a split backward until the
        input gradient (what waits for W is ``deferred_weight_grads``)."""
        return min(d - r, m)

    def bubble(self, d: int, m: int) -> float:
        """Ideal idle fraction per step with equal-cost microbatches: a fill and a drain every step."""
        return (d - 1) / (m + d - 1)

    def bubble_slots(self, d: int) -> float:
        """Extra microbatch slots per step: the fill and the drain."""
        return d - 1

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """Ideal idle time per step of a stage whose forward, input-gradient half and weight-gradient
        half of one microbatch (all of the rank's chunks together) take ``f``, ``b`` and ``w`` seconds
        (a whole backward is ``b + w``): what the planner prices. Schedules that split the backward or
        interleave chunks override it (ZB-H1: ``(d - 1) * (f + b - w)``)."""
        return self.bubble_slots(d) * (f + b + w)

    def deferred_weight_grads(self, d: int, r: int, m: int) -> int:
        """Most microbatches stage ``r`` holds input-gradient-done but weight-gradient-pending (their
        layer inputs and output gradients stay alive until W): 0 unless the backward is split."""
        return 0

    def held_pairs(self, d: int, r: int, m: int) -> tuple[tuple[int, int], ...]:
        """The (forwarded, not input-gradiented; input-gradiented, not weight-gradiented) counts stage ``r``
        holds at the moments that can be its memory peak (the Pareto front over its order): a microbatch
        keeps its whole stash until its I and only what its W reads after it, so the peak is the largest
        ``a * stash + b * deferred`` over these pairs. Without a split backward: one pair, ``(inflight, 0)``."""
        return ((self.inflight(d, r, m), 0),)

    def placement(self, d: int) -> Placement:
        """Which rank holds which virtual stage at depth ``d`` (one chunk: stage ``r`` on rank ``r``)."""
        return Placement(d, self.chunks)

    def with_chunks(self, chunks: int | None) -> ScheduleSpec:
        """This schedule with ``chunks`` model chunks per rank (None: its own); only schedules built for
        virtual stages take another count."""
        if chunks is None or chunks == self.chunks:
            return self
        raise ConfigError(f"pipeline schedule {self.name} runs {self.chunks} model chunk(s) per rank, not {chunks} "
                          "(--virtual-pipeline-model-parallel-size needs --pipeline-schedule interleaved-1f1b)")

    def with_post_validation(self, on: bool) -> ScheduleSpec:
        """This schedule with optimizer post-validation ``on``: only the zero-bubble schedules take it, whose step
        starts with forwards of the first chunk on every stage (what a speculative update overlaps; see
        :func:`_post_validated`), with one chunk or in a V (its first chunk's stages are the ranks in order)."""
        if on == self.post_validation:
            return self
        if on and not (self.split_backward and (self.chunks == 1 or self.placement(2).shape == "v")):
            raise ConfigError(f"--enable-optimizer-post-validation applies to the zero-bubble schedules "
                              f"(zb-h1, zb-h2, zb-v), not {self.name}")
        return replace(self, post_validation=on)

    def check_layout(self, d: int, m: int) -> None:
        """Refuse (one line) a depth / microbatch count the schedule's own rules exclude (beyond
        :meth:`min_microbatches`): nothing by default."""

    def version(self, step: int) -> int:
        """The weight version W(v) every microbatch of ``step`` runs on (forward and backward)."""
        return max(step - self.stale_steps, 0)

    def order(self, d: int, r: int, lo: int, count: int) -> Order:
        """Forward/backward order of stage ``r`` over ``count`` microbatches from ``lo``."""
        return _one_f_one_b(lo, count, d - r - 1)

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        """Stage ``r``'s ordered actions for a drained segment (unvalidated: see :func:`stage_actions`).

        A flushing schedule fills, drains, reduces and applies each step on its own."""
        out: list[Action] = []
        for t in range(first_step, first_step + num_steps):
            v = self.version(t)
            for forward, mb in self.order(d, r, t * m, m):
                out.extend(_fragment(forward, mb, t, v, r > 0, r < d - 1))
            out.append(Action(Op.REDUCE_GRADS, step=t))
            out.append(Action(Op.APPLY_UPDATE, step=t))
        return out


@dataclass(frozen=True)
class _GPipe(ScheduleSpec):
    """GPipe: every forward of a step, then every backward; all ``m`` stashes held at once."""

    def inflight(self, d: int, r: int, m: int) -> int:
        return m

    def order(self, d: int, r: int, lo: int, count: int) -> Order:
        return [(True, lo + i) for i in range(count)] + [(False, lo + i) for i in range(count)]


@dataclass(frozen=True)
class _TwoBW(ScheduleSpec):
    """PipeDream-2BW: one 1F1B stream across step boundaries, weights one update stale.

    With fewer than ``d`` microbatches a step's in-flight work would span more than two versions.
    """

    def min_microbatches(self, d: int) -> int:
        return d

    def bubble(self, d: int, m: int) -> float:
        return 0.0  # fill and drain only at the start and at a drain before a checkpoint

    def bubble_slots(self, d: int) -> int:
        return 0

    @staticmethod
    def update_forward(d: int, m: int) -> int:
        """APPLY_UPDATE(t) goes just before the forward of microbatch (t+1)*m + k (its RECV_ACT stays
        glued to the forward): k = d - 1 + ceil((m - d + 1) / 2), in [d, m].

        Stage 0, the last to finish step t, runs m - d + 1 forwards between REDUCE_GRADS(t) and the
        first forward that needs W(t+1) (step t+2's first, k = m). The update goes half-way through
        them: the reductions hide behind the first half, and the distributed optimizer's all-gather
        of W(t+1), which the update issues, behind the second. At m = d that is step t+2's first
        forward. k >= d keeps it after step t's last backward and step t+1's first on every stage,
        so W(t-1)'s buffer is free and step t+1's loss scale fixed on every stage before it."""
        return d - 1 + -(-(m - d + 1) // 2)

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        """REDUCE_GRADS(t) follows step t's last backward, so the reductions start at once;
        APPLY_UPDATE(t) (which makes W(t+1)) comes at most as late as just before the first
        forward that needs W(t+1), the first of step t+2 (:meth:`update_forward` says where), so
        the reductions hide behind step t+1's compute; but never after REDUCE_GRADS(t+1): at
        m = d the last stage, which has no warm-up, reaches step t+2's first forward only after
        step t+1's last backward, and APPLY_UPDATE(t) goes just before REDUCE_GRADS(t+1) instead.
        The distributed optimizer's all-gather of W(t+1), which APPLY_UPDATE(t) issues, then runs on the reducer's ordered worker before chain(t+1), not
        behind it (chain(t+1) ends only when stage 0 has finished step t+1, (d-1) backward slots
        later, and the last stage's next forward waits for the all-gather). Updates still pending
        at the end of the segment are applied after the last action, leaving it drained."""
        out: list[Action] = []
        has_prev, has_next = r > 0, r < d - 1
        next_update = first_step  # APPLY_UPDATE(first_step - 1) ran at the end of the previous segment
        versions = {t: self.version(t) for t in range(first_step, first_step + num_steps)}
        k = self.update_forward(d, m)
        for forward, mb in self.order(d, r, first_step * m, num_steps * m):
            t, i = divmod(mb, m)
            u = (mb - k) // m - 1  # the update that goes before this forward, if (mb - k) % m == 0
            if forward and (mb - k) % m == 0 and u >= next_update:
                out.append(Action(Op.APPLY_UPDATE, step=u))
                next_update = u + 1
            out.extend(_fragment(forward, mb, t, versions[t], has_prev, has_next))
            if not forward and i == m - 1:
                if t - 1 >= next_update:  # the last stage (no warm-up): see the docstring
                    out.append(Action(Op.APPLY_UPDATE, step=t - 1))
                    next_update = t
                out.append(Action(Op.REDUCE_GRADS, step=t))
        out.extend(Action(Op.APPLY_UPDATE, step=t) for t in range(next_update, first_step + num_steps))
        return out


@dataclass(frozen=True)
class _Interleaved(ScheduleSpec):
    """Interleaved 1F1B (Narayanan et al. 2021; Megatron-Core's and ``torch.distributed.pipelining``'s
    ``ScheduleInterleaved1F1B``): each rank holds ``chunks`` = v model chunks, chunk c of rank r being
    virtual stage c*d + r, and flushes every step (one weight version, no stale gradient).

    The order is Megatron's (and torch's when m is a multiple of d, which Megatron requires): the k-th
    forward of every rank is chunk ``(k // d) % v`` of microbatch ``(k // (d*v)) * d + k % d`` (groups of d
    microbatches go through one chunk, then the next: depth first), the k-th backward the same with the
    chunks reversed; rank r runs ``(v-1)*d + 2*(d-1-r)`` warm-up forwards, then one forward and one
    backward alternately, then the remaining backwards. Ideal bubble: the 1F1B fill and drain of
    (d - 1) slots shrink v-fold, since a slot is one chunk's work: ``(d-1) / (v*m)`` of the step's work.

    **Units.** :meth:`inflight` counts stashes of *one chunk's* activations (a chunk holds 1/v of the rank's
    layers), as the executor's stash and the checker count them; in whole-rank microbatches (what
    :meth:`ScheduleSpec.inflight` means for the one-chunk schedules) that is ``inflight / v``: rank 0 holds
    ``min((v-1)*d + 2*(d-1) + 1, v*m)`` chunk stashes, ``d + (d-1)/v`` whole-rank microbatches when m is
    large, against 1F1B's ``d`` (Megatron's "interleaving needs more activation memory").
    """

    chunks: int = 2

    def min_microbatches(self, d: int) -> int:
        return d

    def check_layout(self, d: int, m: int) -> None:
        if d < 2:
            raise ConfigError("interleaved-1f1b needs --pipeline-model-parallel-size >= 2 (with one stage there is "
                              "nothing to interleave)")
        if m % d:
            raise ConfigError(f"interleaved-1f1b needs the microbatches per step to be a multiple of the pipeline "
                              f"depth (as Megatron requires): m={m}, d={d}")

    def with_chunks(self, chunks: int | None) -> ScheduleSpec:
        if chunks is None or chunks == self.chunks:
            return self
        if chunks < 1:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {chunks}")
        return replace(self, chunks=chunks)

    def warmup(self, d: int, r: int, m: int) -> int:
        """Forwards rank ``r`` runs before its first backward (Megatron's ``num_warmup_microbatches``)."""
        return min((self.chunks - 1) * d + 2 * (d - 1 - r), self.chunks * m)

    def inflight(self, d: int, r: int, m: int) -> int:
        """Most chunk-activation stashes rank ``r`` holds at once (see the class docstring for the unit)."""
        return min(self.warmup(d, r, m) + 1, self.chunks * m)

    def bubble(self, d: int, m: int) -> float:
        """Idle fraction of the step: (d - 1) chunk slots of fill and drain beside v*m; relative to the
        work alone that is the paper's ``(d - 1) / (v * m)``."""
        return (d - 1) / (self.chunks * m + d - 1)

    def bubble_slots(self, d: int) -> float:
        """In whole-rank microbatch slots: (d - 1) chunk slots are ``(d - 1) / v`` of them."""
        return (d - 1) / self.chunks

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """(d - 1) slots of one chunk's forward and backward: ``(d - 1) * (f + b + w) / v``."""
        return (d - 1) * (f + b + w) / self.chunks

    def order_chunks(self, d: int, r: int, lo: int, m: int) -> list[tuple[bool, int, int]]:
        """(is_forward, chunk, microbatch) of rank ``r`` over the step's microbatches ``lo .. lo+m-1``."""
        return [(op is Op.FORWARD, c, j) for rnd in self.rounds(d, r, lo, m) for op, c, j in rnd]

    def rounds(self, d: int, r: int, lo: int, m: int) -> list[Round]:
        """The order cut where Megatron communicates: one forward per warm-up round, a forward and a
        backward per steady round, one backward per cool-down round."""
        v = self.chunks
        total, warm = v * m, self.warmup(d, r, m)

        def fwd(k: int) -> tuple[Op, int, int]:
            return Op.FORWARD, (k // d) % v, lo + (k // (d * v)) * d + k % d

        def bwd(k: int) -> tuple[Op, int, int]:
            return Op.BACKWARD, v - 1 - (k // d) % v, lo + (k // (d * v)) * d + k % d

        out = [(fwd(k),) for k in range(warm)]
        out.extend((fwd(warm + k), bwd(k)) for k in range(total - warm))
        out.extend((bwd(k),) for k in range(total - warm, total))
        return out

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        """Each step fills, drains, reduces and applies on its own, like Flush; its transfers are placed
        in rounds (:func:`lower_rounds`)."""
        rounds = lower_rounds(self.placement(d), tuple(tuple(self.rounds(d, q, 0, m)) for q in range(d)))[r]
        return _flushed_steps(self, rounds, m, first_step, num_steps)


SplitOrder = list[tuple[Op, int]]  # (FORWARD, BACKWARD_INPUT or BACKWARD_WEIGHT, microbatch of the step)


@functools.lru_cache(maxsize=1 << 16)
def _split_fragment(op: Op, mb: int, step: int, version: int, has_prev: bool, has_next: bool) -> tuple[Action, ...]:
    """A split schedule's compute action with its transfers: F as in :func:`_fragment`; I between the
    next stage's gradient and the send of its own (SEND_GRAD follows I, not W); W alone."""
    if op is Op.FORWARD:
        return _fragment(True, mb, step, version, has_prev, has_next)
    if op is Op.BACKWARD_WEIGHT:
        return (Action(op, mb, step, version),)
    recv = (Action(Op.RECV_GRAD, mb, step),) if has_next else ()
    send = (Action(Op.SEND_GRAD, mb, step),) if has_prev else ()
    return (*recv, Action(op, mb, step, version), *send)


@dataclass(frozen=True)
class _ZeroBubble(ScheduleSpec):
    """Zero-bubble schedules (Qi et al., ICLR 2024): the backward split into I (input gradient) and W
    (weight gradient), W deferred into what would be bubble. Synchronous: one weight version, a flush
    per step. A microbatch is in flight from its F to its W: its whole stash until I, what W reads of it
    after (``saved_release``)."""

    split_backward: bool = True

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        """Stage ``r``'s F/I/W order over one step's microbatches ``0 .. m-1``."""
        raise NotImplementedError

    def order(self, d: int, r: int, lo: int, count: int) -> Order:
        """Forwards and input gradients (the whole-backward view of :meth:`split_order`)."""
        return [(op is Op.FORWARD, lo + i) for op, i in self.split_order(d, r, count) if op is not Op.BACKWARD_WEIGHT]

    def inflight(self, d: int, r: int, m: int) -> int:
        return min(self.inflight_bound(d, r), m)

    def inflight_bound(self, d: int, r: int) -> int:
        raise NotImplementedError

    @functools.lru_cache(maxsize=1 << 14)  # noqa: B019 - specs are frozen module-level singletons
    def deferred_weight_grads(self, d: int, r: int, m: int) -> int:
        """Most microbatches between their I and their W at once, counted on the generated order
        (cached: the planner's memory model asks for every stage of every candidate). Past
        ``REPLAY_MICROBATCHES * d`` microbatches the steady state only repeats, so the count is taken
        there (``tests/test_zero_bubble.py`` checks it against the full order)."""
        return _peak((op for op, _ in self.split_order(d, r, min(m, REPLAY_MICROBATCHES * d))),
                     Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    def held_pairs(self, d: int, r: int, m: int) -> tuple[tuple[int, int], ...]:
        return _held_pairs(tuple(op for op, _ in self.split_order(d, r, min(m, REPLAY_MICROBATCHES * d))))

    def bubble(self, d: int, m: int) -> float:
        """With the paper's equal forward, input-gradient and weight-gradient times."""
        idle = self.bubble_time(d, m, 1.0, 1.0, 1.0)
        return idle / (3 * m + idle)

    def bubble_slots(self, d: int) -> float:  # type: ignore[override]
        """Extra microbatch slots per step (a slot is F + I + W) with equal F, I and W times and m >= d
        (ZB-H2: m >= 2d - 1), where both idle only for the fill of the first forward, ``(d - 1) * f``."""
        return (d - 1) / 3

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """One step of the generated programs replayed with these times and free communication (a flush
        per step: the step's makespan less its compute). The planner asks for thousands of (d, m, f, b, w),
        so the replay runs on times relative to ``f`` rounded to 1e-3 (the bubble scales with the times;
        the rounding moves it by about 0.1%) and on at most ``REPLAY_MICROBATCHES * d`` microbatches: past
        2d - 1 the steady state only repeats, and the bubble, the fill and the drain, stays the same
        (``tests/test_zero_bubble.py`` checks both against the full replay)."""
        m = min(m, REPLAY_MICROBATCHES * d)
        pv = self.post_validation
        if f <= 0:
            return _replayed_bubble(self.name, d, m, 0.0, float(b), float(w), pv)
        return f * _replayed_bubble(self.name, d, m, 1.0, round(b / f, 3), round(w / f, 3), pv)

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        order = self.split_order(d, r, m)
        if self.post_validation:
            return _post_validated(order, d, r, m, first_step, num_steps, self.version)
        out: list[Action] = []
        for t in range(first_step, first_step + num_steps):
            v, lo = self.version(t), t * m
            for op, i in order:
                out.extend(_split_fragment(op, lo + i, t, v, r > 0, r < d - 1))
            out.append(Action(Op.REDUCE_GRADS, step=t))
            out.append(Action(Op.APPLY_UPDATE, step=t))
        return out


def validation_cut(d: int, r: int) -> int:
    """Forwards of step t+1 that stage ``r`` runs on its speculative W(t+1) before VALIDATE(t): ``d - 1 - r``.

    In the zero-bubble parallelogram stage r starts step t+1 r forward slots after stage 0, and the last stage
    finishes step t (its last W, then REDUCE_GRADS(t)) d - 1 slots after stage 0, so the global norm is known
    on every stage after stage r's first ``d - 1 - r`` forwards. The cuts form a consistent cut: stage r sends
    the activations of microbatches ``0 .. d-2-r`` before its VALIDATE, and stage r+1 receives exactly those
    before its own (the receive of its forward ``d - 2 - r``'s input goes before the VALIDATE, the forward
    after), so a failed validation re-runs every stage's part of the warm-up without a message in flight."""
    return d - 1 - r


def _post_validated(order: SplitOrder, d: int, r: int, m: int, first_step: int, num_steps: int,
                    version: Callable[[int], int]) -> list[Action]:
    """A one-chunk split schedule's segment with optimizer post-validation (Qi et al. 2024, section 5).

    Each step's order is the flushed schedule's; what changes is at the step boundary. APPLY_UPDATE(t) is
    speculative: it waits only for the stage's own gradient (its data-parallel reduction and the tied word
    embedding's) and applies the update as if the global norm neither clips nor overflows, so stage 0 starts
    step t+1 while the later stages still run step t's deferred Ws (the parallelogram tiles: no fill). The
    check, VALIDATE(t), sits at :func:`validation_cut` in step t+1's warm-up; where the global norm says the
    update was wrong, every stage rolls it back, applies the exact one and re-runs its warm-up forwards.
    The segment's last update is exact (no VALIDATE), so a segment ends drained and validated.

    The tied word embedding: the last stage takes its head's weight gradient at its I (the executor does so
    where the program has REDUCE_EMBEDDING) and all-reduces it right after its last I of the step
    (REDUCE_EMBEDDING(t)), so stage 0's speculative update does not wait for the last stage's Ws."""
    out: list[Action] = []
    has_prev, has_next = r > 0, r < d - 1
    last_input = max(k for k, (op, _) in enumerate(order) if op is Op.BACKWARD_INPUT)
    cut = validation_cut(d, r)
    for t in range(first_step, first_step + num_steps):
        v, lo = version(t), t * m
        pending = t > first_step  # VALIDATE(t - 1) goes into this step's warm-up
        forwards = 0
        if pending and not has_prev and cut == 0:
            out.append(Action(Op.VALIDATE, step=t - 1))
            pending = False
        for k, (op, i) in enumerate(order):
            frag = _split_fragment(op, lo + i, t, v, has_prev, has_next)
            if pending:
                if op is not Op.FORWARD:
                    raise RuntimeError(f"stage {r} of d={d} runs {op.value}{i} before its {cut} warm-up forwards: "
                                       "no place for post-validation")
                if forwards == cut:  # this forward's receive before the check, the forward after it
                    out.append(frag[0])
                    frag = frag[1:]
                    out.append(Action(Op.VALIDATE, step=t - 1))
                    pending = False
                forwards += 1
            out.extend(frag)
            if pending and not has_prev and forwards == cut:  # stage 0: after its cut-th forward and its send
                out.append(Action(Op.VALIDATE, step=t - 1))
                pending = False
            if k == last_input and not has_next and d > 1:
                out.append(Action(Op.REDUCE_EMBEDDING, step=t))
        out.append(Action(Op.REDUCE_GRADS, step=t))
        out.append(Action(Op.APPLY_UPDATE, step=t))
    return out


_COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
Round = tuple[tuple[Op, int, int], ...]  # (compute op, chunk, microbatch) computes a rank runs, then communicates
_GRAD = frozenset({Op.BACKWARD, Op.BACKWARD_INPUT})  # the computes that make the input gradient


@functools.lru_cache(maxsize=1024)
def lower_rounds(place: Placement, rounds: tuple[tuple[Round, ...], ...]) -> tuple[tuple[tuple[Op, int, int], ...], ...]:
    """Every rank's (op, chunk, microbatch) program for one step of compute ``rounds`` (per rank, in order),
    with the transfers placed between the rounds: the lowering pass that makes a multi-chunk order a program.

    With several chunks the ranks form a ring (rank d-1 feeds rank 0 the next chunk), where the one-chunk
    convention (each transfer next to its compute, each run of transfers with one peer one NCCL group)
    deadlocks under NCCL's in-order matching: every rank can sit in a send to its previous rank that no
    one receives. Here each round gets a slot, the earliest after the rank's previous round and after every
    compute it needs on a neighbouring virtual stage; after slot k every rank runs its transfers of slot k
    as one run: the sends of its slot-k computes, then the receives of what its neighbours computed in slot
    k for it (Megatron's ``send_forward_backward_recv_forward_backward``: both directions in one group).
    The ranks' slot-k runs match among themselves, so they complete slot after slot under gloo's queues
    and NCCL's rendezvous alike (the checker proves it for every layout), and every input arrives at least
    a slot before its compute, waiting in the executor's mail until then. Megatron-like rounds (a forward
    and a backward each in the steady state) keep the slots of all ranks equally long.
    """
    d, last = place.d, place.num_stages - 1

    def kind(op: Op) -> int:  # 0: forward, 1: input gradient (B or I), 2: weight gradient (W)
        return 0 if op is Op.FORWARD else 1 if op in _GRAD else 2

    def dep(op: Op, s: int) -> int | None:
        """The virtual stage whose compute this one needs (W needs only its own I, earlier on the rank)."""
        if op is Op.FORWARD:
            return s - 1 if s > 0 else None
        return s + 1 if op in _GRAD and s < last else None

    slot: dict[tuple[int, int, int], int] = {}  # (virtual stage, kind, microbatch) -> its slot
    pc, free = [0] * d, [0] * d
    progress = True
    while progress:
        progress = False
        for r in range(d):
            while pc[r] < len(rounds[r]):
                deps = [(x, kind(op), j) for op, c, j in rounds[r][pc[r]]
                        if (x := dep(op, place.stage(r, c))) is not None]
                if any(x not in slot for x in deps):
                    break
                k = max([free[r]] + [slot[x] + 1 for x in deps])
                for op, c, j in rounds[r][pc[r]]:
                    slot[(place.stage(r, c), kind(op), j)] = k
                free[r], pc[r], progress = k + 1, pc[r] + 1, True
    if any(pc[r] < len(rounds[r]) for r in range(d)):
        raise RuntimeError(f"compute orders wait on each other: ranks stopped at rounds {pc}")
    span = max(slot.values()) + 1
    programs: list[list[list[tuple[Op, int, int]]]] = [[[] for _ in range(span)] for _ in range(d)]
    sends: list[list[list[tuple[Op, int, int]]]] = [[[] for _ in range(span)] for _ in range(d)]
    recvs: list[list[list[tuple[Op, int, int]]]] = [[[] for _ in range(span)] for _ in range(d)]
    for r in range(d):
        for rnd in rounds[r]:
            op0, c0, j0 = rnd[0]
            k = slot[(place.stage(r, c0), kind(op0), j0)]
            programs[r][k].extend(rnd)
            for op, c, j in rnd:
                s = place.stage(r, c)
                to = (s + 1 if s < last else None) if op is Op.FORWARD else (s - 1 if s > 0 else None) \
                    if op in _GRAD else None
                if to is None or place.rank(to) == r:  # the model's end, a W, or a hand-over on the rank itself
                    continue
                sends[r][k].append((Op.SEND_ACT if op is Op.FORWARD else Op.SEND_GRAD, c, j))
                recvs[place.rank(to)][k].append((Op.RECV_ACT if op is Op.FORWARD else Op.RECV_GRAD, place.chunk(to), j))
    out = []
    for r in range(d):
        prog: list[tuple[Op, int, int]] = []
        for k in range(span):
            prog.extend(programs[r][k])
            prog.extend(sends[r][k])
            prog.extend(sorted(recvs[r][k], key=lambda x: (x[0] is Op.RECV_GRAD, x[1], x[2])))
        out.append(tuple(prog))
    return tuple(out)


@dataclass(frozen=True)
class _ZBH1(_ZeroBubble):
    """ZB-H1: 1F1B's warm-up (d - r - 1 forwards) and steady F, I pairs; stage r defers each W by r
    microbatches (after I(k) comes W(k - r)), so the later stages, which 1F1B leaves idle at the end of a
    step, finish their deferred Ws there. The order of torch's ``ScheduleInterleavedZeroBubble`` with one
    chunk. Every stage holds at most d microbatches (F to W): 1F1B's peak, which 1F1B reaches on stage 0
    only. Bubble ``(d - 1) * (f + b - w)`` per step, a third of 1F1B's when the three are equal."""

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        return _zb_h1_order(d, r, m)

    def inflight_bound(self, d: int, r: int) -> int:
        return d

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """The paper's ``(d - 1) * (f + b - w)`` where it holds (m >= d, w <= min(f, b): the Ws a stage
        deferred fit in its drain); replayed otherwise."""
        if m >= d and w <= min(f, b) and not self.post_validation:
            return (d - 1) * (f + b - w)
        return super().bubble_time(d, m, f, b, w)


def _flushed_steps(spec: ScheduleSpec, rounds, m: int, first_step: int, num_steps: int,
                   cut: int | None = None) -> list[Action]:
    """A chunked schedule's segment: each step runs one step's lowered ``rounds`` ((op, chunk, microbatch of
    the step) in order), then reduces and applies on its own, like Flush. ``cut`` (post-validation): the
    warm-up forwards after which each step checks the step before it (:func:`_insert_validation`)."""
    out: list[Action] = []
    for t in range(first_step, first_step + num_steps):
        v, lo = spec.version(t), t * m
        step = [Action(op, lo + j, t, v if op in _COMPUTE else -1, c) for op, c, j in rounds]
        if cut is not None and t > first_step:
            step = _insert_validation(step, cut, lo, t - 1)
        out.extend(step)
        out.append(Action(Op.REDUCE_GRADS, step=t))
        out.append(Action(Op.APPLY_UPDATE, step=t))
    return out


def _insert_validation(step: list[Action], cut: int, lo: int, validated: int) -> list[Action]:
    """``step``'s actions with VALIDATE(``validated``) after its first ``cut`` forwards of chunk 0 (their sends
    included) and, on a stage with a previous one, after the receive of the next forward's input: the same cut
    as :func:`_post_validated` makes, for a program whose transfers a lowering pass placed."""
    has_prev = any(a.op is Op.RECV_ACT and a.chunk == 0 for a in step)
    forwards = 0
    for i, a in enumerate(step):
        if has_prev and a.op is Op.RECV_ACT and a.chunk == 0 and a.mb == lo + cut and forwards == cut:
            return [*step[:i + 1], Action(Op.VALIDATE, step=validated), *step[i + 1:]]
        if not has_prev and forwards == cut and a.op is not Op.SEND_ACT:
            return [*step[:i], Action(Op.VALIDATE, step=validated), *step[i:]]
        if a.op is Op.FORWARD and a.chunk == 0:
            forwards += 1
        elif a.op not in (Op.SEND_ACT, Op.RECV_ACT) or a.chunk:
            break
    raise RuntimeError(f"no place for post-validation after {cut} warm-up forwards in {step[:8]}")


def _peak(ops, opens: Op, closes: Op) -> int:
    """Most microbatches open at once in a stage's order of ops: opened by ``opens``, closed by ``closes``
    (F..W: in flight; I..W: deferred weight gradients)."""
    held = most = 0
    for op in ops:
        held += (op is opens) - (op is closes)
        most = max(most, held)
    return most


@functools.lru_cache(maxsize=1 << 12)
def _held_pairs(ops: tuple[Op, ...]) -> tuple[tuple[int, int], ...]:
    """The Pareto front of (F..I, I..W) counts over a stage's ops (see :meth:`ScheduleSpec.held_pairs`)."""
    a = b = 0
    seen: set[tuple[int, int]] = set()
    for op in ops:
        a += (op is Op.FORWARD) - (op is Op.BACKWARD_INPUT)
        b += (op is Op.BACKWARD_INPUT) - (op is Op.BACKWARD_WEIGHT)
        seen.add((a, b))
    return tuple(sorted(p for p in seen if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in seen)))


REPLAY_MICROBATCHES = 4  # per stage, the most :meth:`_ZeroBubble.bubble_time` replays


def _replayed_bubble(name: str, d: int, m: int, f: float, b: float, w: float, pv: bool = False) -> float:
    """One step's idle time of the generated programs: a flushed step's makespan less its work; with
    post-validation, where consecutive steps overlap, the steady state's: the longest span of one rank's
    computes within that same flushed step, less the work (each rank goes on with the next step as soon as
    its own part of this one is done, and the parallelograms tile; ``tests/test_post_validation.py`` checks
    it against three steps' makespan less two steps')."""
    flushed, overlapped = _replayed_idle(name, d, m, f, b, w)
    return overlapped if pv else flushed


@functools.lru_cache(maxsize=1 << 12)
def _replayed_idle(name: str, d: int, m: int, f: float, b: float, w: float) -> tuple[float, float]:
    """(flushed, overlapped) idle time of one step: see :func:`_replayed_bubble`."""
    programs = [stage_actions(name, d, r, m, 0, 1) for r in range(d)]
    zeros = (0.0,) * d
    timing = Timing((f,) * d, (b + w,) * d, zeros, zeros, zeros, zeros, zeros, input_s=(b,) * d, weight_s=(w,) * d)
    spec = get_schedule(name)
    work = m * spec.chunks * (f + b + w)  # every chunk's share
    trace = Replay(programs, timing=timing, placement=spec.placement(d)).run()
    span = 0.0
    for r, prog in enumerate(programs):
        computes = [i for i, a in enumerate(prog) if a.op in _COMPUTE]
        span = max(span, trace.end[r][computes[-1]] - trace.start(r, computes[0]))
    return max(trace.makespan - work, 0.0), max(span - work, 0.0)


@functools.lru_cache(maxsize=1 << 12)
def _zb_h1_order(d: int, r: int, m: int) -> SplitOrder:
    warm = min(d - r - 1, m)
    order: SplitOrder = [(Op.FORWARD, i) for i in range(warm)]
    weights = 0
    for k in range(m):
        if warm + k < m:
            order.append((Op.FORWARD, warm + k))
        order.append((Op.BACKWARD_INPUT, k))
        if k >= r:
            order.append((Op.BACKWARD_WEIGHT, weights))
            weights += 1
    order.extend((Op.BACKWARD_WEIGHT, j) for j in range(weights, m))
    return order


@dataclass(frozen=True)
class _ZBH2(_ZeroBubble):
    """ZB-H2: up to 2d - 1 microbatches in flight (F to W) on every stage: the first stage runs 2d - 1
    forwards before its first I, and the Ws every stage deferred fill the drain, so that (with equal
    F, I and W times) no stage idles but for the fill of the step's first forward, ``(d - 1) * f``: a flush
    per step (the synchronous optimizer step) cannot hide that fill; the paper's zero bubble needs its
    post-validation, which overlaps the optimizer step with the next step's warm-up, and, with a tied word
    embedding on the first and last stages, the head's weight gradient taken at its I so that the embedding's
    reduction is not behind the last stage's last W: :func:`_post_validated`
    (``--enable-optimizer-post-validation``)."""

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        return _greedy_orders(d, m, 2 * d - 1)[r]

    def inflight_bound(self, d: int, r: int) -> int:
        return 2 * d - 1

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """``(d - 1) * f`` where that holds (m >= 2d - 1, b and w at most f, b at most 2w); replayed otherwise."""
        if m >= 2 * d - 1 and max(b, w) <= f and b <= 2 * w and not self.post_validation:
            return (d - 1) * f
        return super().bubble_time(d, m, f, b, w)


@functools.lru_cache(maxsize=1 << 12)
def _greedy_orders(d: int, m: int, limit: int) -> tuple[SplitOrder, ...]:
    """Every stage's F/I/W order for one step, from a replay in unit time where each free stage runs an I
    whose gradient has arrived, else a forward whose activation has arrived (while fewer than ``limit``
    microbatches are in flight), else its oldest deferred W."""
    f_end = [[-1] * m for _ in range(d)]  # when each stage's forward of each microbatch ended (-1: not yet)
    i_end = [[-1] * m for _ in range(d)]
    nf, ni, nw = [0] * d, [0] * d, [0] * d
    orders: list[SplitOrder] = [[] for _ in range(d)]
    t = 0
    while min(nw) < m:
        for r in range(d):  # every op takes one unit: a stage is free at every t
            k = ni[r]
            if k < nf[r] and 0 <= f_end[r][k] <= t and (r == d - 1 or 0 <= i_end[r + 1][k] <= t):
                orders[r].append((Op.BACKWARD_INPUT, k))
                i_end[r][k], ni[r] = t + 1, k + 1
                continue
            k = nf[r]
            if k < m and k - nw[r] < limit and (r == 0 or 0 <= f_end[r - 1][k] <= t):
                orders[r].append((Op.FORWARD, k))
                f_end[r][k], nf[r] = t + 1, k + 1
                continue
            if nw[r] < ni[r] and i_end[r][nw[r]] <= t:
                orders[r].append((Op.BACKWARD_WEIGHT, nw[r]))
                nw[r] += 1
        t += 1
    return tuple(orders)


@dataclass(frozen=True)
class _ZBV(_ZeroBubble):
    """ZB-V (Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble`` order): two chunks per rank in a V,
    chunk 0 of rank r is virtual stage r, chunk 1 is 2d - 1 - r, so rank d-1 hands its chunk 0's output to its
    chunk 1 itself and rank 0 holds both the embedding and the head (the tied embedding is local there);
    split backward, W deferred into the bubbles, one weight version, a flush per step. Needs m >= 2d - 1
    (rank 0 runs 2d - 1 warm-up forwards). Units: :meth:`inflight` and :meth:`deferred_weight_grads` count
    one chunk's stashes (half a rank's layers), as for interleaved-1f1b."""

    chunks: int = 2

    def placement(self, d: int) -> Placement:
        return Placement(d, 2, "v")

    def min_microbatches(self, d: int) -> int:
        return 2 * d - 1

    def check_layout(self, d: int, m: int) -> None:
        if d < 2:
            raise ConfigError("zb-v needs --pipeline-model-parallel-size >= 2 (its V turns on the last rank)")

    def chunk_order(self, d: int, r: int, m: int) -> list[tuple[Op, int, int]]:
        """(F, I or W; chunk; microbatch) of rank ``r`` over one step: torch's ZBV order."""
        return list(_zbv_order(d, r, m))

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        raise NotImplementedError("zb-v orders (op, chunk, microbatch): see chunk_order")

    @functools.lru_cache(maxsize=1 << 14)  # noqa: B019 - specs are frozen module-level singletons
    def inflight(self, d: int, r: int, m: int) -> int:
        """Counted on the generated order; past ``REPLAY_MICROBATCHES * d`` microbatches the steady state
        only repeats, so at that count (cached: the planner asks for every stage of every candidate;
        ``tests/test_zero_bubble.py`` checks both against the full order)."""
        return _peak((op for op, _, _ in self.chunk_order(d, r, min(m, REPLAY_MICROBATCHES * d))),
                     Op.FORWARD, Op.BACKWARD_WEIGHT)

    @functools.lru_cache(maxsize=1 << 14)  # noqa: B019 - as inflight
    def deferred_weight_grads(self, d: int, r: int, m: int) -> int:
        return _peak((op for op, _, _ in self.chunk_order(d, r, min(m, REPLAY_MICROBATCHES * d))),
                     Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)

    def held_pairs(self, d: int, r: int, m: int) -> tuple[tuple[int, int], ...]:
        return _held_pairs(tuple(op for op, _, _ in self.chunk_order(d, r, min(m, REPLAY_MICROBATCHES * d))))

    def bubble_slots(self, d: int) -> float:  # type: ignore[override]
        return _ZeroBubble.bubble_slots(self, d) / 2

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """One step of the generated programs replayed with each chunk's share (half) of these times (on
        the same shortcuts as :meth:`_ZeroBubble.bubble_time`)."""
        return _ZeroBubble.bubble_time(self, d, m, f / 2, b / 2, w / 2)

    def actions(self, d: int, r: int, m: int, first_step: int, num_steps: int) -> list[Action]:
        rounds = lower_rounds(self.placement(d), tuple(tuple((x,) for x in _zbv_order(d, q, m)) for q in range(d)))[r]
        cut = validation_cut(d, r) if self.post_validation else None
        return _flushed_steps(self, rounds, m, first_step, num_steps, cut)


@functools.lru_cache(maxsize=1 << 12)
def _zbv_order(d: int, r: int, m: int) -> tuple[tuple[Op, int, int], ...]:
    """torch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (m >= 2d - 1): chunk 0 warms up with
    2(d - r) - 1 forwards, then F1/F0 pairs, then F1 I1 W1 triples, a steady F0 I0 W0 F1 I1 W1, and a
    cool-down whose deferred Ws fill the drain."""
    F, I, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    out: list[tuple[Op, int, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (d - r) - 1):
        out.append((F, 0, f0))
        f0 += 1
    for _ in range(r):
        out += [(F, 1, f1), (F, 0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(d - r):
        out += [(F, 1, f1), (I, 1, b1), (W, 1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < m:
        if f0 < m:
            out.append((F, 0, f0))
            f0 += 1
        out += [(I, 0, b0), (W, 0, b0), (F, 1, f1), (I, 1, b1), (W, 1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [(I, 0, b0), (I, 1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(d - r):
        out += [(I, 0, b0), (W, 0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [(W, 1, j) for j in range(w1, b1)] + [(W, 0, j) for j in range(w0, b0)]
    return tuple(out)


SCHEDULES: dict[str, ScheduleSpec] = {
    "2bw": _TwoBW("2bw", weight_versions=2, grad_buffers=2, stale_steps=1),
    "flush": ScheduleSpec("flush"),
    "gpipe": _GPipe("gpipe"),
    "interleaved-1f1b": _Interleaved("interleaved-1f1b"),
    "zb-h1": _ZBH1("zb-h1"),
    "zb-h2": _ZBH2("zb-h2"),
    "zb-v": _ZBV("zb-v"),
}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)

PV_SUFFIX = "+pv"  # a schedule id's mark of optimizer post-validation (``zb-h2+pv``): what the planner prices


def schedule_id(name: str, post_validation: bool = False) -> str:
    """One string for a schedule as a run configures it (the planner's candidates, plans, reports)."""
    return name + PV_SUFFIX if post_validation else name


def parse_schedule_id(sid: str) -> tuple[str, bool]:
    """``(registry name, post-validation)`` of a schedule id."""
    return (sid[:-len(PV_SUFFIX)], True) if sid.endswith(PV_SUFFIX) else (sid, False)


def spec_of(sid: str, chunks: int | None = None) -> ScheduleSpec:
    """The spec of a schedule id (a registry name, or one with :data:`PV_SUFFIX`)."""
    name, pv = parse_schedule_id(sid)
    return get_schedule(name, chunks, pv)


# what the planner searches: the registry, and zb-h2 and zb-v with post-validation, whose steps overlap with it
# (zb-h1's do not: its last stage has nothing of the step left to run while the next one fills)
PLANNED_SCHEDULES: tuple[str, ...] = (*SCHEDULE_NAMES, schedule_id("zb-h2", True), schedule_id("zb-v", True))


def get_schedule(name: str, chunks: int | None = None, post_validation: bool = False) -> ScheduleSpec:
    """The spec of ``name`` (with ``chunks`` model chunks per rank where it takes a count: None, its own; with
    optimizer post-validation where it takes it); a one-line ``ConfigError`` naming the choices otherwise."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    return spec.with_chunks(chunks).with_post_validation(post_validation)


def validate_pipeline(schedule: str, d: int, m: int, chunks: int | None = None, post_validation: bool = False) -> None:
    """Refuse a schedule / depth / microbatch count that no stage could run, with one line."""
    spec = get_schedule(schedule, chunks, post_validation)
    if d < 1:
        raise ConfigError(f"pipeline depth must be >= 1, got d={d}")
    if m < 1:
        raise ConfigError(f"microbatches per step must be >= 1, got m={m}")
    need = spec.min_microbatches(d)
    if spec.post_validation and m < d:
        raise ConfigError(f"--enable-optimizer-post-validation needs at least d microbatches per step (every stage's "
                          f"warm-up holds the check): m={m} < d={d}")
    if m < need:
        if need == d:
            raise ConfigError(f"{schedule.upper()} needs at least d microbatches per step: m={m} < d={d}")
        raise ConfigError(f"{schedule.upper()} needs at least {need} microbatches per step at d={d}: m={m} < {need}")
    spec.check_layout(d, m)


def _validate_stage(schedule: str, d: int, r: int, m: int, chunks: int | None = None,
                    post_validation: bool = False) -> ScheduleSpec:
    validate_pipeline(schedule, d, m, chunks, post_validation)
    if not 0 <= r < d:
        raise ConfigError(f"pipeline stage must be in 0..{d - 1}, got r={r}")
    return get_schedule(schedule, chunks, post_validation)


def inflight_limit(schedule: str, d: int, r: int, m: int, chunks: int | None = None) -> int:
    """:meth:`ScheduleSpec.inflight`, after validating the layout."""
    return _validate_stage(schedule, d, r, m, chunks).inflight(d, r, m)


def bubble_fraction(schedule: str, d: int, m: int, chunks: int | None = None) -> float:
    """:meth:`ScheduleSpec.bubble`, after validating the layout."""
    validate_pipeline(schedule, d, m, chunks)
    return get_schedule(schedule, chunks).bubble(d, m)


# A segment can be cut short to end at step count ``u + STOP_LAG`` once APPLY_UPDATE(u) has run, for every
# schedule, stage and (d, m): the actions run so far are then a prefix of the shorter segment's, and every
# receive the transport may have posted ahead (the next two of each kind) belongs to it.
# ``tests/test_log_no_drain.py`` checks both for every layout and that a lag of 2 is not enough.
STOP_LAG = 3


def cut_segment(schedule: str, d: int, r: int, m: int, first_step: int, done: list[Action], end: int,
                chunks: int | None = None, post_validation: bool = False) -> list[Action]:
    """The actions still to run when a segment from ``first_step`` that has run ``done`` ends at step count ``end``.

    A RuntimeError if ``done`` is not how the segment ending at ``end`` starts (a caller's bug: cut too late).
    """
    new = stage_actions(schedule, d, r, m, first_step, end - first_step, chunks, post_validation)
    if new[:len(done)] != done:
        raise RuntimeError(f"cannot end the segment from step {first_step} at step {end} on stage {r}: "
                           f"{len(done)} actions already ran that it does not start with")
    return new[len(done):]


def stage_actions(schedule: str, d: int, r: int, m: int, first_step: int, num_steps: int,
                  chunks: int | None = None, post_validation: bool = False) -> list[Action]:
    """Ordered actions of stage ``r`` of a depth-``d`` pipeline for a drained segment.

    The segment covers steps ``first_step .. first_step+num_steps-1`` and ends with every
    microbatch forwarded and backwarded and every update applied; a later segment starting
    at the next step continues microbatch indices and (for 2BW) weight versions exactly as
    an uninterrupted run would, so checkpoints and evaluations can sit at any step boundary.
    ``chunks``: model chunks per rank for a schedule that takes a count (interleaved-1f1b); None: its own.
    ``post_validation``: speculative updates checked in the next step's warm-up (:func:`_post_validated`).
    """
    spec = _validate_stage(schedule, d, r, m, chunks, post_validation)
    if first_step < 0:
        raise ConfigError(f"first step must be >= 0, got first_step={first_step}")
    if num_steps < 1:
        raise ConfigError(f"a schedule segment needs at least one step, got num_steps={num_steps}")
    return spec.actions(d, r, m, first_step, num_steps)
