"""Which rank holds which virtual stage: the data behind a transfer's peer once a rank holds several chunks.

A model cut into ``d * chunks`` virtual stages runs on ``d`` pipeline ranks; chunk ``c`` of rank ``r`` is
virtual stage :meth:`Placement.stage` ``(r, c)``. Activations flow from virtual stage ``s`` to ``s + 1``
and gradients back, so the rank a transfer goes to or comes from follows from the action's chunk:

- ``interleaved`` (Megatron's virtual pipeline, ``interleaved-1f1b``): stage ``c * d + r``, layers
  assigned round-robin, so rank ``d - 1``'s chunk ``c`` sends to rank 0's chunk ``c + 1``;
- ``v`` (two chunks in a V, ``zb-v``): chunk 0 runs ranks ``0 .. d-1``, chunk 1 back ``d-1 .. 0``, so
  rank ``d - 1``'s two chunks hand over on the rank itself (a local hand-over, not a transfer).

With one chunk both are the plain pipeline: stage ``r`` on rank ``r``. The schedule generator, the
checker and simulator (through the replay core), the transport and the executor all ask this object,
so a layout is one value, not a case in each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .actions import TRANSFERS, Action, Op

SHAPES = ("interleaved", "v")

_SENDS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
_ACTIVATION_OPS = frozenset({Op.SEND_ACT, Op.RECV_ACT})


@dataclass(frozen=True)
class Placement:
    """``d`` ranks holding ``chunks`` model chunks each, laid out as ``shape`` (see the module docstring)."""

    d: int
    chunks: int = 1
    shape: str = "interleaved"

    def __post_init__(self) -> None:
        if self.d < 1 or self.chunks < 1:
            raise ConfigError(f"a placement needs d >= 1 and chunks >= 1, got d={self.d}, chunks={self.chunks}")
        if self.shape not in SHAPES:
            raise ConfigError(f"unknown chunk placement {self.shape!r}; choose one of {', '.join(SHAPES)}")
        if self.shape == "v" and self.chunks != 2:
            raise ConfigError(f"a V placement holds 2 chunks per rank, got {self.chunks}")

    @property
    def num_stages(self) -> int:
        """Virtual stages of the model: ``d * chunks``."""
        return self.d * self.chunks

    def stage(self, r: int, c: int) -> int:
        """The virtual stage chunk ``c`` of rank ``r`` holds."""
        if not (0 <= r < self.d and 0 <= c < self.chunks):
            raise ConfigError(f"rank {r} chunk {c} is outside a placement of {self.d} ranks x {self.chunks} chunks")
        if self.shape == "v" and c == 1:
            return 2 * self.d - 1 - r
        return c * self.d + r

    def rank(self, s: int) -> int:
        """The rank holding virtual stage ``s``."""
        if not 0 <= s < self.num_stages:
            raise ConfigError(f"virtual stage {s} is outside 0..{self.num_stages - 1}")
        if self.shape == "v" and s >= self.d:
            return 2 * self.d - 1 - s
        return s % self.d

    def chunk(self, s: int) -> int:
        """The chunk index virtual stage ``s`` has on its rank."""
        return s // self.d

    def stages_of(self, r: int) -> tuple[int, ...]:
        """Rank ``r``'s virtual stages, by chunk."""
        return tuple(self.stage(r, c) for c in range(self.chunks))

    def is_first(self, r: int, c: int) -> bool:
        """Whether chunk ``c`` of rank ``r`` is the model's first virtual stage (it holds the embedding)."""
        return self.stage(r, c) == 0

    def is_last(self, r: int, c: int) -> bool:
        """Whether chunk ``c`` of rank ``r`` is the model's last virtual stage (it holds the head and the loss)."""
        return self.stage(r, c) == self.num_stages - 1

    @property
    def ends_apart(self) -> bool:
        """Whether the model's first and last virtual stages are on different ranks (not in a V, nor at d = 1):
        where a tied word embedding is summed between two ranks."""
        return self.rank(0) != self.rank(self.num_stages - 1)

    def neighbour(self, r: int, a: Action) -> int | None:
        """The virtual stage a transfer of rank ``r`` talks to (None past either end of the model)."""
        s = self.stage(r, a.chunk) + TRANSFERS[a.op][0]
        return s if 0 <= s < self.num_stages else None

    def peer(self, r: int, a: Action) -> int | None:
        """The rank a transfer of rank ``r`` goes to or comes from (None: no such stage)."""
        s = self.neighbour(r, a)
        return None if s is None else self.rank(s)

    def message(self, r: int, a: Action) -> tuple[bool, int, int]:
        """What a transfer carries, the same for both ends: (activations?, sending virtual stage, microbatch)."""
        here = self.stage(r, a.chunk)
        sender = here if a.op in _SENDS else here + TRANSFERS[a.op][0]
        return a.op in _ACTIVATION_OPS, sender, a.mb


def _one_run(a: Action) -> int:
    return 0


def group_key(place: Placement):
    """How a program's transfers are cut into NCCL groups (``grouping.comm_groups``' ``peer``): one chunk
    per rank, runs with one peer (None: the default); several chunks, whole runs, since those programs
    place each round's transfers, both directions, as one run (``schedules.lower_rounds``)."""
    return None if place.chunks == 1 else _one_run
