"""How much of its peak FLOP/s a device reaches, as the work per kernel grows.

Why this exists: the paper's planner reads per-microbatch times from a profile, so a larger
microbatch being more efficient is already in its numbers. Without a profile we estimate times
from FLOPs, and FLOPs alone would say a microbatch of 1 runs as fast per sample as one of 16.
It does not: small GEMMs leave tensor cores idle, and the fixed costs of a layer (kernel launches,
LayerNorm/softmax/dropout passes, the host side of autograd) are paid per microbatch. That is the
reason activation recomputation can *win* (it buys a larger microbatch for 4/3 of the compute),
and a calibration of this planner against the paper found its choices only come out with it.

The curve (a documented assumption, replaced by measurements when ``--profile`` is given)::

    fraction_of_peak(x) = max_fraction * x / (x + half_work)
    x = b * s * h / t      (elements of one GPU's share of a layer activation)

``x`` is the size of the GEMMs' row block times their width on one GPU: it grows with the
microbatch size ``b`` and the sequence length ``s``, and shrinks with tensor parallelism ``t``
(each GPU multiplies thinner matrices). The two constants are per device, in the cluster JSON:

- ``max_fraction``: what a large transformer layer sustains end to end (GEMMs plus the memory-bound
  ops between them). V100: Megatron-LM (2019) sustained 39 TFLOP/s = 31% of the 125 TFLOP/s peak
  for a 1.2B GPT on one GPU (b = 8, s = 1024, h = 1536: x = 12.6M elements); with
  ``half_work = 2M`` that is ``max_fraction = 0.312 * (12.6 + 2) / 12.6 = 0.36``.
- ``half_work``: the ``x`` at which half of ``max_fraction`` is reached. It stands for the fixed
  costs per layer and microbatch, and it is the one constant of the V100 preset fitted to the
  paper rather than read off a datasheet: at 2M the paper's 2.2B choice (d = 8, w = 8 with
  recomputation) comes within 5% of the planner's best and the 3.8B choice (d = 16, w = 4) comes
  first; at 1M the 2.2B choice falls to 15% behind, at 3M it is within 4%. For the GPT-2.2B layer
  (h = 2304, s = 512) the curve gives 17, 24, 32, 37, 41 TFLOP/s at b = 1, 2, 4, 8, 16: steeper
  than cuBLAS alone, since it also carries 2020-era eager-mode overheads that a profile measures.
  The same curve gives 8-way tensor parallelism of an h = 3072 layer (x = 3.1M at b = 8,
  s = 1024) 71% of the 1-GPU 1.2B model's efficiency; Megatron-LM reported 77% weak scaling at
  t = 8, all-reduces included, so the curve is, if anything, hard on tensor parallelism.
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
