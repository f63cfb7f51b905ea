"""Mixture-of-experts model shapes and their parameter counts, total and active (torch-free).

Tiny CPU presets shaped like Mixtral (softmax top-2, every layer MoE), Qwen3-MoE (many small experts, top-k
renormalised) and DeepSeek-V3 (sigmoid scores with the aux-loss-free expert bias, group-limited routing, a
routed scaling factor, a shared expert, the first layers dense), and planner-scale ones: Mixtral 8x7B,
Qwen3-30B-A3B and a DeepSeek-V3-class model. The attention is this project's (grouped-query, head size
``h / heads``): Qwen3's 128-channel heads at ``h = 2048`` and DeepSeek's multi-head latent attention are not
modelled, so those two count slightly fewer / more attention parameters than published (the tests say how much).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from .model import ModelConfig
from .moe import MoEConfig

_LLAMA = {"position_embedding_type": "rope", "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
          "group_query_attention": True, "untie_embeddings_and_output_weights": True}


def _mixtral(layers: int, h: int, heads: int, groups: int, seq: int, vocab: int, ffn: int, moe: MoEConfig
             ) -> ModelConfig:
    return ModelConfig("gpt", layers, h, heads, seq, seq, vocab, ffn_hidden_size=ffn, num_query_groups=groups,
                       rotary_base=1000000, moe=moe, **_LLAMA)


_DSV3_ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_topk_scaling_factor": 2.5, "moe_router_load_balancing_type": "seq_aux_loss",
                "moe_aux_loss_coeff": 1e-4, "moe_token_dispatcher_type": "alltoall"}

MOE_PRESETS: dict[str, ModelConfig] = {
    # tiny CPU shapes (tests, the demo): vocabulary 300, 4 layers, hidden 64
    "mixtral-tiny": _mixtral(4, 64, 4, 2, 16, 300, 128, MoEConfig(
        8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall")),
    "qwen3-moe-tiny": _mixtral(4, 64, 4, 2, 16, 300, 192, MoEConfig(
        16, moe_ffn_hidden_size=32, moe_router_topk=4, moe_aux_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall")),
    "deepseek-v3-tiny": _mixtral(4, 64, 4, 4, 16, 300, 192, MoEConfig(
        16, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1, 1, 1), moe_router_topk=4, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_shared_expert_intermediate_size=32, **_DSV3_ROUTER)),
    # planner scale (no weights)
    "mixtral-8x7b": _mixtral(32, 4096, 32, 8, 4096, 32000, 14336, MoEConfig(8, moe_router_topk=2)),
    "qwen3-30b-a3b": _mixtral(48, 2048, 32, 4, 4096, 151936, 6144, MoEConfig(
        128, moe_ffn_hidden_size=768, moe_router_topk=8, moe_aux_loss_coeff=1e-3)),
    "deepseek-v3-class": _mixtral(61, 7168, 128, 128, 4096, 129280, 18432, MoEConfig(
        256, moe_ffn_hidden_size=2048, moe_layer_freq=(0,) * 3 + (1,) * 58, moe_router_topk=8,
        moe_router_num_groups=8, moe_router_group_topk=4, moe_shared_expert_intermediate_size=2048, **_DSV3_ROUTER)),
}


def get_moe_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name (``overrides``: ModelConfig fields)."""
    if name not in MOE_PRESETS:
        raise ConfigError(f"unknown MoE preset {name!r}; choose one of {', '.join(sorted(MOE_PRESETS))}")
    return replace(MOE_PRESETS[name], **overrides) if overrides else MOE_PRESETS[name]


def _mlp_params(h: int, ffn: int, gated: bool, bias: int) -> int:
    """One dense MLP: fc1 (two matrices with SwiGLU) and fc2, with their biases."""
    fc1 = 2 * ffn if gated else ffn
    return h * fc1 + fc1 * bias + ffn * h + h * bias


def moe_layer_params(model: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of one MoE MLP: the router ``[E, h]``, the experts (no biases; k of them
    active per token), the shared experts and their gate."""
    moe, h = model.moe, model.hidden_size
    expert = _mlp_params(h, moe.moe_ffn_hidden_size, model.swiglu, 0)
    shared = 0
    if moe.moe_shared_expert_intermediate_size:
        shared = (_mlp_params(h, moe.moe_shared_expert_intermediate_size, model.swiglu, 0)
                  + h * moe.moe_shared_expert_gate)
    router = moe.num_experts * h
    return router + moe.num_experts * expert + shared, router + moe.moe_router_topk * expert + shared


def parameter_counts(model: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model (unpadded vocabulary, a tied embedding once).
    A dense model's two numbers are both ``model.num_parameters()``."""
    total = model.num_parameters()
    if model.moe is None:
        return total, total
    dense_mlp = _mlp_params(model.hidden_size, model.ffn_hidden_size, model.swiglu, int(model.add_bias_linear))
    moe_total, moe_active = moe_layer_params(model)
    n = sum(model.moe.moe_layers(model.num_layers))
    return total + n * (moe_total - dense_mlp), total + n * (moe_active - dense_mlp)
