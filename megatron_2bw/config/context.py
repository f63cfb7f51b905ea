"""The context-parallel communication types (``--cp-comm-type``) as one torch-free table.

Each type states whether the planner prices it and what it needs of the layout; ``context_parallel/cores.py``
extends each row with its core (``dense`` is the core without context parallelism). Nothing else spells
the names: modules use these constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import _require

DENSE, P2P, ALL_GATHER, A2A = "dense", "p2p", "all_gather", "a2a"


@dataclass(frozen=True)
class ContextType:
    """A ``--cp-comm-type``: ``planned`` (the planner prices it), ``scatters_heads`` (its c ranks split a
    tensor rank's heads and key/value groups, which must divide by c)."""

    name: str
    planned: bool
    scatters_heads: bool = False

    def check(self, c: int, t: int, heads: int, groups: int) -> None:
        """The type's own divisibility rule (a ``ConfigError`` line)."""
        if c > 1 and self.scatters_heads:
            heads, groups = heads // t, max(1, groups // t)
            _require(heads % c == 0 and groups % c == 0,
                     f"--cp-comm-type {self.name} scatters attention heads over --context-parallel-size {c}: a tensor "
                     f"rank's {heads} heads and {groups} key/value groups must both be divisible by {c} "
                     f"(use {P2P} or {ALL_GATHER})")


# Megatron's --cp-comm-type (its hierarchical a2a+p2p is not built); a2a trains but is not priced yet
CONTEXT_TYPES = {t.name: t for t in (ContextType(P2P, True), ContextType(ALL_GATHER, True),
                                     ContextType(A2A, False, scatters_heads=True))}
CP_COMM_TYPES = tuple(CONTEXT_TYPES)
PLANNED_CP_COMM_TYPES = tuple(name for name, t in CONTEXT_TYPES.items() if t.planned)
