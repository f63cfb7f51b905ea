"""Numerical health: stop a run that has diverged instead of training on (or skipping) forever.

Rules, checked for each step on values every rank shares (the loss reduced over ranks, the global
gradient norm, the skip flag) at the same step on every rank (``step_stats.py``), so every rank
reaches the same verdict at the same time and the loop stops them all a few steps later:

- a non-finite loss stops the run on any precision: the loss is computed before loss
  scaling, so no scale can cause or cure it (Megatron's "found NaN in local forward loss");
- a non-finite gradient norm stops the run unless this is fp16, where it is how an overflow
  shows itself and the step is skipped (bf16 and fp32 never overflow by design);
- more than ``max_skipped_steps`` consecutive skipped steps stops it. Dynamic scaling halves
  the scale on each overflow, so a healthy run skips at most log2(initial / min scale)
  steps in a row while the scale descends (16 from 2**16 to 1), plus a few at the floor:
  the default is that plus 4 (20 with Megatron's defaults). A constant ``--loss-scale``
  never changes, so a run of overflows will not end by itself: 5 in a row is the default.

The caller must not save after a stop: the last checkpoint is the last good one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.rules import check_max_skipped_steps  # noqa: F401 - one implementation, below the config floor

EXIT_UNHEALTHY = 3  # distinct from 1 (crash) and 2 (bad input), so scripts do not requeue it
_DYNAMIC_MARGIN = 4
_CONSTANT_DEFAULT = 5


def default_max_skipped_steps(dtype: str, loss_scale: float | None, initial_loss_scale: float,
                              min_loss_scale: float) -> int:
    """The default ``--max-skipped-steps`` for this precision (see the module docstring)."""
    if dtype != "fp16":
        return 0
    if loss_scale is not None:
        return _CONSTANT_DEFAULT
    halvings = math.ceil(math.log2(max(initial_loss_scale / max(min_loss_scale, 1e-30), 1.0)))
    return halvings + _DYNAMIC_MARGIN


@dataclass
class HealthPolicy:
    """What counts as unhealthy for this run's precision."""

    fp16: bool
    dynamic_scale: bool
    max_skipped_steps: int
    loss_scale: float | None = None

    @classmethod
    def from_config(cls, dtype: str, loss_scale: float | None, initial_loss_scale: float, min_loss_scale: float,
                    max_skipped_steps: int | None = None) -> "HealthPolicy":
        check_max_skipped_steps(max_skipped_steps)
        limit = max_skipped_steps if max_skipped_steps is not None else default_max_skipped_steps(
            dtype, loss_scale, initial_loss_scale, min_loss_scale)
        fp16 = dtype == "fp16"
        return cls(fp16=fp16, dynamic_scale=fp16 and loss_scale is None, max_skipped_steps=limit,
                   loss_scale=loss_scale if fp16 else None)


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


class HealthMonitor:
    """Feed it every step in order; ``check`` returns a one-line reason to stop, or None."""

    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.consecutive_skipped = 0
        self.total_skipped = 0
        self.steps = 0
        self.first_skip: int | None = None

    def check(self, step: int, loss: float | None, grad_norm: float | None, skipped: bool) -> str | None:
        """Verdict after ``step`` (the number the message shows; the loop passes the 1-based iteration).
        ``loss`` None: this rank/step has no loss (not last stage)."""
        p = self.policy
        self.steps += 1
        if not _finite(loss):
            return (f"iteration {step}: the loss is {loss} (not finite): training diverged; "
                    "lower --lr or check the data (the last checkpoint is kept)")
        if not _finite(grad_norm) and not p.fp16:
            return (f"iteration {step}: the gradient norm is {grad_norm} (not finite) in "
                    "non-fp16 training: training diverged; lower --lr (the last checkpoint is kept)")
        if skipped:
            self.total_skipped += 1
            self.consecutive_skipped += 1
            if self.consecutive_skipped == 1:
                self.first_skip = step
        else:
            self.consecutive_skipped = 0
            self.first_skip = None
        if self.consecutive_skipped > p.max_skipped_steps:
            return self._skip_reason(step)
        return None

    def _skip_reason(self, step: int) -> str:
        p, n = self.policy, self.consecutive_skipped
        head = f"iteration {step}: {n} consecutive steps skipped (iterations {self.first_skip}-{step}, " \
               f"more than --max-skipped-steps {p.max_skipped_steps})"
        if p.fp16 and not p.dynamic_scale:
            if self.total_skipped == self.steps:
                return (f"{head}: every step overflowed with the constant --loss-scale {p.loss_scale:g}; "
                        "use a smaller --loss-scale or dynamic scaling (omit --loss-scale)")
            return f"{head}: the constant --loss-scale {p.loss_scale:g} overflows; use a smaller one or dynamic scaling"
        if p.fp16:
            return f"{head}: the gradients overflow even at the minimum loss scale: training diverged; lower --lr"
        return f"{head}: the gradients are not finite: training diverged; lower --lr"

    def check_steps(self, steps: list[tuple[int, float | None, float | None, bool]]) -> str | None:
        """``check`` over a segment's (step, loss, grad_norm, skipped) rows; the first reason to stop."""
        for row in steps:
            reason = self.check(*row)
            if reason is not None:
                return reason
        return None
