"""Optimizer post-validation on one rank (``--enable-optimizer-post-validation``): the speculative update,
its validation at a consistent cut, and the re-run of the warm-up when the speculation was wrong.

APPLY_UPDATE(t) of a step that the program validates later applies the update speculatively once the rank's
own gradient is final (:meth:`Updater.speculate`) and the rank goes on with step t+1's warm-up forwards;
VALIDATE(t) waits for the global norm and keeps the update, or rolls it back, applies the exact one and
re-runs the warm-up. Whether a step speculates depends only on the global norms of earlier steps, so every
rank decides alike: not after a step whose norm clipped or overflowed (where clipping is the rule, as early
in training, nothing is speculated and re-run).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from ..schedule.actions import Action, Op
from ..schedule.grouping import comm_groups
from ..tensor_parallel.recompute import RNGSnapshot
from .transport import RECV_OPS, Incoming


@dataclass
class Speculation:
    """A speculative APPLY_UPDATE(t) not yet validated: where the warm-up it feeds starts in the segment's
    actions, the learning rate, and the RNG state its forwards start from (so a re-run draws the same
    dropout masks)."""

    step: int
    lr: float
    start: int
    rng: RNGSnapshot


class PostValidation:
    """The post-validation part of a :class:`~.executor.PipelineRank` (a mixin: it reads the rank's
    reducer, updater, mail and stash)."""

    def _init_post_validation(self) -> None:
        # the steps the running segment validates, its early embedding reductions, the speculative update in
        # flight, whether the newest settled step's norm left its update alone (the next one speculates only
        # then), and counts of speculated and rolled-back steps
        self._validated: frozenset[int] = frozenset()
        self._emb_early: frozenset[int] = frozenset()
        self._spec: Speculation | None = None
        self._clean = True
        self.speculated = self.rolled_back = 0

    def _steps_of(self, actions: Sequence[Action]) -> None:
        """What the segment's program says about post-validation: the steps it validates, and those whose tied
        embedding the last stage reduces early."""
        self._validated = frozenset(a.step for a in actions if a.op is Op.VALIDATE)
        self._emb_early = frozenset(a.step for a in actions if a.op is Op.REDUCE_EMBEDDING)

    def _speculate(self, t: int, lr: float, at: int, t0: float) -> bool:
        """APPLY_UPDATE(t) speculatively, where the program validates t later and the step before neither
        clipped nor overflowed; False where the update must be exact."""
        if t not in self._validated:
            return False
        if not self._clean:
            self.reducer.start_norm(t)
            return False
        self.reducer.wait_grad(t)
        self.stats.update_wait_s += time.perf_counter() - t0
        self._spec = Speculation(t, lr, at, RNGSnapshot.capture(self.state.device, self.rng))
        self.updater.speculate(t, lr)
        self.reducer.start_norm(t)
        self.speculated += 1
        return True

    def _validate(self, t: int, actions: Sequence[Action], at: int, get_batch: Callable[[int], dict]):
        """VALIDATE(t): settle the speculative update of step t with the global norm (None where step t's
        update was exact). Where the norm says it was wrong (it clips or overflows) the update is rolled back
        and applied exactly, and the warm-up that ran on it, ``actions[start:at - 1]``, runs again: every rank
        sees the same norm, so every rank re-runs its part, and the cut is consistent (the checker proves
        it), so the re-sent activations meet receives that nothing else claims."""
        spec, self._spec = self._spec, None
        if spec is None:
            return None
        if spec.step != t:
            raise RuntimeError(f"VALIDATE({t}) reached with the speculative update of step {spec.step} pending")
        t0 = time.perf_counter()
        sumsq = self.reducer.finish(t)
        self.stats.update_wait_s += time.perf_counter() - t0
        update, rolled = self.updater.validate(t, sumsq, spec.lr)
        if rolled:
            self.rolled_back += 1
            self._rerun(actions[spec.start:at - 1], t + 1, spec.rng, get_batch)
        self._tick()
        return self._settled(t, update, spec.lr)

    def _rerun(self, warmup: Sequence[Action], step: int, rng: RNGSnapshot, get_batch: Callable[[int], dict]) -> None:
        """Forget what ``warmup`` (forwards of ``step`` and their transfers) did and run it again on the
        corrected weights, from the same RNG state."""
        m = self.pipe.num_microbatches
        for key in [k for k in self._stash if k[1] // m == step]:
            del self._stash[key]
        for key in [k for k in self._mail if k[2] // m == step]:
            x = self._mail.pop(key)
            if isinstance(x, Incoming):  # a receive of the warm-up, matched already: let it land, then drop it
                x.wait()
        self._losses.pop(step, None)
        self.transport.rewind([a for a in warmup if a.op in RECV_OPS])
        rng.restore(self.state.device, self.rng)
        groups = comm_groups(warmup, self.transport.group_key) if self.transport.grouped else {}
        i = 0
        while i < len(warmup):
            end = groups.get(i, i + 1)
            unit = warmup[i:end]
            if unit[0].op is Op.FORWARD:
                self._forward(unit[0], get_batch)
            else:
                self._transfer(unit)
            i = end
