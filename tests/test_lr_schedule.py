"""Megatron's learning-rate schedule: warm-up, linear / cosine / constant decay, min-lr."""

from __future__ import annotations

import math

import pytest

from megatron_2bw.config import LRConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.training.lr_schedule import lr_at


def test_warmup_then_linear_decay():
    cfg = LRConfig(lr=1.0, min_lr=0.1, decay_style="linear", warmup_iters=4, decay_iters=14)
    assert [lr_at(cfg, t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]  # step t uses t + 1 updates
    assert lr_at(cfg, 8) == pytest.approx(0.1 + 0.9 * (1 - 5 / 10))
    assert lr_at(cfg, 13) == pytest.approx(0.1)
    assert lr_at(cfg, 100) == 0.1


def test_cosine_and_constant():
    cos = LRConfig(lr=2.0, min_lr=0.0, decay_style="cosine", warmup_iters=0, decay_iters=10)
    assert lr_at(cos, 4) == pytest.approx(0.5 * (math.cos(math.pi * 0.5) + 1) * 2.0)
    assert lr_at(cos, 9) == pytest.approx(0.0, abs=1e-12)
    values = [lr_at(cos, t) for t in range(10)]
    assert values == sorted(values, reverse=True)
    const = LRConfig(lr=3e-4, min_lr=1e-5, decay_style="constant", warmup_iters=2, decay_iters=10)
    assert [lr_at(const, t) for t in (0, 1, 2, 50)] == [1.5e-4, 3e-4, 3e-4, 3e-4]


def test_no_warmup_first_step_uses_nearly_full_rate():
    cfg = LRConfig(lr=1.0, decay_style="linear", decay_iters=100)
    assert lr_at(cfg, 0) == pytest.approx(0.99)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=1.0, min_lr=2.0), "--min-lr 2.0 must be in"),
    (dict(lr=1.0, warmup_iters=20, decay_iters=10), "--lr-warmup-iters 20 exceeds"),
    (dict(lr=0.0), "--lr must be positive"),
    (dict(lr=1.0, decay_style="exp"), "--lr-decay-style must be one of"),
])
def test_bad_schedules(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LRConfig(**kwargs)
