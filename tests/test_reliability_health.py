"""Numerical health: NaN/inf and runs of skipped steps stop the run; the expected fp16 overflows do not.

Overflows come from real fp16 arithmetic (a gradient times the loss scale cast to fp16) driven by the
project's own LossScaler, so the step at which the monitor stops is checked against what the scaler does."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_2bw.errors import ConfigError
from megatron_2bw.optimizer.loss_scaler import LossScaler
from megatron_2bw.training.health import HealthMonitor, HealthPolicy, check_max_skipped_steps, default_max_skipped_steps


def _fp16_overflows(grad: float, scale: float) -> bool:
    return bool(torch.isinf(torch.tensor(grad * scale, dtype=torch.float32).to(torch.float16)))


def _run_fp16(grad_of_step, steps: int, policy: HealthPolicy, scaler: LossScaler):
    """Feed the monitor what an fp16 run with this scaler would report; (stop step, reason, skipped steps)."""
    mon = HealthMonitor(policy)
    skipped = []
    for step in range(steps):
        g = grad_of_step(step)
        overflow = _fp16_overflows(g, scaler.scale)
        if overflow:
            skipped.append(step)
        reason = mon.check(step, 2.0, float("inf") if overflow else g, overflow)
        scaler.update(overflow)
        if reason is not None:
            return step, reason, skipped
    return None, None, skipped


def _descent_length(initial: float, min_scale: float) -> int:
    """How many overflows in a row the dynamic scaler takes from ``initial`` to its floor (simulated)."""
    s, n = LossScaler(initial, dynamic=True, min_scale=min_scale), 0
    while s.scale > min_scale:
        s.update(True)
        n += 1
    return n


@pytest.mark.parametrize("initial,min_scale", [(2.0**16, 1.0), (2.0**32, 1.0), (2.0**16, 2.0**8), (1.0, 1.0)])
def test_default_covers_the_scaler_descent(initial, min_scale):
    n = default_max_skipped_steps("fp16", None, initial, min_scale)
    assert n == _descent_length(initial, min_scale) + 4
    assert default_max_skipped_steps("fp16", None, 2.0**16, 1.0) == 20
    assert default_max_skipped_steps("fp16", 1024.0, initial, min_scale) == 5
    assert default_max_skipped_steps("bf16", None, initial, min_scale) == 0


def test_healthy_fp16_run_with_a_long_descent_is_not_stopped():
    # gradients of ~1000: the scale must fall from 2**16 to 64 before they fit in fp16 (10 skipped steps)
    policy = HealthPolicy.from_config("fp16", None, 2.0**16, 1.0)
    stop, reason, skipped = _run_fp16(lambda t: 1000.0, 200, policy, LossScaler(2.0**16, dynamic=True, window=50))
    assert stop is None and reason is None
    assert skipped[:10] == list(range(10)) and 10 not in skipped
    assert 2.0**16 / 2 ** len(skipped[:10]) * 1000 < 65504


def test_diverged_fp16_run_stops_after_max_skipped():
    # gradients of 1e6 overflow fp16 even at scale 1: every step skips from step 3 on
    policy = HealthPolicy.from_config("fp16", None, 2.0**16, 1.0)
    grads = lambda t: 1e-3 if t < 3 else 1e6  # noqa: E731
    stop, reason, skipped = _run_fp16(grads, 100, policy, LossScaler(2.0**16, dynamic=True, window=1000))
    assert skipped[0] == 3 and stop == 3 + policy.max_skipped_steps
    assert reason == (f"iteration {stop}: 21 consecutive steps skipped (iterations 3-{stop}, more than "
                      "--max-skipped-steps 20): the gradients overflow even at the minimum loss scale: "
                      "training diverged; lower --lr")


def test_constant_loss_scale_that_always_overflows():
    policy = HealthPolicy.from_config("fp16", 1e30, 2.0**16, 1.0)
    stop, reason, skipped = _run_fp16(lambda t: 0.01, 100, policy, LossScaler(1e30))
    assert skipped == list(range(6)) and stop == 5
    assert "every step overflowed with the constant --loss-scale 1e+30" in reason


def test_nan_loss_stops_any_precision_at_its_step():
    # --lr 1e4: a real SGD step on a quadratic blows up; the first non-finite loss is where we stop
    w = torch.tensor([1.0])
    for dtype in ("fp32", "bf16", "fp16"):
        mon = HealthMonitor(HealthPolicy.from_config(dtype, None, 2.0**16, 1.0))
        x, stop = w.clone(), None
        for step in range(50):
            loss = float((x ** 4).sum())
            grad = 4 * x ** 3
            reason = mon.check(step, loss, float(grad.norm()), False)
            if reason is not None:
                stop = step
                break
            x = x - 1e4 * grad
        expected = next(t for t in range(50) if not math.isfinite(_quartic_loss(1e4, t)))
        assert stop == expected, (dtype, stop, expected)
        assert reason.startswith(f"iteration {stop}: the loss is ") and "training diverged" in reason


def _quartic_loss(lr: float, steps: int) -> float:
    x = torch.tensor([1.0])
    for _ in range(steps):
        x = x - lr * 4 * x ** 3
    return float((x ** 4).sum())


def test_nonfinite_grad_norm_is_expected_only_in_fp16():
    assert HealthMonitor(HealthPolicy.from_config("fp16", None, 2.0**16, 1.0)).check(7, 3.0, float("nan"), True) is None
    reason = HealthMonitor(HealthPolicy.from_config("bf16", None, 2.0**16, 1.0)).check(7, 3.0, float("nan"), True)
    assert reason.startswith("iteration 7: the gradient norm is nan (not finite) in non-fp16 training")


def test_skip_counter_resets_and_missing_loss_is_fine():
    mon = HealthMonitor(HealthPolicy.from_config("fp16", None, 2.0**16, 1.0, max_skipped_steps=2))
    rows = [(0, None, float("inf"), True), (1, None, float("inf"), True), (2, None, 1.0, False),
            (3, None, float("inf"), True), (4, None, float("inf"), True)]
    assert mon.check_steps(rows) is None and mon.total_skipped == 4
    assert mon.check(5, None, float("inf"), True).startswith("iteration 5: 3 consecutive steps skipped (iterations 3-5")


def test_flag_check():
    check_max_skipped_steps(None)
    check_max_skipped_steps(1)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ConfigError, match="--max-skipped-steps must be a positive integer"):
            check_max_skipped_steps(bad)
