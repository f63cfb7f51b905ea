"""The tensor-parallel group a layer belongs to, passed explicitly (never read from globals)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPGroup:
    """Tensor-parallel process group, this rank's index in it, and its size (group None when size 1)."""

    group: object | None = None
    rank: int = 0
    size: int = 1

    def __deepcopy__(self, memo) -> "TPGroup":
        return self  # a handle to a process group: copies of a model share it

    @classmethod
    def from_state(cls, state) -> "TPGroup":
        return cls(state.groups.tp, state.tp_rank, state.t)
