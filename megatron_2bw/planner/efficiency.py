"""How much of its peak FLOP/s a device reaches, as the work per kernel grows.

Without a profile the planner estimates times from FLOPs, and FLOPs alone would say a microbatch of
1 runs as fast per sample as one of 16. It does not: small GEMMs leave tensor cores idle, and a
layer's fixed costs (kernel launches, the memory-bound passes between GEMMs, the host side of
autograd) are paid per microbatch. This is why recomputation can pay off: it buys a larger
microbatch for 4/3 of the compute. A profile (``--profile``) replaces the curve with measurements.

The curve, an assumption with two per-device constants from the cluster JSON::

    fraction_of_peak(x) = max_fraction * x / (x + half_work)

``max_fraction`` is what a large transformer layer sustains end to end; ``half_work`` is the ``x``
at which half of it is reached. Two measures of ``x`` exist (``EfficiencyCurve.unit``):

- ``"macs"`` (cluster key ``half_work_macs``, every preset): ``x = b * s * h^2 / t``, the
  multiply-adds of one ``h x h/t`` GEMM of the layer on one GPU. Then a layer's time is its FLOPs at
  ``max_fraction`` of peak plus a fixed cost per layer and microbatch
  (``24 * half_work / (peak * max_fraction)`` seconds of forward), whatever the model's width: a
  wide model's GEMMs hide the fixed costs, as Megatron-LM's weak scaling (44% of peak at h = 2304 up
  to 52% at h = 25600, Narayanan et al. 2021, Table 1) shows. Calibrated against published results:
  ``docs/planner.md`` section 7.
- ``"elements"`` (cluster key ``half_work_elements``, the earlier form, still read): ``x = b*s*h/t``.
  Its fixed cost grows with ``h``, so it under-prices wide models (0.21 MFU predicted for
  Megatron's GPT-3 175B layout, about 0.34 measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

UNITS = ("macs", "elements")


@dataclass(frozen=True)
class EfficiencyCurve:
    """Saturating fraction of peak FLOP/s versus work size ``x`` (see the module docstring)."""

    max_fraction: float
    half_work: float
    unit: str = "elements"

    def __post_init__(self) -> None:
        if not 0.0 < self.max_fraction <= 1.0:
            raise ConfigError(f"efficiency max_fraction_of_peak must be in (0, 1], got {self.max_fraction}")
        if self.half_work < 0:
            raise ConfigError(f"efficiency half_work_{self.unit} must be >= 0, got {self.half_work}")
        if self.unit not in UNITS:
            raise ConfigError(f"efficiency unit must be one of {', '.join(UNITS)}, got {self.unit!r}")

    def fraction(self, work: float) -> float:
        """Fraction of peak reached on ``work`` (in ``unit``; 0 for no work)."""
        if work <= 0:
            return 0.0
        return self.max_fraction * work / (work + self.half_work)

    def work(self, micro_batch_size: int, seq_length: int, hidden_size: int, tensor_parallel: int) -> float:
        """``x`` of a transformer layer in this curve's unit."""
        if self.unit == "macs":
            return gemm_work(micro_batch_size, seq_length, hidden_size, tensor_parallel)
        return layer_work(micro_batch_size, seq_length, hidden_size, tensor_parallel)

    def layer_fraction(self, micro_batch_size: int, seq_length: int, hidden_size: int, tensor_parallel: int) -> float:
        """Fraction of peak a transformer layer of this shape reaches on one GPU."""
        return self.fraction(self.work(micro_batch_size, seq_length, hidden_size, tensor_parallel))


def layer_work(micro_batch_size: int, seq_length: int, hidden_size: int, tensor_parallel: int) -> float:
    """``x = b*s*h/t`` (unit ``elements``): one GPU's share of a layer activation."""
    return micro_batch_size * seq_length * hidden_size / tensor_parallel


def gemm_work(micro_batch_size: int, seq_length: int, hidden_size: int, tensor_parallel: int) -> float:
    """``x = b*s*h^2/t`` (unit ``macs``): multiply-adds of one ``h x h/t`` GEMM on one GPU."""
    return micro_batch_size * seq_length * hidden_size * hidden_size / tensor_parallel
