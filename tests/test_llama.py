"""Llama-family layers (RoPE, SwiGLU, RMSNorm, grouped-query attention, untied output layer):
our model against transformers' LlamaForCausalLM with the same weights, the flags and their
errors, and every schedule and layout against the single-process run."""

import argparse
import functools

import pipeline_harness
import pytest
import torch
import torch.nn.functional as F
from multiproc import run_workers
from pipeline_harness import matching_shard, train_tiny

from megatron_2bw.checkpoint.megatron_format import Exported
from megatron_2bw.cli import model_config
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.hf_format import to_hf_llama
from megatron_2bw.export.hf_io import hf_model
from megatron_2bw.export.model_io import build_full_model, global_state_dict
from megatron_2bw.flags import FLAGS
from megatron_2bw.models.spec import ModelSpec, run_layers
from megatron_2bw.schedule.recompute_policy import RecomputePolicy

CASES = {  # (GQA groups or None, untied, rotary base)
    "gqa_untied": (2, True, 500000),
    "mha_tied": (None, False, 10000),
}


def _cfg(groups, untied, base) -> ModelConfig:
    return get_preset("llama-tiny", group_query_attention=groups is not None, num_query_groups=groups,
                      untie_embeddings_and_output_weights=untied, rotary_base=base)


def _fp64_rmsnorm(self, x):
    """LlamaRMSNorm without its cast to fp32 (for an fp64 model, a downcast that limits the reference
    to fp32 precision); otherwise the same formula."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _ours_and_theirs(cfg: ModelConfig, dtype: torch.dtype, monkeypatch):
    import transformers.models.llama.modeling_llama as ml

    if dtype == torch.float64:
        monkeypatch.setattr(ml.LlamaRMSNorm, "forward", _fp64_rmsnorm)
    ours = build_full_model(cfg, seed=7).to(dtype)
    theirs = hf_model(Exported(cfg, global_state_dict(ours))).to(dtype)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    a = run_layers(list(ours), batch)[..., :cfg.vocab_size]
    b = theirs(batch["tokens"]).logits
    for logits in (a, b):
        F.cross_entropy(logits.reshape(-1, cfg.vocab_size), batch["labels"].reshape(-1)).backward()
    ours_grads = to_hf_llama(cfg, {n: p.grad for n, p in ours.named_parameters()})
    theirs_grads = {n: p.grad for n, p in theirs.named_parameters()}
    return a, b, ours_grads, theirs_grads


@pytest.mark.torch_floor
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype,logit_tol,grad_tol", [(torch.float64, 1e-10, 1e-8), (torch.float32, 1e-5, 1e-5)],
                         ids=["fp64", "fp32"])
def test_matches_transformers_llama(case, dtype, logit_tol, grad_tol, monkeypatch):
    cfg = _cfg(*CASES[case])
    a, b, ga, gb = _ours_and_theirs(cfg, dtype, monkeypatch)
    assert (a - b).abs().max().item() < logit_tol
    assert set(gb) <= set(ga) and len(gb) >= 8 * cfg.num_layers - 1
    worst = max((ga[n] - gb[n]).abs().max().item() for n in gb)
    assert worst < grad_tol, worst
    assert max(g.abs().max().item() for g in gb.values()) > 1e-3  # the gradients are not all ~0


def test_parameter_count_matches_transformers():
    for case in CASES.values():
        cfg = _cfg(*case)
        theirs = hf_model(Exported(cfg, global_state_dict(build_full_model(cfg))))
        assert cfg.num_parameters() == sum(p.numel() for p in theirs.parameters())
    # Llama 3 8B and 70B: the published counts
    assert round(get_preset("llama-8b").num_parameters() / 1e6) == 8030
    assert round(get_preset("llama-70b").num_parameters() / 1e6) == 70554


def _args(**kw) -> argparse.Namespace:
    ns = argparse.Namespace(**{f.dest: (False if f.const is not None else None) for f in FLAGS})
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_flags_build_the_llama_config():
    cfg = model_config(_args(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=32,
                             position_embedding_type="rope", rotary_base=500000, rotary_percent=0.5, swiglu=True,
                             normalization="RMSNorm", group_query_attention=True, num_query_groups=2,
                             untie_embeddings_and_output_weights=True, disable_bias_linear=True), "gpt")
    assert (cfg.position_embedding_type, cfg.rotary_base, cfg.rotary_dim, cfg.swiglu, cfg.normalization) == (
        "rope", 500000, 16, True, "RMSNorm")
    assert (cfg.query_groups, cfg.tied_output, cfg.add_bias_linear) == (2, False, False)
    assert cfg.ffn_hidden_size == 320  # Megatron's SwiGLU default: int(4h * 2/3 / 64) * 64
    assert not cfg.sequence_parallel
    assert model_config(_args(model_preset="llama-tiny", sequence_parallel=True), "gpt").sequence_parallel
    preset = model_config(_args(model_preset="llama-tiny", hidden_size=192), "gpt")
    assert preset.ffn_hidden_size == 512 and preset.swiglu


@pytest.mark.parametrize("kw,t,msg", [
    (dict(group_query_attention=True, num_query_groups=3), 1,
     "--num-query-groups 3 does not divide --num-attention-heads 4"),
    (dict(group_query_attention=True), 1, "--group-query-attention needs --num-query-groups"),
    (dict(num_query_groups=2), 1, "--num-query-groups needs --group-query-attention"),
    (dict(group_query_attention=True, num_query_groups=1), 2,
     "--num-query-groups 1 is not divisible by --tensor-model"),
    (dict(position_embedding_type="alibi"), 1, "--position-embedding-type must be one of"),
    (dict(normalization="BatchNorm"), 1, "--normalization must be one of"),
    (dict(rotary_percent=0.0), 1, "--rotary-percent must be in (0, 1]"),
    (dict(kind="bert", swiglu=True), 1, "--swiglu is implemented for GPT models only"),
    (dict(kind="bert", sequence_parallel=True), 2, "--sequence-parallel is implemented for GPT models only"),
    (dict(sequence_parallel=True), 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (dict(sequence_parallel=True, seq_length=18), 4,
     "--seq-length 18 is not divisible by --tensor-model-parallel-size 4"),
])
def test_bad_llama_options_are_one_line_errors(kw, t, msg):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
    with pytest.raises(ConfigError) as e:
        cfg = ModelConfig(**{**base, **kw})
        cfg.check_tensor_parallel(t)
        cfg.check_sequence_parallel(t)
    assert msg in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- layouts
KW = dict(steps=3, lr=1e-3, kind="llama-tiny")
SCHEDULES = ("2bw", "flush", "gpipe")
SELECTIVE, FULL = RecomputePolicy("selective"), RecomputePolicy("full", "uniform", 2)


def _train(schedule, layout=None, policy=None, **kw):
    """``train_tiny`` on llama-tiny, every stage built under recomputation ``policy``."""
    class Spec(ModelSpec):
        def __init__(self, *args, **k):
            super().__init__(*args, recompute=policy, **k)

    saved = pipeline_harness.ModelSpec
    pipeline_harness.ModelSpec = Spec
    try:
        return train_tiny(schedule, layout=layout, **KW, **kw)
    finally:
        pipeline_harness.ModelSpec = saved


@functools.lru_cache(maxsize=None)
def _reference(schedule):
    return _train(schedule)


# one run of workers per layout; inside it every schedule, and the recomputation/optimizer variants
LAYOUTS = {  # (schedule, recomputation, distributed optimizer, sequence parallelism)
    (2, 2, 1): [(s, None, False, False) for s in SCHEDULES] + [("2bw", FULL, False, False)]
    + [(s, None, False, True) for s in SCHEDULES] + [("flush", FULL, False, True)],
    (2, 1, 2): [("flush", None, False, False), ("flush", None, True, False), ("gpipe", SELECTIVE, True, False),
                ("flush", None, True, True), ("2bw", SELECTIVE, False, True)],
    (1, 2, 2): [(s, None, s == "2bw", False) for s in SCHEDULES],
    # every axis at once (8 processes): each schedule with sequence parallelism (Flush with the distributed
    # optimizer), and 2BW without it
    (2, 2, 2): [("2bw", None, False, True), ("flush", None, True, True), ("gpipe", None, False, True),
                ("2bw", None, False, False)],
}


def _layout_runs(layout):
    return [_train(s, layout, policy, distributed_optimizer=zero, sequence_parallel=sp)
            for s, policy, zero, sp in LAYOUTS[layout]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "t{}d{}w{}".format(*l))
def test_layouts_match_single_process(layout):
    t, d, w = layout
    outs = run_workers(_layout_runs, t * d * w, layout, timeout=300)
    for k, (schedule, *_) in enumerate(LAYOUTS[layout]):
        ref = _reference(schedule)
        runs = [o[k] for o in outs]
        last = [r for r in runs if r["last"]]
        dloss = max(abs(a - b) for r in last for a, b in zip(r["losses"], ref["losses"]))
        assert dloss < 1e-5, (schedule, k, dloss)
        dparam, seen = 0.0, set()
        for r in runs:
            for name, p in r["params"].items():
                dparam = max(dparam, (matching_shard(ref["params"][name], p, r["coords"][0], t) - p).abs().max().item())
                seen.add(name)
        assert seen == set(ref["params"])
        assert dparam < 1e-5, (schedule, k, dparam)
    assert not any("word" in n and "output" in n for n in seen)


def test_untied_output_layer_is_its_own_parameter():
    ref = _reference("flush")
    names = set(ref["params"])
    assert "0.word.weight" in names and "5.output_layer.weight" in names and "0.position" not in names
    assert not torch.equal(ref["params"]["0.word.weight"], ref["params"]["5.output_layer.weight"])


def test_planner_command_rebuilds_the_llama_model():
    """The trainer command the planner prints (``argv.pretrain_argv``) states every Llama option."""
    from dataclasses import replace

    from megatron_2bw.argv import pretrain_argv
    from megatron_2bw.cli import parse_args
    from megatron_2bw.config import Layout
    from megatron_2bw.planner.hardware import load_cluster
    from megatron_2bw.planner.search import tensor_sizes

    model = get_preset("llama-8b")
    argv = pretrain_argv(model, Layout(2, 2, 1, False, "2bw"), 16)
    assert "--swiglu" in argv and "--disable-bias-linear" in argv and "--untie-embeddings-and-output-weights" in argv
    back = model_config(parse_args(argv[1:] + ["--lr", "1e-3", "--train-iters", "1"], "gpt"), "gpt")
    assert replace(back, vocab_size=model.vocab_size) == model  # the trainer's vocabulary comes from its tokenizer
    odd = get_preset("llama-tiny", num_query_groups=1)
    assert tensor_sizes(odd, load_cluster("aws-p3.16xlarge"), 8) == (1,)  # one query group: no t > 1
