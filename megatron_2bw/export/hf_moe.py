"""Our mixture-of-experts GPTs <-> Hugging Face ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``.

Both are Llama-style (RoPE, RMSNorm, SwiGLU, grouped-query attention: ``hf_format.to_hf_llama`` maps everything
but the experts). Which class a model becomes is read off its experts: no shared expert -> Mixtral (every layer
MoE, softmax top-k renormalised); a shared expert with its sigmoid gate -> Qwen2-MoE (``mlp_only_layers`` for
the layers ``--moe-layer-freq`` leaves dense, ``norm_topk_prob`` false for ``--moe-router-pre-softmax``).
Routing HF does not implement in these classes (sigmoid scores, the expert bias, group-limited top-k, a scaling
factor, token dropping) is refused in one line: the export would be another model.

In memory transformers 5.x holds each layer's experts fused, as we do: the router ``mlp.gate.weight [E, h]``,
``mlp.experts.gate_up_proj [E, 2F, h]`` (the gate block first: our ``linear_fc1``) and ``mlp.experts.down_proj
[E, h, F]`` (our ``linear_fc2``), so the tensors are copied as they are; its ``save_pretrained`` writes them per
expert, as the published checkpoints store them (Mixtral's ``block_sparse_moe.experts.K.w1/w2/w3``, Qwen2-MoE's
``mlp.experts.K.gate_proj/up_proj/down_proj``), and ``from_pretrained`` fuses them again.
"""

from __future__ import annotations

import torch

from ..checkpoint.names import is_moe_layer
from ..config import ModelConfig
from ..config.moe import MoEConfig
from ..errors import ConfigError
from .hf_format import from_hf_llama, llama_common, llama_fields, to_hf_llama

MODEL_TYPES = ("mixtral", "qwen2_moe")
_EXPERTS = {"moe.router.weight": "gate.weight", "moe.experts.linear_fc1": "experts.gate_up_proj",
            "moe.experts.linear_fc2": "experts.down_proj"}
_SHARED_GATE = ("moe.shared_experts.gate_weight", "shared_expert_gate.weight")
_SHARED_FC2 = ("moe.shared_experts.linear_fc2.weight", "shared_expert.down_proj.weight")
_SHARED_FC1 = "moe.shared_experts.linear_fc1.weight"  # [gate; up] rows: HF's shared_expert.gate_proj, up_proj


def _refusal(cfg: ModelConfig) -> str | None:
    """Why ``cfg``'s experts cannot be written as Mixtral or Qwen2-MoE (None: they can)."""
    m = cfg.moe
    what = [flag for flag, on in (
        ("--moe-router-score-function sigmoid", m.moe_router_score_function != "softmax"),
        ("--moe-router-enable-expert-bias", m.moe_router_enable_expert_bias),
        ("--moe-router-num-groups", m.moe_router_num_groups is not None),
        ("--moe-router-topk-scaling-factor", m.moe_router_topk_scaling_factor is not None),
        ("--moe-expert-capacity-factor", m.moe_expert_capacity_factor is not None),
        ("linear biases (no --disable-bias-linear)", cfg.add_bias_linear)) if on]
    if what:
        return (f"its {', '.join(what)} (Hugging Face's MixtralForCausalLM and Qwen2MoeForCausalLM route by "
                "softmax top-k, dropless, without linear biases)")
    if m.moe_shared_expert_intermediate_size is not None and not m.moe_shared_expert_gate:
        return "a shared expert without --moe-shared-expert-gate (Qwen2MoeForCausalLM gates its shared expert)"
    if m.moe_shared_expert_intermediate_size is None and m.moe_router_pre_softmax:
        return "--moe-router-pre-softmax without a shared expert (MixtralForCausalLM renormalises the top-k weights)"
    if m.moe_shared_expert_intermediate_size is None and not all(m.moe_layers(cfg.num_layers)):
        return "dense layers (--moe-layer-freq) without a shared expert (MixtralForCausalLM has experts in every layer)"
    return None


def model_type(cfg: ModelConfig) -> str:
    """``mixtral`` or ``qwen2_moe`` for ``cfg``'s experts; refused in one line where neither holds them."""
    why = _refusal(cfg)
    if why is not None:
        raise ConfigError(f"--saver hf cannot write this MoE model: {why}; save it with --saver mcore or "
                          "--ckpt-format torch_dist instead")
    return "mixtral" if cfg.moe.moe_shared_expert_intermediate_size is None else "qwen2_moe"


def hf_moe_config(cfg: ModelConfig):
    """The ``MixtralConfig`` or ``Qwen2MoeConfig`` of ``cfg``."""
    from transformers import MixtralConfig, Qwen2MoeConfig  # noqa: PLC0415 - optional at import time

    kind, m, common = model_type(cfg), cfg.moe, llama_common(cfg)
    routed = dict(num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=m.moe_aux_loss_coeff)
    if kind == "mixtral":
        return MixtralConfig(**common, **routed, intermediate_size=m.moe_ffn_hidden_size, head_dim=cfg.head_dim,
                             num_local_experts=m.num_experts, router_jitter_noise=0.0, sliding_window=None,
                             architectures=["MixtralForCausalLM"])
    dense = [i for i, moe in enumerate(m.moe_layers(cfg.num_layers)) if not moe]
    return Qwen2MoeConfig(**common, **routed, intermediate_size=cfg.ffn_hidden_size, num_experts=m.num_experts,
                          moe_intermediate_size=m.moe_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=dense,
                          shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                          norm_topk_prob=not m.moe_router_pre_softmax, qkv_bias=False, use_sliding_window=False,
                          architectures=["Qwen2MoeForCausalLM"])


def hf_moe_class(cfg: ModelConfig):
    from transformers import MixtralForCausalLM, Qwen2MoeForCausalLM  # noqa: PLC0415

    return {"mixtral": MixtralForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM}[model_type(cfg)]


def to_hf_moe(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF model's (fused, in-memory) state dict of our full state dict."""
    model_type(cfg)
    out = to_hf_llama(cfg, full)
    for i in range(cfg.num_layers):
        if not is_moe_layer(cfg, i):
            continue
        g, h = f"{i + 1}.mlp.", f"model.layers.{i}.mlp."
        out.update({h + theirs: full[g + ours].contiguous() for ours, theirs in _EXPERTS.items()})
        if cfg.moe.moe_shared_expert_intermediate_size is not None:
            gate, up = full[g + _SHARED_FC1].chunk(2, 0)
            out[h + "shared_expert.gate_proj.weight"], out[h + "shared_expert.up_proj.weight"] = gate, up
            for ours, theirs in (_SHARED_FC2, _SHARED_GATE):
                out[h + theirs] = full[g + ours]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_moe(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_moe`."""
    full = from_hf_llama(cfg, sd)
    for i in range(cfg.num_layers):
        if not is_moe_layer(cfg, i):
            continue
        g, h = f"{i + 1}.mlp.", f"model.layers.{i}.mlp."
        full.update({g + ours: sd[h + theirs] for ours, theirs in _EXPERTS.items()})
        if cfg.moe.moe_shared_expert_intermediate_size is not None:
            full[g + _SHARED_FC1] = torch.cat([sd[h + "shared_expert.gate_proj.weight"],
                                               sd[h + "shared_expert.up_proj.weight"]])
            for ours, theirs in (_SHARED_FC2, _SHARED_GATE):
                full[g + ours] = sd[h + theirs]
    return {k: v.detach().float().contiguous() for k, v in full.items()}


def config_from_hf_moe(c) -> ModelConfig:
    """Our ModelConfig of a ``MixtralConfig`` or ``Qwen2MoeConfig``."""
    if c.model_type == "mixtral":
        if getattr(c, "sliding_window", None):
            raise ConfigError(f"Mixtral's sliding window ({c.sliding_window}) is not implemented: full attention only")
        moe = MoEConfig(c.num_local_experts, moe_ffn_hidden_size=c.intermediate_size,
                        moe_router_topk=c.num_experts_per_tok, moe_aux_loss_coeff=c.router_aux_loss_coef)
        return ModelConfig(**llama_fields(c), ffn_hidden_size=c.intermediate_size, add_bias_linear=False, moe=moe)
    if c.qkv_bias or c.use_sliding_window:
        raise ConfigError("Qwen2-MoE with qkv_bias or a sliding window is not implemented (--disable-bias-linear "
                          "and full attention only)")
    n, dense, step = c.num_hidden_layers, c.mlp_only_layers or [], c.decoder_sparse_step or 1
    layers = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(n))
    moe = MoEConfig(c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
                    moe_layer_freq=1 if all(layers) else layers,
                    moe_router_topk=c.num_experts_per_tok, moe_router_pre_softmax=not c.norm_topk_prob,
                    moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                    moe_shared_expert_gate=True, moe_aux_loss_coeff=c.router_aux_loss_coef)
    return ModelConfig(**llama_fields(c), ffn_hidden_size=c.intermediate_size, add_bias_linear=False, moe=moe)
