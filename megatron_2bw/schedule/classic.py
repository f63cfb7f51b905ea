"""GPipe, PipeDream-2BW and interleaved 1F1B: the schedules that run whole backwards."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

from ..errors import ConfigError
from .actions import Action, Op
from .rounds import Round, _flushed_steps, lower_rounds
from .spec import Order, ScheduleSpec, _fragment


@dataclass(frozen=True)
class _GPipe(ScheduleSpec):
    """GPipe: every forward of a step, then every backward; all ``m`` stashes held at once."""

    steady_state: ClassVar[bool] = False

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
        The distributed optimizer's all-gather of W(t+1), which APPLY_UPDATE(t) issues, then runs on
        the reducer's ordered worker before chain(t+1), not behind it (chain(t+1) ends only when stage
        0 has finished step t+1, (d-1) backward slots later, and the last stage's next forward waits
        for the all-gather). Updates still pending at the end of the segment are applied after the
        last action, leaving it drained."""
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

    def compute_order(self, d: int, r: int, m: int) -> tuple[tuple[Op, int, int], ...]:
        return tuple(x for rnd in self.rounds(d, r, 0, m) for x in rnd)

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
        return _flushed_steps(self, self._lowered(d, m)[r], m, first_step, num_steps)

    @functools.lru_cache(maxsize=1 << 10)  # noqa: B019 - specs are frozen module-level singletons
    def _lowered(self, d: int, m: int) -> tuple[tuple[tuple[Op, int, int], ...], ...]:
        """Every rank's lowered program of one step, made once per (d, m): the planner's replays ask for it per
        rank and per candidate, and building the rounds to look :func:`lower_rounds` up cost as much as a replay."""
        return lower_rounds(self.placement(d), tuple(tuple(self.rounds(d, q, 0, m)) for q in range(d)))
