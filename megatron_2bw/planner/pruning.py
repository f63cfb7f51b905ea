"""What lets the search skip candidates without changing its answer: bounds, and prices computed once.

The search ranks candidates by batch time. Three facts let it leave most of them unpriced:

- ``StageLines``: a stage's time per microbatch is ``base_r + n_r * slope_r`` (``split.stage_lines``),
  and the lines depend on the layout, the microbatch, the recomputation and the schedule's chunks only,
  not on the schedule's bubble or the optimizer; the ~9 schedules and 2 optimizer settings of a layout
  share them, so they are computed once per search (the lower bound and the stage split both read them).
- ``lower_bound``: under any split the stages' times add up to the same total, so the slowest is at least
  the mean, and a batch takes at least ``m`` slots of it (``search.batch_time_lower_bound``).
- ``Thresholds``: a search asked for its ``top`` plans (and the best plan of each ``keep`` selector) only
  needs the candidates that could still enter them: one whose lower bound exceeds the ``top``-th best
  batch time found so far (and every ``keep`` threshold it falls under) is skipped. The search visits
  layouts in the order of their lower bounds, so the thresholds fall fast and the rest is skipped whole.
  A candidate that fits is priced without its bubble first (``cost_model.predict``'s ``max_batch_s``):
  the bubble of a zero-bubble schedule is a replay of its programs, the costliest term, and only adds.

Every skipped candidate is one whose batch time is above the final threshold, so the ``top`` plans and each
selector's best equal those of the exhaustive search (``tests/test_planner_pruning.py`` checks it).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Mapping

from ..schedule.schedules import spec_of
from .hardware import Cluster
from .layer_costs import LayerCosts, MicrobatchCosts
from .memory_model import SEQUENTIAL, Candidate, ParamBytes
from .moe_costs import for_experts
from .split import stage_lines

Selector = Callable[[Candidate], bool]
REL = 1e-9  # bounds are compared with this slack: a tie is priced, never skipped


def chunks_of(cand: Candidate) -> int:
    return 1 if cand.schedule == SEQUENTIAL else spec_of(cand.schedule).chunks


def lines_key(cand: Candidate) -> tuple:
    """What ``split.stage_lines`` reads of a candidate: not the schedule's bubble, m, or the optimizer."""
    return (cand.tensor_parallel, cand.pipeline_parallel, cand.data_parallel, cand.micro_batch_size,
            cand.sequence_parallel, cand.recompute, cand.recompute_policy, chunks_of(cand), cand.context,
            cand.expert_parallel)


class StageLines:
    """``split.stage_lines`` of a search's candidates, each distinct one computed once; and the costs of each
    candidate's (t, b, sequence parallelism, context, expert-parallel size), each resolved once
    (``moe_costs.for_experts``, the busiest expert at ``expert_load`` times the mean)."""

    def __init__(self, costs: LayerCosts, cluster: Cluster, param_bytes: ParamBytes, expert_load: float = 1.0) -> None:
        self.costs, self.cluster, self.param_bytes, self.expert_load = costs, cluster, param_bytes, expert_load
        self._lines: dict[tuple, tuple[list[float], list[float]]] = {}
        self._costs: dict[tuple, MicrobatchCosts | None] = {}

    def costs_of(self, cand: Candidate) -> MicrobatchCosts | None:
        key = (cand.tensor_parallel, cand.micro_batch_size, cand.sequence_parallel, cand.context, cand.expert_parallel)
        if key not in self._costs:
            c = self.costs.at(*key[:4])
            if c is not None and c.moe is not None:
                c = for_experts(c, cand.tensor_parallel, cand.expert_parallel, self.cluster, self.expert_load)
            self._costs[key] = c
        return self._costs[key]

    def __call__(self, cand: Candidate) -> tuple[list[float], list[float]]:
        key = lines_key(cand)
        lines = self._lines.get(key)
        if lines is None:
            lines = self._lines[key] = stage_lines(self.costs_of(cand), cand, self.cluster, self.param_bytes)
        return lines


class Thresholds:
    """The batch time a candidate must beat to matter: the ``top``-th best so far, or for a candidate that a
    ``keep`` selector picks, the larger of that and the selector's best so far (``inf`` until known)."""

    def __init__(self, top: int | None, keep: Mapping[str, Selector]) -> None:
        self.top, self.keep = top, dict(keep)
        self._heap: list[float] = []  # the top smallest batch times so far, negated (a max-heap)
        self.best = {name: math.inf for name in self.keep}

    @property
    def exhaustive(self) -> bool:
        return self.top is None

    def _kth(self) -> float:
        if self.top is None:
            return math.inf
        if self.top == 0:
            return -math.inf
        return -self._heap[0] if len(self._heap) >= self.top else math.inf

    def limit(self, cand: Candidate) -> float:
        """The largest batch time ``cand`` may have and still change the answer."""
        lim = self._kth()
        for name, pick in self.keep.items():
            if self.best[name] > lim and pick(cand):
                lim = self.best[name]
        return lim

    def ceiling(self) -> float:
        """The largest limit any candidate can have now."""
        return max([self._kth(), *self.best.values()])

    def add(self, cand: Candidate, batch_s: float) -> None:
        """A priced candidate that fits."""
        if self.top:
            if len(self._heap) < self.top:
                heapq.heappush(self._heap, -batch_s)
            elif batch_s < -self._heap[0]:
                heapq.heapreplace(self._heap, -batch_s)
        for name, pick in self.keep.items():
            if batch_s < self.best[name] and pick(cand):
                self.best[name] = batch_s


def above(bound: float, limit: float) -> bool:
    """Whether a lower bound proves a candidate slower than ``limit`` (ties are kept)."""
    return bound > limit * (1 + REL)
