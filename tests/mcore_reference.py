"""Megatron-Core itself (``megatron-core==0.16.1``, installed with ``--no-deps``; the ``interop`` extra) as the
reference for its checkpoint format, run on the CPU in worker processes (tests/multiproc.py).

CUDA assumptions are shimmed here, in the worker processes only: ``torch.cuda.current_device()`` answers
``"cpu"`` (the attention scratch buffer, ``GlobalMemoryBuffer.get_tensor``, and RoPE's ``inv_freq`` are moved
there), and the RNG tracker's ``fork`` (it swaps CUDA RNG states, around a dropout of probability 0 here) is a
no-op.
The causal mask is passed explicitly (its default is built on ``"cuda"``). Megatron-Core's code is called, never
copied: its ``GPTModel`` with the local layer spec, its ``load_state_dict``/``state_dict_for_save_checkpoint``, its
``sharded_state_dict`` (whose key mapping names the local layers as Transformer Engine's) and its
``dist_checkpointing.save``."""

from __future__ import annotations

import argparse
import contextlib
import os
import zlib

import torch
import torch.distributed as dist

PIP = "pip install --no-deps megatron-core==0.16.1 einops (the interop extra and the Makefile's setup)"


def available() -> str | None:
    """None when Megatron-Core and einops are installed, else why not (one line); cheap: nothing is imported."""
    import importlib.util

    for name in ("megatron.core", "einops"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{name} is not installed; {PIP}"
    return None


def setup(t: int, expert_tensor: int | None = None) -> None:
    """Megatron-Core's parallel state for ``t`` tensor ranks on the process group run_workers made (any earlier one
    destroyed), plus the shims. ``expert_tensor``: its expert tensor parallel size (None: its default, t; an MoE
    model built by :func:`build` has experts whole on every tensor rank: 1)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=t, pipeline_model_parallel_size=1,
                                             expert_tensor_parallel_size=expert_tensor)
    # the attention scratch buffer (GlobalMemoryBuffer) and RoPE's inv_freq go to torch.cuda.current_device()
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # the router's GEMM: Transformer Engine's when its import succeeded, else torch's (the name is left unbound)
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def build(cfg, t: int, seed: int = 0):
    """Megatron-Core's GPTModel (local layer spec) with the hyperparameters of our ``cfg``."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    conf = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size, tensor_model_parallel_size=t,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=cfg.layernorm_epsilon,
        add_bias_linear=cfg.add_bias_linear, normalization=cfg.normalization, gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else openai_gelu, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        use_cpu_initialization=True, init_method_std=cfg.init_method_std, **moe_fields(cfg))
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec() if cfg.moe is None else get_gpt_layer_local_spec(
        num_experts=cfg.moe.num_experts, moe_grouped_gemm=False, normalization=cfg.normalization)
    model = GPTModel(conf, spec, vocab_size=cfg.padded_vocab_size(t),
                     max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type=cfg.position_embedding_type,
                     rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent,
                     share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
                     parallel_output=False)
    return model.eval()


def moe_fields(cfg) -> dict:
    """Megatron-Core's TransformerConfig fields for our MoE config (dropless, all-gather dispatch, no balancing
    loss: the forward alone is compared; its permutation unfused, the fused one needs CUDA; experts whole on every
    tensor rank, expert tensor parallel size 1, as our export writes them: setup(t, expert_tensor=1))."""
    m = cfg.moe
    if m is None:
        return {}
    return dict(num_moe_experts=m.num_experts, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                moe_router_topk=m.moe_router_topk, moe_router_score_function=m.moe_router_score_function,
                moe_router_pre_softmax=m.moe_router_pre_softmax, moe_router_num_groups=m.moe_router_num_groups,
                moe_router_group_topk=m.moe_router_group_topk,
                moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=m.moe_shared_expert_gate, moe_token_dispatcher_type="allgather",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_permute_fusion=False,
                gradient_accumulation_fusion=False, expert_tensor_parallel_size=1)


def perturb(model) -> None:
    """Random biases and norms too (init leaves them 0/1); the same noise per name on every tensor rank, so
    replicated tensors stay equal across ranks."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand_as(tokens), attention_mask=mask)


def megatron_args(cfg, t: int, iteration: int) -> argparse.Namespace:
    """The arguments Megatron-LM saves with a Megatron-Core model (its own names; ``--openai-gelu`` for GPT)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.hidden_size // cfg.num_attention_heads,
        group_query_attention=cfg.group_query_attention, num_query_groups=cfg.num_query_groups,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.seq_length,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, padded_vocab_size=cfg.padded_vocab_size(t),
        tensor_model_parallel_size=t, pipeline_model_parallel_size=1,
        position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent, swiglu=cfg.swiglu, openai_gelu=not cfg.swiglu,
        bias_gelu_fusion=False, normalization=cfg.normalization, layernorm_epsilon=cfg.layernorm_epsilon,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        add_bias_linear=cfg.add_bias_linear, use_mcore_models=True, transformer_impl="local", ckpt_format="torch",
        fp16=False, bf16=False, params_dtype=torch.float32, iteration=iteration, init_method_std=cfg.init_method_std,
        **moe_args(cfg))


def moe_args(cfg) -> dict:
    """Megatron-LM's MoE arguments (its flag names) of a Megatron-Core MoE model, as its trainer saves them."""
    m = cfg.moe
    if m is None:
        return {"num_experts": None}
    return dict(num_experts=m.num_experts, moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_layer_freq=1,
                moe_router_topk=m.moe_router_topk, moe_router_score_function=m.moe_router_score_function,
                moe_router_pre_softmax=m.moe_router_pre_softmax, moe_router_num_groups=m.moe_router_num_groups,
                moe_router_group_topk=m.moe_router_group_topk,
                moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=m.moe_shared_expert_gate, moe_grouped_gemm=False,
                moe_router_enable_expert_bias=False, moe_token_dispatcher_type="allgather",
                moe_aux_loss_coeff=[0.0], moe_router_load_balancing_type=["none"], expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, moe_router_dtype=None)


def save_torch_format(model, cfg, root: str, t: int, iteration: int) -> None:
    """Megatron's torch checkpoint layout, written by every tensor rank of the first data-parallel replica: the
    model's own ``state_dict_for_save_checkpoint()`` with Megatron's args (the pointer file last, after a barrier)."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() == 0:
        d = os.path.join(root, f"iter_{iteration:07d}",
                         f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}")
        os.makedirs(d, exist_ok=True)
        torch.save({"model": model.state_dict_for_save_checkpoint(), "args": megatron_args(cfg, t, iteration),
                    "checkpoint_version": 3.0, "iteration": iteration}, os.path.join(d, "model_optim_rng.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def te_named_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the names Megatron-Core's own ``sharded_state_dict`` gives them: the local
    layer spec's ``sharded_state_dict_keys_map`` renames its norms as Transformer Engine's fused ones
    (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``). Its keys stack the layers
    (``decoder.layers.<name>``, the layer an axis of its own): the layer number comes back from the state-dict key."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for key, value in model.sharded_state_dict().items():
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            continue  # ShardedObject: the linears' _extra_state
        name = value.key
        if ".layers." in key:
            head, rest = key.split(".layers.", 1)
            name = name.replace(f"{head}.layers.", f"{head}.layers.{rest.split('.', 1)[0]}.", 1)
        out[name] = value.data
    return out
