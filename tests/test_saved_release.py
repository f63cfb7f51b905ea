"""A split backward frees at I what its W does not read (``pipeline/saved_release.py``).

Against an independent reference: the weight and input gradients of a whole ``autograd`` backward of the
same stage, and the planner's analytic count of what W reads (``layer_costs.weight_grad_input_bytes``),
for GPT, Llama and BERT stages in the middle of a pipeline and at its end (with the head and the loss).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from pipeline_harness import _dataset
from torch import nn

from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.pipeline.saved_release import BoxedSaves, release_unread
from megatron_2bw.pipeline.split_backward import accumulator, backward_input, backward_weight
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
from megatron_2bw.tensor_parallel.random import RNGTracker

B = 2


def _stage(kind: str, r: int):
    cfg = get_preset(kind, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    spec = ModelSpec(cfg, ModelGroups(), 7, rng=RNGTracker(7, 0))
    layers = nn.ModuleList(spec.build_stage(4, r))  # d = 4: a layer in the middle; a layer and the head last
    return cfg, spec, layers, spec.make_batch(_dataset(cfg, B))


def _forward(cfg, spec, layers, batch, x, last):
    out = x
    for layer in layers:
        out = layer(out, batch)
    return spec.loss_fn()(out, batch) if last else out


@pytest.mark.parametrize("kind", ["gpt-tiny", "llama-tiny", "bert-tiny"])
@pytest.mark.parametrize("r", [1, 3])
def test_w_after_release_equals_the_whole_backward(kind, r):
    cfg, spec, layers, batch = _stage(kind, r)
    last = r == 3
    params = list(layers.parameters())
    weights = {p.untyped_storage().data_ptr() for p in params}
    x0 = torch.randn(B, cfg.seq_length, cfg.hidden_size)
    # the reference: a whole backward of the same forward
    x = x0.clone().requires_grad_(True)
    out = _forward(cfg, spec, layers, batch, x, last)
    g = None if last else torch.linspace(-1, 1, out.numel()).view_as(out)
    ref = torch.autograd.grad(out, [x, *params], g, allow_unused=True)
    # I, release, W
    x = x0.clone().requires_grad_(True)
    saves = BoxedSaves(weights)
    with saves.measure():
        out = _forward(cfg, spec, layers, batch, x, last)
    index = {accumulator(p): i for i, p in enumerate(params)}
    dx, deferred = backward_input(out, g, x, index)
    alive = [weakref.ref(b.t) for b in saves.boxes if b.t is not None]
    held = release_unread(saves.boxes, deferred, weights)
    del out
    gc.collect()
    freed = sum(w() is None for w in alive)
    assert freed > 0 and held < saves.bytes  # the attention core, the GeLU / SwiGLU inputs, the loss's softmax
    for p in params:
        p.grad = None
    backward_weight(deferred, params, index, main_grads=False)
    # the same products summed in another order: relative ~1e-7
    torch.testing.assert_close(dx, ref[0], rtol=1e-5, atol=1e-6)
    for p, want in zip(params, ref[1:]):
        if want is not None:
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
    # what stays is what the planner counts W reading (fp32, t = 1)
    costs = analytic_microbatch_costs(cfg, load_cluster("dgx-a100-80gb"), "fp32", 1, B)
    want = costs.layer.weight_grad_input_bytes + (costs.head.weight_grad_input_bytes if last else 0)
    assert held == want


def test_reading_a_released_tensor_fails_in_one_line():
    cfg, spec, layers, batch = _stage("gpt-tiny", 1)
    params = list(layers.parameters())
    weights = {p.untyped_storage().data_ptr() for p in params}
    x = torch.randn(B, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    saves = BoxedSaves(weights)
    with saves.measure():
        out = _forward(cfg, spec, layers, batch, x, False)
    index = {accumulator(p): i for i, p in enumerate(params)}
    _, deferred = backward_input(out, torch.ones_like(out), x, index)
    release_unread(saves.boxes, deferred, weights)
    with pytest.raises(RuntimeError, match="read an activation its I released"):
        torch.autograd.backward(out, torch.ones_like(out))  # a whole second backward needs what was freed
