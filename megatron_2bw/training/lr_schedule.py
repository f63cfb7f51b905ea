"""Megatron's learning-rate schedule (OptimizerParamScheduler): linear warm-up, then decay to ``min_lr``.

``lr_at(cfg, t)`` is the rate of the update made by step ``t`` (0-based), i.e. after
``n = t + 1`` updates, with Megatron's formulas:

- warm-up (``n <= warmup``): ``lr * n / warmup``;
- constant: ``lr`` after the warm-up;
- after ``decay_iters``: ``min_lr``;
- inverse-square-root: ``max(min_lr, lr * sqrt(max(warmup, 1)) / sqrt(max(n, 1)))``, counted in
  samples as Megatron counts them (with ``warmup`` 0 that is ``lr / sqrt(n * global batch)``);
- otherwise, with ``r = (n - warmup) / (decay_iters - warmup)``: ``min_lr + (lr - min_lr) * c``
  where ``c = 1 - r`` (linear), ``(cos(pi r) + 1) / 2`` (cosine), or for WSD (warm-up, stable,
  decay) ``1`` until ``a = decay_iters - wsd_decay_iters`` and then, with ``q = (n - a) / wsd_decay_iters``,
  ``2 * 0.5**q - 1`` (exponential), ``1 - q`` (linear), ``(cos(pi q) + 1) / 2`` (cosine) or
  ``1 - sqrt(q)`` (minus_sqrt).

(Megatron evaluates the schedule before its first ``step()``, so its very first update uses
``n = 0``, a zero rate under warm-up; we count the update being made, so no step is wasted.)
With ``--train-samples`` (Megatron's sample-based schedule) ``n`` counts the samples consumed
by the update being made, ``(t + 1) * global batch``, and warm-up/decay lengths are in samples.
A pure function of the step: resuming needs no scheduler state.
"""

from __future__ import annotations

import math

from ..config import LRConfig


def _wsd_coeff(style: str, q: float) -> float:
    """Megatron's WSD anneal coefficient at fraction ``q`` of the anneal."""
    if style == "linear":
        return 1.0 - q
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * q) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, q) - 1.0
    return 1.0 - math.sqrt(q)  # minus_sqrt


def lr_at(cfg: LRConfig, step: int) -> float:
    n = (step + 1) * (cfg.samples_per_step or 1)  # updates, or consumed samples with --train-samples
    if cfg.warmup_iters > 0 and n <= cfg.warmup_iters:
        return cfg.lr * n / cfg.warmup_iters
    if cfg.decay_style == "constant":
        return cfg.lr
    if n > cfg.decay_iters:
        return cfg.min_lr
    if cfg.decay_style == "inverse-square-root":
        # Megatron counts samples: sqrt(warmup * B) / sqrt(n * B) = sqrt(warmup / n); with no warm-up its
        # max(warmup, 1) is one sample, so n is in samples there
        per = 1 if cfg.samples_per_step else (cfg.global_batch_size or 1)
        warm = max(cfg.warmup_iters * per, 1)
        return max(cfg.min_lr, cfg.lr * math.sqrt(warm) / math.sqrt(max(n * per, 1)))
    span = cfg.decay_iters - cfg.warmup_iters
    ratio = (n - cfg.warmup_iters) / span if span > 0 else 1.0
    if cfg.decay_style == "WSD":
        anneal_start = cfg.decay_iters - cfg.wsd_decay_iters
        coeff = 1.0 if n <= anneal_start else _wsd_coeff(cfg.wsd_decay_style, (n - anneal_start) / cfg.wsd_decay_iters)
    else:
        coeff = 1.0 - ratio if cfg.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff
