"""The attention cores by ``--cp-comm-type``: ``config/context.py``'s torch-free table, each row with its core.

A core is called as ``run(cp, backend, dense, q, k, v, mask, p, causal)``: ``dense(q, k, v, mask, p, causal)``
is the model's attention core (``models/attention_core.attention`` by ``backend``), which the exchanges run
on their gathered or scattered tensors; ``causal`` is the model's (a given mask holds causality too).
``dense`` is the core without context parallelism (``cp`` None or of size 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config.context import A2A, ALL_GATHER, CONTEXT_TYPES, DENSE, P2P, ContextType
from .a2a import a2a_attention
from .attention import all_gather_attention
from .group import CPGroup
from .ring import ring_attention


def _dense(cp, backend, dense, q, k, v, mask, p, causal):
    return dense(q, k, v, mask, p, causal and mask is None)


def _ring(cp, backend, dense, q, k, v, mask, p, causal):
    return ring_attention(cp, q, k, v, mask, p, causal, backend)


@dataclass(frozen=True)
class ContextCore:
    """A row of the table: its type (planner pricing, divisibility rule; None for ``dense``) and its core."""

    name: str
    run: Callable
    spec: ContextType | None = None


CORES = {core.name: core for core in (
    ContextCore(DENSE, _dense),
    ContextCore(P2P, _ring, CONTEXT_TYPES[P2P]),
    ContextCore(ALL_GATHER, all_gather_attention, CONTEXT_TYPES[ALL_GATHER]),
    ContextCore(A2A, a2a_attention, CONTEXT_TYPES[A2A]),
)}
assert set(CORES) == {DENSE, *CONTEXT_TYPES}, "every --cp-comm-type needs its core"


def context_core(cp: CPGroup | None) -> ContextCore:
    """The core of a layer's context group (``dense`` without one)."""
    return CORES[DENSE if cp is None or cp.size == 1 else cp.comm_type]
