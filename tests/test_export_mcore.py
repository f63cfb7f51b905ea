"""Megatron-Core torch-format checkpoints (``--saver/--loader mcore``): names as Megatron-LM's
``tools/checkpoint/schema_core.py`` lists them, round trips at t x d, and the GQA ``linear_qkv`` /
SwiGLU ``linear_fc1`` layouts against an independent reshape of a ``LlamaForCausalLM``'s q/k/v and
gate/up projections."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from export_helpers import gpt_logits, max_err, tiny

from megatron_2bw.checkpoint.megatron_format import read_rank_files
from megatron_2bw.export.checkpoints import load_checkpoint, save_checkpoint
from megatron_2bw.export.model_io import build_full_model, load_full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Megatron-Core's per-layer names (schema_core.py: CoreTESchema / CoreLocalSchema), written out here
TE_LAYER = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
            "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
            "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
            "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
LOCAL_LAYER = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
               "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
               "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
               "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tensors(model: dict) -> dict:
    return {k: v for k, v in model.items() if not k.endswith("._extra_state")}


@pytest.mark.parametrize("kind,impl,t,d", [("gpt", "transformer_engine", 2, 2), ("llama", "transformer_engine", 2, 2),
                                           ("llama", "local", 2, 1), ("bert", "local", 1, 2)])
def test_ours_to_mcore_to_ours_is_exact(tmp_path, kind, impl, t, d):
    ex, model = tiny(kind)
    cfg = ex.cfg
    save_checkpoint(ex, str(tmp_path), "mcore", t=t, d=d, transformer_impl=impl)
    files = read_rank_files(str(tmp_path / "iter_0000011"))
    assert set(files) == {(a, b) for a in range(t) for b in range(d)}
    first, last = files[(0, 0)], files[(t - 1, d - 1)]
    assert first["checkpoint_version"] == 3.0 and vars(first["args"])["transformer_impl"] == impl
    block = "encoder" if kind == "bert" else "decoder"
    names = TE_LAYER if impl == "transformer_engine" else LOCAL_LAYER
    if cfg.normalization == "RMSNorm":
        names = [n for n in names if not n.endswith(("layer_norm_bias", "layernorm.bias"))]
    if not cfg.add_bias_linear:
        names = [n for n in names if not n.endswith(".bias") or "norm" in n]
    per_stage = cfg.num_layers // d
    expected = {f"{block}.layers.{i}.{n}" for i in range(per_stage) for n in names}
    expected |= {"embedding.word_embeddings.weight"}
    expected |= {"embedding.position_embeddings.weight"} if cfg.position_embedding_type == "learned_absolute" else set()
    expected |= {"embedding.tokentype_embeddings.weight"} if cfg.num_tokentypes else set()
    if d == 1:
        expected |= {f"{block}.final_layernorm.weight"} | (
            {f"{block}.final_layernorm.bias"} if cfg.normalization == "LayerNorm" else set())
        expected |= set() if cfg.tied_output else {"output_layer.weight"}
    assert set(_tensors(first["model"])) == expected
    if impl == "transformer_engine":  # Transformer Engine modules' fp8 metadata (none here)
        assert first["model"][f"{block}.layers.0.self_attention.core_attention._extra_state"] is None
    last_keys = set(_tensors(last["model"]))
    assert f"{block}.final_layernorm.weight" in last_keys and (
        "output_layer.weight" in last_keys) == (not cfg.tied_output or d > 1)  # tied: the last stage's copy
    if kind == "bert":
        assert {"lm_head.dense.weight", "lm_head.layer_norm.weight", "output_layer.bias", "pooler.dense.weight",
                "binary_head.weight"} <= last_keys
    qkv = first["model"][f"{block}.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim // t, cfg.hidden_size)
    back, has_optimizer = load_checkpoint(str(tmp_path))
    assert not has_optimizer and back.cfg == cfg and back.iteration == 11
    assert set(back.weights) == set(ex.weights)
    assert all(torch.equal(back.weights[n], ex.weights[n]) for n in ex.weights)
    if kind != "bert":
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(1))
        again = load_full(build_full_model(back.cfg), back.cfg, back.weights).eval()
        assert torch.equal(gpt_logits(again, tokens, cfg.vocab_size), gpt_logits(model, tokens, cfg.vocab_size))


def test_mcore_layout_matches_hf_llama_gqa_and_converts_back(tmp_path):
    """HF -> mcore at t = 2: each rank's ``linear_qkv`` is its query groups' [q heads of the group; k; v]
    rows cut from HF's q_proj/k_proj/v_proj by hand, ``linear_fc1`` its [gate; up] rows; mcore -> HF is exact."""
    from test_llama_interop import _random_hf_llama
    from transformers import LlamaForCausalLM

    hf = _random_hf_llama(str(tmp_path / "hf"))
    sd = hf.state_dict()
    util = _tool("checkpoint_util")
    assert util.main(["--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mc"),
                      "--saver", "mcore", "--target-tensor-parallel-size", "2"]) == 0
    files = read_rank_files(str(tmp_path / "mc" / "iter_0000000"))
    heads, groups, hd, t = 4, 2, 12, 2
    per = heads // groups
    for r in range(t):
        m = files[(r, 0)]["model"]
        for i in range(4):
            pre, hfp = f"decoder.layers.{i}.", f"model.layers.{i}."
            q, k, v = (sd[f"{hfp}self_attn.{x}_proj.weight"] for x in "qkv")
            rows = []
            for g in range(r * groups // t, (r + 1) * groups // t):
                rows += [q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
            assert torch.equal(m[pre + "self_attention.linear_qkv.weight"], torch.cat(rows))
            gate, up = sd[f"{hfp}mlp.gate_proj.weight"], sd[f"{hfp}mlp.up_proj.weight"]
            f = gate.shape[0] // t
            assert torch.equal(m[pre + "mlp.linear_fc1.weight"],
                               torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]]))
            assert torch.equal(m[pre + "mlp.linear_fc2.weight"], sd[f"{hfp}mlp.down_proj.weight"].chunk(t, 1)[r])
            assert torch.equal(m[pre + "self_attention.linear_proj.weight"],
                               sd[f"{hfp}self_attn.o_proj.weight"].chunk(t, 1)[r])
            assert torch.equal(m[pre + "self_attention.linear_qkv.layer_norm_weight"],
                               sd[f"{hfp}input_layernorm.weight"])
            assert torch.equal(m[pre + "mlp.linear_fc1.layer_norm_weight"], sd[f"{hfp}post_attention_layernorm.weight"])
        assert torch.equal(m["decoder.final_layernorm.weight"], sd["model.norm.weight"])
        word = torch.cat([sd["model.embed_tokens.weight"], torch.zeros(56, 48)])  # 200 rows padded to 128 * t
        assert torch.equal(m["embedding.word_embeddings.weight"], word.chunk(t)[r])
    out = util.main(["--load-dir", str(tmp_path / "mc"), "--save-dir", str(tmp_path / "hf2"), "--saver", "hf"])
    assert out == 0
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    b = back.state_dict()
    assert set(sd) == set(b) and all(torch.equal(sd[k], b[k]) for k in sd)
    # mcore -> ours directly, against transformers' forward
    ex, _ = load_checkpoint(str(tmp_path / "mc"), "mcore")
    model = load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert max_err(gpt_logits(model, tokens, 200), hf(tokens).logits) < 1e-5


def test_mcore_reshard_and_legacy_loader_refuses(tmp_path, capsys):
    """mcore t2 -> mcore t1 local names through checkpoint_util (auto-detected source), and a legacy
    ``--loader megatron`` / ``--loader mcore`` mismatch is one error line."""
    ex, _ = tiny("llama")
    save_checkpoint(ex, str(tmp_path / "a"), "mcore", t=2, d=2)
    util = _tool("checkpoint_util")
    assert util.main(["--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "b"), "--saver", "core",
                      "--saver-transformer-impl", "local"]) == 0
    assert "as core t=1 d=1" in capsys.readouterr().out
    model = read_rank_files(str(tmp_path / "b" / "iter_0000011"))[(0, 0)]["model"]
    assert "decoder.layers.3.input_layernorm.weight" in model and "decoder.layers.3.pre_mlp_layernorm.weight" in model
    back, _ = load_checkpoint(str(tmp_path / "b"))
    assert all(torch.equal(back.weights[n], ex.weights[n]) for n in ex.weights)
    assert util.main(["--load-dir", str(tmp_path / "b"), "--save-dir", str(tmp_path / "c"),
                      "--loader", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a Megatron-LM checkpoint" in err and err.count("\n") == 1
    save_checkpoint(ex, str(tmp_path / "leg"), "megatron")
    assert util.main(["--load-dir", str(tmp_path / "leg"), "--save-dir", str(tmp_path / "d"), "--loader", "mcore"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a Megatron-Core" in err
