"""The layout's named axes: one record of the sizes every other layout record holds or derives from.

Names are torchtitan's (``tensor``, ``context``, ``expert``, ``data``, ``pipeline``) plus the pipeline's
``virtual`` chunks per rank. ``data`` is the data width (the paper's ``w``: replicas reading different data);
``replicas`` = data x context, the ranks of a stage holding the same dense weights (Megatron's data group
"with context parallel"); experts are folded inside the replicas (Megatron-Core's order), ``expert_data`` =
replicas / expert holding the same expert piece. Rank order is Megatron's, tensor fastest::

    rank = pipeline_rank * (tensor * replicas) + replica_rank * tensor + tensor_rank

with ``replica_rank = data_rank * context + context_rank`` and ``expert_rank = replica_rank % expert``.
Torch-free: the planner, the config and the process-group set-up share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import _require

AXIS_NAMES = ("tensor", "context", "expert", "data", "pipeline", "virtual")


@dataclass(frozen=True)
class Axes:
    """Sizes of the layout's axes; ``world = tensor * context * data * pipeline`` (expert and virtual fold
    inside others)."""

    tensor: int = 1
    context: int = 1
    expert: int = 1
    data: int = 1
    pipeline: int = 1
    virtual: int = 1

    def __post_init__(self) -> None:  # the planner builds one per candidate: checks first, messages on failure
        if min(self.tensor, self.context, self.expert, self.data, self.pipeline, self.virtual) < 1:
            name = next(n for n in AXIS_NAMES if getattr(self, n) < 1)
            _require(False, f"the {name} axis must be >= 1, got {getattr(self, name)!r}")
        if self.data * self.context % self.expert:
            _require(False, f"--expert-model-parallel-size {self.expert} does not divide data-parallel size "
                            f"{self.data} x --context-parallel-size {self.context}")

    @property
    def replicas(self) -> int:
        """Ranks of a stage holding the same dense weights: data x context."""
        return self.data * self.context

    @property
    def expert_data(self) -> int:
        """Ranks of a stage holding the same expert piece: replicas / expert."""
        return self.replicas // self.expert

    @property
    def world(self) -> int:
        return self.tensor * self.replicas * self.pipeline

    def rank(self, tensor: int, replica: int, pipeline: int) -> int:
        """Global rank of (tensor rank, replica rank, pipeline rank)."""
        return pipeline * (self.tensor * self.replicas) + replica * self.tensor + tensor

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tensor rank, replica rank, pipeline rank) of a global rank."""
        t, r = self.tensor, self.replicas
        return rank % t, (rank // t) % r, rank // (t * r)

    def stage_ranks(self, pipeline: int) -> list[int]:
        """Every rank of pipeline stage ``pipeline`` (its tensor x replica ranks: contiguous in this order)."""
        n = self.tensor * self.replicas
        return list(range(pipeline * n, (pipeline + 1) * n))

    def groups(self) -> dict[str, list[list[int]]]:
        """Every process group of the layout as lists of global ranks (``data``: the replicas; ``context``,
        ``expert`` (adjacent replica positions), ``expert_data`` (strided) and ``expert_copies`` (the expert
        ranks again, for the gradient reducer's thread) only where their axis is > 1)."""
        t, d, w, c, e = self.tensor, self.pipeline, self.replicas, self.context, self.expert
        at = self.rank
        tensor = [[at(i, j, k) for i in range(t)] for k in range(d) for j in range(w)]
        data = [[at(i, j, k) for j in range(w)] for k in range(d) for i in range(t)]
        pipeline = [[at(i, j, k) for k in range(d)] for j in range(w) for i in range(t)]
        groups = {"tensor": tensor, "data": data, "pipeline": pipeline,
                  "embedding": [sorted({p[0], p[-1]}) for p in pipeline],
                  "model": [sorted(at(i, j, k) for i in range(t) for k in range(d)) for j in range(w)]}
        if c > 1:
            groups["context"] = [[at(i, r * c + x, k) for x in range(c)]
                                 for k in range(d) for r in range(w // c) for i in range(t)]
        if e > 1:
            groups["expert"] = [[at(i, r * e + x, k) for x in range(e)]
                                for k in range(d) for r in range(w // e) for i in range(t)]
            groups["expert_data"] = [[at(i, r * e + x, k) for r in range(w // e)]
                                     for k in range(d) for x in range(e) for i in range(t)]
            # the expert group's ranks again, for the gradient reducer's thread (the sum of an expert norm over
            # its pieces): a group is one ordered stream of collectives, and under 2BW the reducer runs while
            # the training thread dispatches tokens over ``expert``
            groups["expert_copies"] = [list(g) for g in groups["expert"]]
        return groups

    def describe(self) -> str:
        """Every axis above 1, as ``t=2 c=2 e=2 w=2 d=2 v=2`` (``w``: the data width)."""
        short = {"tensor": "t", "context": "c", "expert": "e", "data": "w", "pipeline": "d", "virtual": "v"}
        return " ".join(f"{short[n]}={getattr(self, n)}" for n in AXIS_NAMES if getattr(self, n) > 1) or "t=1"
