"""The planner's and the trainer's counts for the Llama-family layers: parameters per GPU against the
built modules, GEMM FLOPs against torch's FLOP counter, Megatron's closed form against the per-layer
sums, and the SwiGLU/GQA stash terms against the tensors autograd saves."""


import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_2bw.config.arith import flops_per_step
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.embedding import Embedding
from megatron_2bw.models.gpt import GPTHead
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.transformer import ParallelAttention, ParallelMLP, TransformerLayer
from megatron_2bw.planner.layer_costs import (
    core_forward_flops,
    embedding_params,
    head_forward_flops,
    head_params,
    layer_forward_flops,
    layer_params,
    layer_stash_bytes,
    tied_params,
)
from megatron_2bw.tensor_parallel.group import TPGroup

CONFIGS = {
    "llama-tiny": get_preset("llama-tiny"),  # GQA (2 groups), SwiGLU, RMSNorm, no biases, untied
    "mha-bias-tied": get_preset("llama-tiny", group_query_attention=False, num_query_groups=None, add_bias_linear=True,
                                untie_embeddings_and_output_weights=False, normalization="LayerNorm"),
    "gpt-tiny": get_preset("gpt-tiny"),
}


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("t", [1, 2])
def test_parameters_per_gpu_match_the_built_modules(name, t):
    cfg = CONFIGS[name]
    tp = TPGroup(None, 0, t)  # building needs no process group
    assert layer_params(cfg, t) == _count(TransformerLayer(cfg, ModelGroups(tp), 1, 0, causal=True))
    assert embedding_params(cfg, t) == _count(Embedding(cfg, tp, 1))
    assert head_params(cfg, t) == _count(GPTHead(cfg, tp, 1, None, None))
    assert tied_params(cfg, t) == (0 if name == "llama-tiny" else cfg.padded_vocab_size(t) * cfg.hidden_size // t)


@pytest.mark.parametrize("name", CONFIGS)
def test_layer_gemm_flops_match_torch_flop_counter(name):
    cfg = CONFIGS[name]
    b, s = 2, cfg.seq_length
    layer = TransformerLayer(cfg, ModelGroups(), 1, 0, causal=True)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(b, s, cfg.hidden_size), {})
    # torch's counter sees the GEMMs; on CPU the attention kernel is not counted, so add its two batched GEMMs
    assert counter.get_total_flops() + core_forward_flops(cfg, b, 1) == layer_forward_flops(cfg, b, 1)


@pytest.mark.parametrize("name", ["llama-tiny", "mha-bias-tied"])
def test_megatron_closed_form_is_the_sum_of_the_blocks(name):
    cfg = CONFIGS[name]
    B = 8
    blocks = 3 * (cfg.num_layers * layer_forward_flops(cfg, B, 1) + head_forward_flops(cfg, B, 1))
    assert flops_per_step(cfg, B) == pytest.approx(blocks, rel=1e-12)
    # full recomputation replays the layers' forwards, not the logits (Megatron's 96 form)
    layers = 3 * cfg.num_layers * layer_forward_flops(cfg, B, 1)
    assert flops_per_step(cfg, B, recompute=True) == pytest.approx(blocks + layers / 3, rel=1e-12)
    l8 = get_preset("llama-8b")  # about 6 * N FLOPs per token plus attention
    per_token = flops_per_step(l8, 1) / l8.seq_length
    assert 6 * l8.num_parameters() < per_token < 6 * l8.num_parameters() * 1.4


def _saved_bytes(fn, module) -> int:
    """Bytes of the distinct activations (not ``module``'s weights) autograd saves while ``fn`` runs."""
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(x):
        if x.untyped_storage().data_ptr() not in weights:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


class _KeepQKV(torch.autograd.Function):
    """Saves q, k and v as an attention kernel does, returns q."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def test_swiglu_and_gqa_stash_terms_match_saved_tensors():
    """The formula's MLP term (4 bsf with SwiGLU, 2 bsf with GeLU) and its K/V term (2 g d bs) are what
    autograd keeps: MLP stash = input + that term; attention minus the core = input + Q, K, V and the
    projection input (with RoPE, V is copied out of the QKV output so that the stash does not hold all of it)."""
    b, e = 2, 4
    for cfg in CONFIGS.values():
        s, h, f = cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size
        x = torch.randn(b, s, h, requires_grad=True)
        mlp = ParallelMLP(cfg, TPGroup(), 1, "m")
        mlp_term = (4 if cfg.swiglu else 2) * b * s * f * e
        assert _saved_bytes(functools.partial(mlp, x), mlp) == b * s * h * e + mlp_term
        attn = ParallelAttention(cfg, TPGroup(), 1, "a", True, None)
        attn.core = lambda q, k, v, mask: _KeepQKV.apply(q, k, v)  # what the kernel saves, minus any s^2 tensor
        got = _saved_bytes(functools.partial(attn, x), attn)
        tables = 2 * s * cfg.rotary_dim * e  # RoPE's cos and sin (0 without RoPE)
        assert got == b * s * h * e + (2 * h + 2 * cfg.query_groups * cfg.head_dim) * b * s * e + tables
    # the formula's split part counts the same Q/K/V/projection-input and MLP bytes
    cfg = CONFIGS["llama-tiny"]
    s, h, f, a = cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    split = layer_stash_bytes(cfg, b, 1, e) - 4 * b * s * h * e - a * b * s * s * e
    assert split == (2 * h + 2 * cfg.query_groups * cfg.head_dim) * b * s * e + 4 * b * s * f * e


def _layer_cfg(sp: bool):
    # LayerNorm: torch's kernel keeps only its input (and mean/rstd), as the formula counts; torch's
    # RMSNorm (a composite on CPU) also keeps the normalized tensor, which the formula leaves out
    return get_preset("llama-tiny", normalization="LayerNorm", sequence_parallel=sp)


def _layer_stash(sp: bool) -> int:
    """Activation bytes one layer saves at t = 2, with or without sequence parallelism."""
    import torch.distributed as dist

    tp = TPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    cfg = _layer_cfg(sp)
    layer = TransformerLayer(cfg, ModelGroups(tp), 1, 0, causal=True).train()
    s = cfg.seq_length // tp.size if sp else cfg.seq_length
    x = torch.randn(2, s, cfg.hidden_size, requires_grad=True)
    return _saved_bytes(lambda: layer(x, {}), layer)


def _stash_both(_):
    return _layer_stash(False), _layer_stash(True)


def test_sequence_parallel_shards_the_replicated_stash():
    """What --sequence-parallel saves at t = 2, measured from autograd's saved tensors (the norms' and
    the column-parallel linears' inputs: those keep only the shard and gather it again in backward),
    is the formula's replicated part halved, within 10% (the norms' mean/rstd are not in the formula)."""
    from multiproc import run_workers

    (full, sharded), other = run_workers(_stash_both, 2, None, timeout=120)
    assert other == (full, sharded)
    b, t, e = 2, 2, 4
    cfg = _layer_cfg(True)
    want = layer_stash_bytes(_layer_cfg(False), b, t, e) - layer_stash_bytes(cfg, b, t, e)
    assert want == 4 * b * cfg.seq_length * cfg.hidden_size * e // 2
    assert abs((full - sharded) - want) <= 0.1 * want, (full, sharded, want)
