"""Routing and the balancing losses against Megatron-Core 0.16.1's own functions (``moe_utils``, run on the CPU):
scores, top-k, aux loss, sequence aux loss, z-loss and their gradients within 1e-6; the router module's injected
losses give the gradient of Megatron's losses added to the main loss; capacity and the expert-bias update."""

from __future__ import annotations

import mcore_reference as mref
import pytest
import torch

from megatron_2bw.config.moe import MoEConfig
from megatron_2bw.moe.capacity import drop_tokens, expert_capacity
from megatron_2bw.moe.losses import sequence_aux_loss, switch_aux_loss, z_loss
from megatron_2bw.moe.router import Router, updated_expert_bias
from megatron_2bw.moe.routing import dense_routing, scores_for_aux_loss, topk_routing

pytestmark = pytest.mark.skipif(mref.available() is not None, reason=str(mref.available()))

T, E = 24, 8
# (our keyword arguments, Megatron's keyword arguments): the router variants of the issue
VARIANTS = {
    "softmax": {"topk": 2},
    "pre_softmax": {"topk": 2, "pre_softmax": True},
    "softmax_groups": {"topk": 4, "num_groups": 4, "group_topk": 2},
    "sigmoid_bias_groups_scaling": {"topk": 4, "score_function": "sigmoid", "num_groups": 4, "group_topk": 2,
                                    "scaling_factor": 2.5, "bias": True},
}


@pytest.fixture(scope="module")
def mu():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


def _theirs(kw: dict) -> dict:
    out = {"topk": kw["topk"], "use_pre_softmax": kw.get("pre_softmax", False), "num_groups": kw.get("num_groups"),
           "group_topk": kw.get("group_topk"), "scaling_factor": kw.get("scaling_factor"),
           "score_function": kw.get("score_function", "softmax")}
    return out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_topk_routing_and_gradient_equal_megatron(mu, name):
    kw = dict(VARIANTS[name])
    torch.manual_seed(0)
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    bias = 0.1 * torch.randn(E, dtype=torch.float64) if kw.pop("bias", False) else None
    topk = kw.pop("topk")
    p, i = topk_routing(logits, topk, expert_bias=bias, **kw)
    ours_p, ours_map = dense_routing(p, i, E)
    ref_p, ref_map = mu.topk_routing_with_score_function(logits, **_theirs({**kw, "topk": topk}), expert_bias=bias)
    assert torch.equal(ours_map, ref_map)
    torch.testing.assert_close(ours_p, ref_p, atol=1e-6, rtol=0)
    g = torch.randn(T, E, dtype=torch.float64)
    (ga,) = torch.autograd.grad((ours_p * g).sum(), logits)
    (gb,) = torch.autograd.grad((ref_p * g).sum(), logits)
    torch.testing.assert_close(ga, gb, atol=1e-6, rtol=0)
    assert ga.abs().sum() > 0


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_seq_aux_and_z_loss_equal_megatron(mu, score_function):
    torch.manual_seed(1)
    s, b, k = 6, 4, 2
    logits = torch.randn(s * b, E, requires_grad=True)
    amap, scores = scores_for_aux_loss(logits, k, score_function)
    rmap, rscores = mu.compute_routing_scores_for_aux_loss(logits, k, score_function)
    assert torch.equal(amap, rmap)
    cases = {
        "aux": (switch_aux_loss(scores, amap.sum(0), s * b, k, E, 0.01),
                mu.switch_load_balancing_loss_func(rscores, rmap.sum(0), s * b, k, E, 0.01)),
        # Megatron's sequence aux loss (TopKRouter._apply_seq_aux_loss): the batch folded into the expert axis
        "seq_aux": (sequence_aux_loss(scores, amap, s, b, k, E, 0.01),
                    mu.switch_load_balancing_loss_func(rscores.reshape(s, -1), rmap.reshape(s, -1).sum(0), s, k, E,
                                                       0.01) / b),
        "z": (z_loss(logits, 1e-3), mu.z_loss_func(logits, 1e-3)),
    }
    for name, (ours, ref) in cases.items():
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0, msg=name)
        (ga,) = torch.autograd.grad(ours, logits, retain_graph=True)
        (gb,) = torch.autograd.grad(ref, logits, retain_graph=True)
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=0, msg=name)
        assert ga.abs().sum() > 0, name


def test_seq_aux_loss_is_aux_loss_for_one_sequence():
    """Megatron-Core's own check: with one sequence per microbatch the two losses are one."""
    torch.manual_seed(2)
    logits = torch.randn(10, E)
    amap, scores = scores_for_aux_loss(logits, 2, "softmax")
    torch.testing.assert_close(sequence_aux_loss(scores, amap, 10, 1, 2, E, 0.1),
                               switch_aux_loss(scores, amap.sum(0), 10, 2, E, 0.1), atol=0, rtol=0)


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_router_injects_megatron_losses_gradient(mu, balancing):
    """The router's probabilities carry the balancing and z-losses into backward: the router weight's and the
    input's gradients equal those of (main loss + Megatron's losses) computed from Megatron's functions."""
    cfg = MoEConfig(E, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                    moe_router_load_balancing_type=balancing)
    s, b, h = 5, 2, 12
    torch.manual_seed(3)
    router = Router(cfg, h, init_std=0.5).train()
    x = torch.randn(s * b, h, requires_grad=True)
    g = torch.randn(s * b, E)
    route = router(x, s, b)
    (route.probs * g).sum().backward()
    w = router.weight.detach().clone().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    logits = x2 @ w.t()
    probs, rmap = mu.topk_routing_with_score_function(logits, 2)
    amap, scores = mu.compute_routing_scores_for_aux_loss(logits, 2, "softmax")
    if balancing == "aux_loss":
        aux = mu.switch_load_balancing_loss_func(scores, amap.sum(0), s * b, 2, E, 0.01)
    else:
        aux = mu.switch_load_balancing_loss_func(scores.reshape(s, -1), amap.reshape(s, -1).sum(0), s, 2, E, 0.01) / b
    ((probs * g).sum() + aux + mu.z_loss_func(logits, 1e-3)).backward()
    assert torch.equal(route.routing_map, rmap)
    torch.testing.assert_close(router.weight.grad, w.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-6, rtol=0)
    name = "load_balancing_loss" if balancing == "aux_loss" else "seq_load_balancing_loss"
    assert abs(float(route.losses[name]) - float(aux) / 0.01) < 1e-5


def test_token_dropping_by_probs_equals_megatron(mu):
    torch.manual_seed(4)
    logits = torch.randn(16, 4)
    probs, rmap = mu.topk_routing_with_score_function(logits, 2)
    for pad in (False, True):
        ours = drop_tokens(probs, rmap, 2, 0.5, "probs", pad)
        ref = mu.apply_router_token_dropping(probs, rmap, 2, 0.5, "probs", pad)
        assert torch.equal(ours[1], ref[1])
        torch.testing.assert_close(ours[0], ref[0], atol=0, rtol=0)


def test_capacity_by_position_hand_case():
    """6 tokens, 3 experts, top-1, factor 1: capacity ceil(6 * 1 / 3 * 1) = 2; expert 0 is chosen by tokens
    0, 1, 3, 4, so position keeps 0 and 1; expert 1 (tokens 2, 5) keeps both; expert 2 has none."""
    assert expert_capacity(6, 3, 1, 1.0) == 2
    chosen = torch.tensor([0, 0, 1, 0, 0, 1])
    rmap = torch.nn.functional.one_hot(chosen, 3).bool()
    probs = rmap.float() * torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6, 0.5]).unsqueeze(1)
    p, m = drop_tokens(probs, rmap, 1, 1.0, "position")
    assert m[:, 0].tolist() == [True, True, False, False, False, False]
    assert m[:, 1].tolist() == rmap[:, 1].tolist() and not m[:, 2].any()
    p, m = drop_tokens(probs, rmap, 1, 1.0, "probs")  # the two highest: tokens 3 (0.95) and 0 (0.9)
    assert m[:, 0].tolist() == [True, False, False, True, False, False]
    p, m = drop_tokens(probs, rmap, 1, 1.0, "position", pad_to_capacity=True)
    assert m.sum(0).tolist() == [2, 2, 2] and m[:2, 2].all()  # expert 2 padded with tokens 0 and 1, weight 0
    assert p[:, 2].abs().sum() == 0 and p[0, 0] == 0.9


def test_expert_bias_update_rule():
    """Megatron's rule: bias += rate * sign(mean - count) (mean of [4, 0, 2, 2] is 2)."""
    bias = torch.tensor([0.1, 0.0, -0.1, 0.0])
    out = updated_expert_bias(torch.tensor([4.0, 0.0, 2.0, 2.0]), bias, 1e-3)
    torch.testing.assert_close(out, torch.tensor([0.099, 0.001, -0.1, 0.0]))


def test_router_counts_tokens_and_updates_its_bias():
    cfg = MoEConfig(4, moe_router_topk=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.01)
    router = Router(cfg, 8, init_std=0.5)
    x = torch.randn(10, 8)
    route = router(x, 10, 1)
    assert torch.equal(router.local_tokens_per_expert, route.tokens_per_expert.float())
    router(x, 10, 1, count_tokens=False)  # a recomputation: not counted again
    with torch.no_grad():
        router(x, 10, 1)  # evaluation: not counted
    counts = route.tokens_per_expert.float()
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, torch.sign(counts.mean() - counts) * 0.01)
    assert router.local_tokens_per_expert.sum() == 0
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()
