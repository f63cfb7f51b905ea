"""The process groups a model's layers talk over, as one bundle built once per run.

``ModelSpec`` hands it to every layer it builds (a block builder reads the groups it needs from it): a new
parallel dimension is one field here, not one constructor parameter per layer. Built from the layout's
:class:`~..parallel_state.ParallelState` by :meth:`ModelGroups.of`; the default is a single process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config.context import P2P
from ..context_parallel.group import CPGroup
from ..tensor_parallel.group import TPGroup
from .moe_block import MoEGroups


@dataclass(frozen=True)
class ModelGroups:
    """Tensor group (always; size 1 alone), context group (None: whole sequences), MoE groups (None: a dense
    model)."""

    tp: TPGroup = field(default_factory=TPGroup)
    cp: CPGroup | None = None
    moe: MoEGroups | None = None

    def __post_init__(self) -> None:
        if self.cp is not None and self.cp.size == 1:
            object.__setattr__(self, "cp", None)  # a context group of one is none

    def __deepcopy__(self, memo) -> ModelGroups:
        return self  # process-group handles: copies of a model share them

    @classmethod
    def of(cls, state, cp_comm_type: str = P2P, moe: bool = False) -> ModelGroups:
        """This rank's groups of a :class:`~..parallel_state.ParallelState` (``moe``: the model has experts)."""
        return cls(TPGroup.from_state(state), CPGroup.from_state(state, cp_comm_type) if state.c > 1 else None,
                   MoEGroups.from_state(state) if moe else None)
