"""How a model's ordered layer list is cut into pipeline stages: the one split the model builder,
the memory model and the simulator all use.

A model of L transformer layers is the list [embedding, layer 0 .. layer L-1, head] (L + 2 items).
Stage r of d holds a run of transformer layers, plus the embedding when it is the first stage and
the head when it is the last. Without an explicit split every stage holds L/d layers (Megatron's
balanced split); ``split`` gives each stage's layer count instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class StageSlice:
    """What stage ``r`` holds: transformer layers ``first_layer .. first_layer+num_layers-1``,
    and whether it holds the embedding and the head."""

    first_layer: int
    num_layers: int
    embedding: bool
    head: bool

    @property
    def range(self) -> tuple[int, int]:
        """Half-open range of list indices (embedding = 0, layer i = i + 1, head = L + 1)."""
        start = 0 if self.embedding else 1 + self.first_layer
        end = 1 + self.first_layer + self.num_layers + (1 if self.head else 0)
        return start, end


def layers_per_stage(num_layers: int, d: int, split: Sequence[int] | None = None) -> tuple[int, ...]:
    """Transformer layers of each of the ``d`` stages."""
    if split is None:
        if num_layers % d:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {d}")
        return (num_layers // d,) * d
    counts = tuple(int(n) for n in split)
    if len(counts) != d or min(counts) < 1 or sum(counts) != num_layers:
        raise ConfigError(f"a stage split needs {d} positive layer counts summing to {num_layers}, got {list(counts)}")
    return counts


def stage_slice(num_layers: int, d: int, r: int, split: Sequence[int] | None = None) -> StageSlice:
    """What stage ``r`` of ``d`` holds."""
    counts = layers_per_stage(num_layers, d, split)
    if not 0 <= r < d:
        raise ConfigError(f"pipeline stage must be in 0..{d - 1}, got r={r}")
    return StageSlice(sum(counts[:r]), counts[r], r == 0, r == d - 1)


def stage_range(num_layers: int, d: int, r: int, split: Sequence[int] | None = None) -> tuple[int, int]:
    """Half-open range of list indices (embedding = 0, head = L + 1) held by stage r."""
    return stage_slice(num_layers, d, r, split).range
