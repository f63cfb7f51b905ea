"""Megatron's learning-rate schedule (AnnealingLR): linear warm-up, then decay to ``min_lr``.

``lr_at(cfg, t)`` is the rate of the update made by step ``t`` (0-based), i.e. after
``n = t + 1`` updates, with Megatron's formulas:

- warm-up (``n <= warmup``): ``lr * n / warmup``;
- after ``decay_iters``: ``min_lr``;
- otherwise, with ``r = (n - warmup) / (decay_iters - warmup)``: ``min_lr + (lr - min_lr) * c``
  where ``c = 1 - r`` (linear), ``(cos(pi r) + 1) / 2`` (cosine) or ``1`` (constant).

(Megatron evaluates the schedule before its first ``step()``, so its very first update uses
``n = 0``, a zero rate under warm-up; we count the update being made, so no step is wasted.)
With ``--train-samples`` (Megatron's sample-based schedule) ``n`` counts the samples consumed
by the update being made, ``(t + 1) * global batch``, and warm-up/decay lengths are in samples.
A pure function of the step: resuming needs no scheduler state.
"""

from __future__ import annotations

import math

from ..config import LRConfig


def lr_at(cfg: LRConfig, step: int) -> float:
    n = (step + 1) * (cfg.samples_per_step or 1)  # updates, or consumed samples with --train-samples
    if cfg.warmup_iters > 0 and n <= cfg.warmup_iters:
        return cfg.lr * n / cfg.warmup_iters
    if cfg.decay_style == "constant":
        return cfg.lr
    if n > cfg.decay_iters:
        return cfg.min_lr
    span = cfg.decay_iters - cfg.warmup_iters
    ratio = (n - cfg.warmup_iters) / span if span > 0 else 1.0
    coeff = 1.0 - ratio if cfg.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff
