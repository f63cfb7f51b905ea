"""How much of its peak FLOP/s a device reaches, as the work per kernel grows.

Without a profile the planner estimates times from FLOPs, and FLOPs alone would say a microbatch of
1 runs as fast per sample as one of 16. It does not: small GEMMs leave tensor cores idle, and a
layer's fixed costs (kernel launches, the memory-bound passes between GEMMs, the host side of
autograd) are paid per microbatch. This is why recomputation can pay off: it buys a larger
microbatch for 4/3 of the compute. A profile (``--profile``) replaces the curve with measurements.

The curve, an assumption with two per-device constants from the cluster JSON::

    fraction_of_peak(x) = max_fraction * x / (x + half_work)
    x = b * s * h / t      (elements of one GPU's share of a layer activation)

``x`` grows with the microbatch ``b`` and sequence length ``s`` and shrinks with tensor parallelism
``t`` (each GPU multiplies thinner matrices). ``max_fraction`` is what a large transformer layer
sustains end to end; ``half_work`` is the ``x`` at which half of it is reached, standing for the
fixed costs per layer and microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class EfficiencyCurve:
    """Saturating fraction of peak FLOP/s versus work size ``x = b*s*h/t``."""

    max_fraction: float
    half_work: float

    def __post_init__(self) -> None:
        if not 0.0 < self.max_fraction <= 1.0:
            raise ConfigError(f"efficiency max_fraction_of_peak must be in (0, 1], got {self.max_fraction}")
        if self.half_work < 0:
            raise ConfigError(f"efficiency half_work_elements must be >= 0, got {self.half_work}")

    def fraction(self, work: float) -> float:
        """Fraction of peak reached on ``work`` elements (0 for no work)."""
        if work <= 0:
            return 0.0
        return self.max_fraction * work / (work + self.half_work)


def layer_work(micro_batch_size: int, seq_length: int, hidden_size: int, tensor_parallel: int) -> float:
    """``x = b*s*h/t``: the work size the curve is a function of."""
    return micro_batch_size * seq_length * hidden_size / tensor_parallel
