"""Choosing the stage split: which transformer layers each pipeline stage holds.

Every transformer layer costs the same, so a split is just the layer count of each stage, and stage
``r`` holding ``n`` layers takes ``base_r + n * slope_r`` per microbatch (``cost_model.slice_time``:
compute, tensor-parallel all-reduces and p2p; ``base`` carries the embedding on the first stage, the
head and loss on the last and the boundary transfers). A pipeline runs at the pace of its slowest
stage, so the split minimises ``max_r(base_r + n_r * slope_r)`` subject to ``sum n_r = L``, each
stage's memory within the device's (``memory_model.slice_memory`` grows with ``n``) and at least
one layer on every middle stage (``schedule/stages.py``).

For a bottleneck time ``T`` stage ``r`` can hold at most ``floor((T - base_r) / slope_r)`` layers
(and at most its memory cap); ``T`` is feasible when those add up to ``L``. The optimum is one of
the values ``base_r + k * slope_r``; it lies between the continuous optimum and one slope above it
(without memory caps), so a bisection over the few values there finds it. Layers above ``L`` are
then taken away from the slowest stages first. When the even split is as fast, it is kept
(``None``), so balanced models plan as before. ``tests/test_uneven_stages.py`` checks the result
against brute force.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ..schedule.stages import Split, StageSlice, canonical_split, min_layers
from .cost_model import boundary_bandwidth, slice_time
from .hardware import Cluster
from .layer_costs import MicrobatchCosts
from .memory_model import DEFAULT_PARAM_BYTES, Candidate, ParamBytes, slice_memory

REL_TOL = 1e-12


def _max_layers(T: float, base: float, slope: float, cap: int) -> int:
    if T < base - REL_TOL * (abs(base) + 1):
        return -1
    if slope <= 0:
        return cap
    return min(cap, math.floor((T - base) / slope * (1 + REL_TOL) + REL_TOL))


def _values_between(lo: float, hi: float, base: float, slope: float, least: int, cap: int) -> list[float]:
    """``base + k * slope`` for ``least <= k <= cap`` within ``[lo, hi]`` (give or take rounding)."""
    if slope <= 0:
        return [base] if lo <= base <= hi else []
    first = max(least, math.ceil((lo - base) / slope - 1e-9))
    last = min(cap, math.floor((hi - base) / slope + 1e-9))
    return [base + k * slope for k in range(first, last + 1)]


def bottleneck(split: Sequence[int], base: Sequence[float], slope: Sequence[float]) -> float:
    """The slowest stage's time of ``split``."""
    return max(b + n * s for n, b, s in zip(split, base, slope))


def min_bottleneck_split(num_layers: int, base: Sequence[float], slope: Sequence[float],
                         caps: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Layer counts minimising :func:`bottleneck` (``None`` when the caps leave no split)."""
    d = len(base)
    caps = list(caps) if caps is not None else [num_layers] * d
    mins = [min_layers(r, d) for r in range(d)]
    if any(c < m for c, m in zip(caps, mins)) or sum(caps) < num_layers:
        return None

    def counts(T: float) -> list[int] | None:
        n = [_max_layers(T, b, s, c) for b, s, c in zip(base, slope, caps)]
        return n if all(x >= m for x, m in zip(n, mins)) and sum(n) >= num_layers else None

    lo = max(b + m * s for b, s, m in zip(base, slope, mins))
    hi = max(b + c * s for b, s, c in zip(base, slope, caps))
    if all(s > 0 for s in slope):  # the continuous optimum bounds the bottleneck from below
        relaxed = (num_layers + sum(b / s for b, s in zip(base, slope))) / sum(1 / s for s in slope)
        lo = max(lo, relaxed)
        if counts(relaxed + max(slope)) is not None:
            hi = min(hi, relaxed + max(slope))
    # the optimum is some stage's base + k * slope inside [lo, hi]: bisect over those values
    values = sorted({hi}.union(*(_values_between(lo, hi, b, s, m, c) for b, s, m, c in zip(base, slope, mins, caps))))
    a, z = 0, len(values) - 1  # counts(values[z]) is feasible
    while a < z:
        mid = (a + z) // 2
        a, z = (a, mid) if counts(values[mid]) is not None else (mid + 1, z)
    lo = values[z]
    n = counts(lo)
    surplus = sum(n) - num_layers
    while surplus > 0:  # take layers from the slowest stages first (the later stage on a tie)
        r = max((r for r in range(d) if n[r] > mins[r]), key=lambda r: (base[r] + n[r] * slope[r], r))
        n[r] -= 1
        surplus -= 1
    return tuple(n)


def _slice(r: int, d: int, n: int) -> StageSlice:
    return StageSlice(0, n, r == 0, r == d - 1)


def stage_lines(costs: MicrobatchCosts, cand: Candidate, cluster: Cluster,
                param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> tuple[list[float], list[float]]:
    """``(base_r, slope_r)`` of every stage: its time per microbatch with 0 layers and per layer."""
    t, d, w = cand.tensor_parallel, cand.pipeline_parallel, cand.replicas
    bw = [boundary_bandwidth(t, w, i, cluster) for i in range(d - 1)]
    lines: dict[tuple, tuple[float, float]] = {}  # middle stages with the same links cost the same
    for r in range(d):
        links = (bw[r - 1] if r > 0 else math.inf, bw[r] if r < d - 1 else math.inf)
        key = (r == 0, r == d - 1, *links)
        if key not in lines:
            zero = slice_time(costs, cand, _slice(r, d, 0), r, cluster, *links, param_bytes).microbatch_s
            one = slice_time(costs, cand, _slice(r, d, 1), r, cluster, *links, param_bytes).microbatch_s
            lines[key] = (zero, one - zero)
    keys = [(r == 0, r == d - 1, bw[r - 1] if r > 0 else math.inf, bw[r] if r < d - 1 else math.inf) for r in range(d)]
    return [lines[k][0] for k in keys], [lines[k][1] for k in keys]


def memory_caps(costs: MicrobatchCosts, cand: Candidate, num_layers: int, limit: float,
                param_bytes: ParamBytes = DEFAULT_PARAM_BYTES) -> list[int]:
    """The most layers each stage can hold within ``limit`` bytes (-1: not even its minimum).

    A stage's bytes are affine in its layer count from one layer on (weights, gradients, optimizer
    state and stashes grow by a layer's worth each; the workspace is fixed), so two evaluations
    give the cap; an edge stage's zero-layer case is checked on its own.
    """
    d = cand.pipeline_parallel
    caps = []
    for r in range(d):
        def total(n: int, r: int = r) -> int:
            return slice_memory(costs, cand, _slice(r, d, n), r, param_bytes).total
        one = total(1)
        if one > limit:
            caps.append(0 if min_layers(r, d) == 0 and total(0) <= limit else -1)
            continue
        step = total(2) - one
        caps.append(num_layers if step <= 0 else min(num_layers, 1 + int((limit - one) // step)))
    return caps


def balanced_split(costs: MicrobatchCosts, cand: Candidate, num_layers: int, cluster: Cluster,
                   param_bytes: ParamBytes = DEFAULT_PARAM_BYTES, memory_limit: float | None = None,
                   lines: tuple[Sequence[float], Sequence[float]] | None = None) -> Split:
    """The fastest split of ``cand`` that fits ``memory_limit`` (``None``: the even split is as good).

    When no split fits, the fastest split is returned (the caller finds it too big). ``lines``: the
    candidate's :func:`stage_lines`, when the caller has them already.
    """
    d = cand.pipeline_parallel
    if d == 1:
        return None
    base, slope = lines or stage_lines(costs, cand, cluster, param_bytes)
    best = min_bottleneck_split(num_layers, base, slope)
    if memory_limit is not None and not _fits(costs, cand, num_layers, best, memory_limit, param_bytes):
        capped = min_bottleneck_split(num_layers, base, slope,
                                      memory_caps(costs, cand, num_layers, memory_limit, param_bytes))
        best = capped or best
    if num_layers % d == 0:
        even = (num_layers // d,) * d
        if bottleneck(even, base, slope) <= bottleneck(best, base, slope) * (1 + 1e-9) and (
                memory_limit is None or _fits(costs, cand, num_layers, even, memory_limit, param_bytes)):
            return None
    return canonical_split(num_layers, d, best)


def _fits(costs: MicrobatchCosts, cand: Candidate, num_layers: int, split: Sequence[int], limit: float,
          param_bytes: ParamBytes) -> bool:
    c = replace(cand, layer_split=None)
    return all(slice_memory(costs, c, _slice(r, len(split), n), r, param_bytes).total <= limit
               for r, n in enumerate(split))
