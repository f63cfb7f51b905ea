"""Zero-bubble schedules with split backward (ZB-H1, ZB-H2) and optimizer post-validation."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .actions import Action, Op
from .rounds import _replayed_bubble
from .spec import REPLAY_MICROBATCHES, Order, ScheduleSpec, _fragment

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

    def compute_order(self, d: int, r: int, m: int) -> tuple[tuple[Op, int, int], ...]:
        return tuple((op, 0, mb) for op, mb in self.split_order(d, r, m))

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        """Stage ``r``'s F/I/W order over one step's microbatches ``0 .. m-1``."""
        raise NotImplementedError

    def order(self, d: int, r: int, lo: int, count: int) -> Order:
        """Forwards and input gradients (the whole-backward view of :meth:`split_order`)."""
        return [(op is Op.FORWARD, lo + i) for op, i in self.split_order(d, r, count) if op is not Op.BACKWARD_WEIGHT]

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
            return _replayed_bubble(self.with_post_validation(False), d, m, 0.0, float(b), float(w), pv)
        return f * _replayed_bubble(self.with_post_validation(False), d, m, 1.0, round(b / f, 3), round(w / f, 3), pv)

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



@dataclass(frozen=True)
class _ZBH1(_ZeroBubble):
    """ZB-H1: 1F1B's warm-up (d - r - 1 forwards) and steady F, I pairs; stage r defers each W by r
    microbatches (after I(k) comes W(k - r)), so the later stages, which 1F1B leaves idle at the end of a
    step, finish their deferred Ws there. The order of torch's ``ScheduleInterleavedZeroBubble`` with one
    chunk. Every stage holds at most d microbatches (F to W): 1F1B's peak, which 1F1B reaches on stage 0
    only. Bubble ``(d - 1) * (f + b - w)`` per step, a third of 1F1B's when the three are equal."""

    def split_order(self, d: int, r: int, m: int) -> SplitOrder:
        return _zb_h1_order(d, r, m)

    def bubble_time(self, d: int, m: int, f: float, b: float, w: float) -> float:
        """The paper's ``(d - 1) * (f + b - w)`` where it holds (m >= d, w <= min(f, b): the Ws a stage
        deferred fit in its drain); replayed otherwise."""
        if m >= d and w <= min(f, b) and not self.post_validation:
            return (d - 1) * (f + b - w)
        return super().bubble_time(d, m, f, b, w)




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
