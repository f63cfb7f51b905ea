"""How a model's ordered layer list is cut into pipeline stages.

A model of L transformer layers is the list [embedding, layer 0 .. layer L-1, head]
(L + 2 items). Stage r of d holds layers r*L/d .. (r+1)*L/d - 1, plus the embedding when it is
the first stage and the head when it is the last (Megatron's balanced split).
"""

from __future__ import annotations

from ..errors import ConfigError


def stage_range(num_layers: int, d: int, r: int) -> tuple[int, int]:
    """Half-open range of list indices (embedding = 0, head = L + 1) held by stage r."""
    if num_layers % d:
        raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {d}")
    per = num_layers // d
    start = 0 if r == 0 else 1 + r * per
    end = num_layers + 2 if r == d - 1 else 1 + (r + 1) * per
    return start, end
