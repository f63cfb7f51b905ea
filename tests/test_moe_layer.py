"""The MoE layer's own contracts: the grouped GEMM (torch._grouped_mm, forward and backward) equals the
per-expert loop; GELU experts equal a token-by-token loop; ``--moe-layer-recompute`` replays the same routing
and counts tokens once; another version of the expert bias routes without touching the layer's own; the
balancing losses' gradient scales with the caller's scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_2bw.config.moe import MoEConfig
from megatron_2bw.moe import MoELayer, set_aux_loss_scale
from megatron_2bw.moe.grouped_gemm import grouped_linear, grouped_mm_supported

H = 8


def test_grouped_mm_equals_the_loop_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(11, 8, requires_grad=True)
    w = torch.randn(4, 12, 8, requires_grad=True)
    counts = [3, 0, 6, 2]  # an expert without tokens
    assert grouped_mm_supported(x, w)
    g = torch.randn(11, 12)
    outs = []
    for grouped in (True, False):
        y = grouped_linear(x, w, counts, grouped)
        outs.append((y, *torch.autograd.grad((y * g).sum(), (x, w))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    ref = torch.cat([x[:3] @ w[0].t(), x[3:9] @ w[2].t(), x[9:] @ w[3].t()])
    torch.testing.assert_close(outs[0][0], ref, atol=1e-6, rtol=0)
    odd = torch.randn(4, 6, 8)  # 6 fp32 outputs = 24 bytes: not 16-byte aligned, the loop runs
    assert not grouped_mm_supported(x, odd)
    torch.testing.assert_close(grouped_linear(x, odd, counts, True), grouped_linear(x, odd, counts, False))


def test_gelu_experts_equal_a_token_loop():
    cfg = MoEConfig(4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_router_pre_softmax=True)
    torch.manual_seed(1)
    layer = MoELayer(cfg, H, gated=False, init_std=0.5).eval()
    x = torch.randn(3, 2, H)
    with torch.no_grad():
        y = layer(x).reshape(-1, H)
        tokens = x.reshape(-1, H)
        probs = torch.softmax(tokens @ layer.router.weight.t(), dim=-1)
        want = torch.zeros_like(tokens)
        for t in range(tokens.shape[0]):
            p, idx = probs[t].topk(2)
            for pk, e in zip(p, idx):
                h = F.gelu(layer.experts.linear_fc1[e] @ tokens[t], approximate="tanh")
                want[t] += pk * (layer.experts.linear_fc2[e] @ h)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=0)


def _run(recompute: bool) -> tuple[list[torch.Tensor], MoELayer]:
    cfg = MoEConfig(8, moe_ffn_hidden_size=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                    moe_layer_recompute=recompute)
    torch.manual_seed(2)
    layer = MoELayer(cfg, H, gated=True, init_std=0.5).train()
    x = torch.randn(5, 2, H, requires_grad=True)
    (layer(x) * torch.arange(H)).sum().backward()
    return [x.grad, *(p.grad for p in layer.parameters())], layer


def test_layer_recompute_replays_the_same_routing_and_counts_once():
    plain, a = _run(False)
    replayed, b = _run(True)
    for u, v in zip(plain, replayed):
        assert torch.equal(u, v)
    assert torch.equal(a.router.local_tokens_per_expert, b.router.local_tokens_per_expert)
    assert float(b.router.local_tokens_per_expert.sum()) == 10 * 2
    assert b.last_stats is not None and set(b.last_stats.losses) == {"z_loss", "load_balancing_loss"}


def test_another_bias_version_routes_without_touching_the_layers_bias():
    cfg = MoEConfig(8, moe_ffn_hidden_size=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True)
    torch.manual_seed(3)
    layer = MoELayer(cfg, H, gated=True, init_std=0.5).eval()
    x = torch.randn(4, 2, H)
    other = torch.linspace(-0.3, 0.3, 8)
    with torch.no_grad():
        y_other = layer(x, expert_bias=other)
        assert layer.router.expert_bias.abs().sum() == 0  # the layer's own version is unchanged
        y_own = layer(x)
        layer.router.expert_bias.copy_(other)
        y_copy = layer(x)
    assert torch.equal(y_other, y_copy) and not torch.allclose(y_other, y_own)


def test_balancing_loss_gradient_follows_the_scale():
    grads = {}
    for scale in (0.0, 1.0, 0.25):
        cfg = MoEConfig(4, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
        torch.manual_seed(4)
        layer = MoELayer(cfg, H, gated=True, init_std=0.5).train()
        set_aux_loss_scale(layer, scale)
        layer(torch.randn(6, 1, H)).sum().backward()
        grads[scale] = layer.router.weight.grad
    losses = grads[1.0] - grads[0.0]
    assert losses.abs().max() > 1e-4
    torch.testing.assert_close(grads[0.25] - grads[0.0], 0.25 * losses, atol=1e-6, rtol=0)
