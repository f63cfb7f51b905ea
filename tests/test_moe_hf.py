"""The whole MoE block against Hugging Face transformers' blocks on the same weights (fp32, dropless, no jitter):
identical expert choices first, then outputs within 1e-5. Mixtral's sparse block (softmax top-2), Qwen2-MoE's
(softmax before top-k with and without renormalisation, shared expert with its sigmoid gate) and DeepSeek-V3's
``DeepseekV3MoE`` (sigmoid, e_score_correction_bias, groups, routed scaling factor, ungated shared experts).

HF's fused experts are ``gate_up_proj [E, 2I, H]`` (gate block first) and ``down_proj [E, H, I]``: the layout of
our ``linear_fc1``/``linear_fc2``, copied as they are; HF's tokens are ``[b, s]``, ours ``[s, b]``."""

from __future__ import annotations

import pytest
import torch

from megatron_2bw.config.moe import MoEConfig
from megatron_2bw.moe import MoELayer

H, I_, E, S, B = 16, 32, 8, 7, 3


def _init(module: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 1.0 if name == "gate.weight" else 0.2)  # the router's logits well apart: no near-ties


def _ours(cfg: MoEConfig, experts, router_weight: torch.Tensor, grouped: bool) -> MoELayer:
    cfg = MoEConfig(**{**cfg.__dict__, "moe_ffn_hidden_size": I_, "moe_grouped_gemm": grouped})
    layer = MoELayer(cfg, H, gated=True).eval()
    with torch.no_grad():
        layer.router.weight.copy_(router_weight)
        layer.experts.linear_fc1.copy_(experts.gate_up_proj)
        layer.experts.linear_fc2.copy_(experts.down_proj)
    return layer


def _copy_shared(layer: MoELayer, mlp, gate=None) -> None:
    with torch.no_grad():
        layer.shared_experts.linear_fc1.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        layer.shared_experts.linear_fc2.weight.copy_(mlp.down_proj.weight)
        if gate is not None:
            layer.shared_experts.gate_weight.copy_(gate.weight)


def _compare(hf_block, layer: MoELayer, hf_indices) -> None:
    torch.manual_seed(11)
    x = torch.randn(B, S, H)
    with torch.no_grad():
        want = hf_block(x)
        want_idx = hf_indices(x.reshape(-1, H))
        route = layer.router(x.transpose(0, 1).reshape(-1, H), S, B)
        got = layer(x.transpose(0, 1)).transpose(0, 1)
    hf_map = torch.zeros(B * S, E, dtype=torch.bool).scatter(1, want_idx, True)
    ours_map = route.routing_map.view(S, B, E).transpose(0, 1).reshape(B * S, E)
    assert torch.equal(ours_map, hf_map), "expert choices differ"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert want.abs().max() > 1e-2  # the block does something


@pytest.mark.parametrize("grouped", [False, True])
def test_mixtral_sparse_block(grouped):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I_, num_local_experts=E,
                                             num_experts_per_tok=2, router_jitter_noise=0.0)).eval()
    _init(hf, 0)
    layer = _ours(MoEConfig(E, moe_router_topk=2), hf.experts, hf.gate.weight, grouped)
    _compare(hf, layer, lambda x: hf.gate(x)[2])


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_sparse_block_with_gated_shared_expert(norm_topk_prob):
    """``norm_topk_prob=False`` is ``--moe-router-pre-softmax``; True is the default softmax (top-k, softmax)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I_, num_experts=E,
                                               num_experts_per_tok=4, shared_expert_intermediate_size=24,
                                               norm_topk_prob=norm_topk_prob)).eval()
    _init(hf, 1)
    cfg = MoEConfig(E, moe_router_topk=4, moe_router_pre_softmax=not norm_topk_prob,
                    moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    layer = _ours(cfg, hf.experts, hf.gate.weight, grouped=True)
    _copy_shared(layer, hf.shared_expert, hf.shared_expert_gate)
    _compare(hf, layer, lambda x: hf.gate(x)[2])


def test_deepseek_v3_moe_block():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf = DeepseekV3MoE(DeepseekV3Config(hidden_size=H, moe_intermediate_size=I_, n_routed_experts=E,
                                        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        n_shared_experts=2, norm_topk_prob=True)).eval()
    _init(hf, 2)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(0.05 * torch.arange(E) - 0.2)
    cfg = MoEConfig(E, moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                    moe_shared_expert_intermediate_size=2 * I_)
    layer = _ours(cfg, hf.experts, hf.gate.weight, grouped=False)
    with torch.no_grad():
        layer.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    _copy_shared(layer, hf.shared_experts)
    _compare(hf, layer, lambda x: hf.gate(x)[2])
