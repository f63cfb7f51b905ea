"""The split backward (pipeline/split_backward.py) against the whole one: I's input gradient and W's
weight gradients equal a plain ``backward()``'s for GPT, Llama and BERT stages (first, middle and last,
tied embeddings, dropout, torch-checkpointed layers), and W runs no input-gradient GEMM: FLOPs counted
by torch's FlopCounterMode add up to the whole backward's, W's being the weight GEMMs alone."""

from __future__ import annotations

import pytest
import torch
from pipeline_harness import _dataset
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.pipeline.split_backward import accumulator, backward_input, backward_weight
from megatron_2bw.schedule.recompute_policy import RecomputePolicy
from megatron_2bw.tensor_parallel.random import RNGTracker


def _stage(kind: str, d: int, r: int, dropout: float = 0.0, policy: RecomputePolicy | None = None, **model):
    cfg = get_preset(kind, hidden_dropout=dropout, attention_dropout=dropout, **model)
    torch.manual_seed(0)
    tracker = RNGTracker(7, 0)
    spec = ModelSpec(cfg, ModelGroups(), 7, rng=tracker, recompute=policy)
    layers = nn.ModuleList(spec.build_stage(d, r))
    data = _dataset(cfg, 2)
    batch = spec.make_batch(data)
    return cfg, spec, layers, batch, tracker


def _run(cfg, spec, layers, batch, x, last):
    for layer in layers:
        x = layer(x, batch)
    return spec.loss_fn()(x, batch) if last else x


def _grads_both_ways(kind: str, d: int, r: int, dropout: float = 0.0, **kw):
    cfg, spec, layers, batch, tracker = _stage(kind, d, r, dropout, **kw)
    last = r == d - 1
    params = [p for p in layers.parameters()]
    x0 = torch.randn(2, cfg.seq_length, cfg.hidden_size) if r > 0 else None
    results = []
    for split in (False, True):
        for p in params:
            p.grad = torch.zeros_like(p)
        torch.manual_seed(5)
        tracker_state = tracker.get_state()
        x = x0.clone().requires_grad_(True) if x0 is not None else None
        out = _run(cfg, spec, layers, batch, x, last)
        g = None if last else torch.linspace(-1, 1, out.numel()).view_as(out)
        if not split:
            torch.autograd.backward(out, g)
            dx = x.grad
        else:
            index = {accumulator(p): i for i, p in enumerate(params)}
            dx, deferred = backward_input(out, g, x, index)
            assert all(p.grad.abs().sum() == 0 for p in params), "I must not produce weight gradients"
            backward_weight(deferred, params, index, main_grads=False)
        tracker.set_state(tracker_state)
        results.append((dx, [p.grad.clone() for p in params]))
    return params, results


CASES = [("gpt-tiny", 4, 1), ("gpt-tiny", 2, 1), ("llama-tiny", 4, 1), ("llama-tiny", 2, 1), ("bert-tiny", 2, 1),
         ("bert-tiny", 4, 2)]


@pytest.mark.parametrize(("kind", "d", "r"), CASES, ids=lambda v: str(v))
def test_split_gradients_equal_the_whole_backward(kind, d, r):
    params, ((dx_a, ga), (dx_b, gb)) = _grads_both_ways(kind, d, r, dropout=0.1)
    # the same kernels on the same inputs: equal up to the order in which a weight's uses are summed
    assert torch.allclose(dx_a, dx_b, rtol=0, atol=1e-6)
    scale = max(g.abs().max().item() for g in ga)
    for p, a, b in zip(params, ga, gb):
        assert a.abs().sum() > 0 or b.abs().sum() == 0
        assert torch.allclose(a, b, rtol=0, atol=1e-6 * max(scale, 1.0)), p.shape


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped-mm"])
def test_grouped_experts_weight_gradients_land_in_w(grouped):
    """An MoE stage (4 experts top-2, the aux and z losses injected): I makes no weight gradient (the grouped
    expert stacks' included, through torch._grouped_mm or one GEMM per expert), W makes them all, and both
    halves equal the whole backward's."""
    from megatron_2bw.config.moe import MoEConfig

    moe = MoEConfig(4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_grouped_gemm=grouped)
    params, ((dx_a, ga), (dx_b, gb)) = _grads_both_ways("gpt-tiny", 4, 1, moe=moe)
    stacks = [i for i, p in enumerate(params) if p.dim() == 3]
    assert len(stacks) == 2 and all(gb[i].abs().sum() > 0 for i in stacks)
    assert torch.allclose(dx_a, dx_b, rtol=0, atol=1e-6)
    scale = max(g.abs().max().item() for g in ga)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, rtol=0, atol=1e-6 * max(scale, 1.0))


def test_tied_head_gradient_lands_in_w():
    """The last stage's copy of the word embedding (the tied head) gets its gradient in W, not I."""
    cfg, spec, layers, batch, _ = _stage("gpt-tiny", 2, 1)
    tied = [p for p in layers.parameters() if getattr(p, "shared_embedding", False)]
    assert len(tied) == 1
    params = list(layers.parameters())
    index = {accumulator(p): i for i, p in enumerate(params)}
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    _, deferred = backward_input(_run(cfg, spec, layers, batch, x, True), None, x, index)
    assert tied[0].grad is None
    backward_weight(deferred, params, index, main_grads=False)
    assert tied[0].grad is not None and tied[0].grad.abs().sum() > 0


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("kind", ["gpt-tiny", "llama-tiny"])
def test_w_does_not_repeat_the_input_gradient_gemms(kind):
    """FLOPs: I + W == the whole backward, and W is exactly the weight GEMMs: 2 * rows * in * out per
    linear (a middle stage: every weight is a transformer linear, a norm or a bias)."""
    cfg, spec, layers, batch, _ = _stage(kind, 4, 1)
    params = list(layers.parameters())
    index = {accumulator(p): i for i, p in enumerate(params)}
    x0 = torch.randn(2, cfg.seq_length, cfg.hidden_size)

    def fresh():
        x = x0.clone().requires_grad_(True)
        out = _run(cfg, spec, layers, batch, x, False)
        return x, out, torch.ones_like(out)

    x, out, g = fresh()
    whole = _flops(lambda: torch.autograd.backward(out, g))
    x, out, g = fresh()
    box = {}
    i_flops = _flops(lambda: box.update(d=backward_input(out, g, x, index)[1]))
    w_flops = _flops(lambda: backward_weight(box["d"], params, index, main_grads=False))
    rows = 2 * cfg.seq_length
    weight_gemms = sum(2 * rows * p.shape[0] * p.shape[1] for p in params if p.dim() == 2)
    assert w_flops == weight_gemms
    assert i_flops + w_flops == whole
    assert i_flops >= w_flops  # the input GEMMs plus attention's score and context GEMMs


def test_torch_checkpointed_layers_split_too():
    """Layer-level recomputation (torch's non-reentrant checkpoint) gives the same gradients split."""
    params, ((dx_a, ga), (dx_b, gb)) = _grads_both_ways("gpt-tiny", 4, 1, dropout=0.1,
                                                        policy=RecomputePolicy("full", "uniform", 1))
    assert torch.allclose(dx_a, dx_b, rtol=0, atol=1e-6)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def _deferred(kind: str, d: int, r: int, dtype=torch.float32):
    cfg, spec, layers, batch, _ = _stage(kind, d, r)
    layers.to(dtype)
    params = list(layers.parameters())
    index = {accumulator(p): i for i, p in enumerate(params)}
    torch.manual_seed(3)
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, dtype=dtype, requires_grad=True)
    out = _run(cfg, spec, layers, batch, x, r == d - 1)
    g = None if r == d - 1 else torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
    return params, index, backward_input(out, g, x, index)[1]


@pytest.mark.parametrize(("kind", "d", "r"), [("gpt-tiny", 2, 1), ("bert-tiny", 4, 2), ("llama-tiny", 4, 1)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("main_grads", [False, True], ids=["grad", "main_grad"])
def test_fused_w_equals_the_engines_w(kind, d, r, main_grads, monkeypatch):
    """W's in-place kernels (wgrad_fusion) against autograd's own W on the same graph, into gradients that
    already hold a value (a step's earlier microbatch); under bf16 with fp32 main grads too. Every GPT,
    BERT and Llama group is one the fusion handles (in 16 bits Llama's RMSNorm scale, computed in fp32,
    goes the engine's way)."""
    from megatron_2bw.pipeline import split_backward, wgrad_fusion

    dtype = torch.bfloat16 if main_grads else torch.float32
    results, fused = [], []
    real = wgrad_fusion.fused_weight_grad

    def counted(*a):
        ok = real(*a)
        fused.append(ok)
        return ok

    for on in (True, False):
        monkeypatch.setattr(split_backward, "fused_weight_grad", counted if on else (lambda *a: False))
        params, index, deferred = _deferred(kind, d, r, dtype)
        torch.manual_seed(11)
        for p in params:
            start = torch.randn(p.shape)
            if main_grads:
                p.main_grad = start
            else:
                p.grad = start
        backward_weight(deferred, params, index, main_grads=main_grads)
        results.append([(p.main_grad if main_grads else p.grad).clone() for p in params])
    assert fused and (all(fused) if kind != "llama-tiny" or not main_grads else sum(fused) > len(fused) // 2)
    # the same products, accumulated in the GEMM or added after it: fp32 rounding, or bf16's for a bf16 GEMM
    tol = 2e-2 if main_grads else 1e-5
    for p, a, b in zip(params, *results):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item()), p.shape
