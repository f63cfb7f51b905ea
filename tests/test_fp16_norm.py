"""Review finding S1: fp16 gradient norms are taken in fp32, so a large finite step is not an overflow.

``torch._foreach_norm`` of fp16 tensors returns fp16 norms: any tensor whose *scaled* norm is above
65504 read as inf and its finite step was skipped. Reference: the norm computed in float64.
"""

import math

import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.pipeline.grad_reducer import grad_sumsq
from megatron_2bw.pipeline.updater import Updater
from megatron_2bw.pipeline.weights import sized_weights


def test_fp16_step_with_a_large_finite_scaled_norm_is_not_skipped():
    w = sized_weights(20000, dtype=torch.float16, device=torch.device("cpu"), num_versions=1,
                      params_per_view=10000, grad_dtype=torch.float16)
    opt = OptimizerConfig("sgd", lr=1e-3, weight_decay=0.0, clip_grad=1.0, dtype="fp16")
    upd = Updater(w, opt)
    scale = upd.loss_scale(0)
    grad = w.grad_flat[w.grad_buffer(0)]
    grad.copy_(torch.linspace(500.0, 1500.0, grad.numel()))  # scaled, finite; each view's norm ~1e5 > 65504
    views = w.norm_views[w.grad_buffer(0)]
    assert max(float(torch.linalg.vector_norm(v.double())) for v in views) > 65504  # fp16 would read inf
    ref = math.sqrt(sum(float(v.double().square().sum()) for v in views))
    assert math.isclose(math.sqrt(float(grad_sumsq(views, w.device))), ref, rel_tol=1e-6)
    before = w.flat[0].float().clone()
    update = upd.step_alone(0, lr=1e-3)
    assert not update.skipped and math.isclose(update.norm, ref / scale, rel_tol=1e-6)
    assert update.loss_scale == scale and upd.scaler.scale == scale  # no overflow backoff
    assert not torch.equal(w.flat[0].float(), before)  # the update was applied (clipped: norm > 1)


def test_grad_sumsq_of_bf16_and_fp32_views_against_float64():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        views = [(torch.randn(n, generator=g) * 300).to(dtype) for n in (7, 1000, 4096)]
        ref = sum(float(v.double().square().sum()) for v in views)
        assert math.isclose(float(grad_sumsq(views, torch.device("cpu"))), ref, rel_tol=1e-5), dtype
