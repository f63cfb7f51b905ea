"""Megatron-LM v2.x checkpoint contents: read by transformers' own converters and by our reader."""

from __future__ import annotations

import argparse

import pytest
import torch
from export_helpers import bert_batch, bert_outputs, gpt_logits, hf_converter, max_err, tiny

from megatron_2bw.checkpoint.megatron_format import (
    CHECKPOINT_VERSION,
    megatron_files,
    qkv_from_version,
    read_megatron_dir,
    write_megatron_dir,
)


def test_gpt_checkpoint_through_transformers_converter():
    from transformers import GPT2Config, GPT2LMHeadModel

    conv = hf_converter("gpt2")
    ex, model = tiny("gpt")
    sd = megatron_files(ex, 1, 1)[(0, 0)]
    assert isinstance(sd["args"], argparse.Namespace) and sd["checkpoint_version"] == 3.0 and sd["iteration"] == 11
    args = sd["args"]
    # the activation the converter's main() derives from args
    act = "gelu_fast" if args.bias_gelu_fusion else "gelu_new" if args.openai_gelu else "gelu"
    config = GPT2Config(activation_function=act, layer_norm_epsilon=args.layernorm_epsilon)
    out = conv.convert_megatron_checkpoint(None, sd, config)
    hf = GPT2LMHeadModel(config).eval()
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert missing == [] and all(k.endswith(("attn.bias", "attn.masked_bias")) for k in unexpected)
    tokens = torch.randint(0, ex.cfg.vocab_size, (2, ex.cfg.seq_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert theirs.shape[-1] == ex.cfg.padded_vocab_size(1)
    assert max_err(theirs[..., : ex.cfg.vocab_size], gpt_logits(model, tokens, ex.cfg.vocab_size)) < 1e-5


def test_bert_checkpoint_through_transformers_converter():
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    conv = hf_converter("bert")
    ex, model = tiny("bert")
    sd = megatron_files(ex, 1, 1)[(0, 0)]
    config = MegatronBertConfig(hidden_act="gelu_new", layer_norm_eps=sd["args"].layernorm_epsilon)
    out = conv.convert_megatron_checkpoint(None, sd, config)
    hf = MegatronBertForPreTraining(config).eval()
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert missing in ([], ["cls.predictions.decoder.bias"]) and unexpected == []
    hf.tie_weights()
    batch = bert_batch(ex.cfg)
    with torch.no_grad():
        o = hf(input_ids=batch["tokens"], token_type_ids=batch["token_types"], attention_mask=batch["pad"].long())
    lm, sop = bert_outputs(model, batch, ex.cfg.vocab_size)
    pad = batch["pad"]
    assert max_err(o.prediction_logits[..., : ex.cfg.vocab_size][pad], lm[pad]) < 1e-5
    assert max_err(o.seq_relationship_logits, sop) < 1e-5


def test_megatron_names_and_local_layer_numbers():
    ex, _ = tiny("bert")
    files = megatron_files(ex, 2, 2)
    first, last = files[(1, 0)]["model"], files[(1, 1)]["model"]
    enc0, enc1 = first["language_model"]["encoder"], last["language_model"]["encoder"]
    # stage 0 holds layers 0-1, stage 1 holds global layers 2-3 numbered locally 0-1
    assert sorted({k.split(".")[1] for k in enc0}) == ["0", "1"] and "final_layernorm.weight" not in enc0
    assert sorted({k.split(".")[1] for k in enc1 if k.startswith("layers.")}) == ["0", "1"]
    assert torch.equal(enc1["layers.0.mlp.dense_4h_to_h.weight"], ex.weights["3.mlp.fc2.weight"][:, 128:])
    assert list(enc1)[-1].startswith("final_layernorm")
    assert set(first) == {"language_model"} and set(first["language_model"]) == {"embedding", "encoder"}
    assert set(last) == {"language_model", "lm_head", "binary_head", "word_embeddings_for_head"}
    emb = first["language_model"]["embedding"]
    assert emb["word_embeddings"]["weight"].shape == (ex.cfg.padded_vocab_size(2) // 2, 64)
    assert torch.equal(emb["word_embeddings"]["weight"], last["word_embeddings_for_head"]["weight"])
    assert files[(0, 0)]["args"].padded_vocab_size == 512 and files[(0, 0)]["args"].tensor_model_parallel_size == 2


@pytest.mark.parametrize("kind,t,d", [("gpt", 1, 1), ("gpt", 2, 2), ("bert", 4, 1), ("bert", 1, 4)])
def test_write_read_round_trip(tmp_path, kind, t, d):
    ex, _ = tiny(kind)
    idir = write_megatron_dir(str(tmp_path), ex, t, d)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "11"
    back = read_megatron_dir(str(tmp_path))
    assert back.cfg == ex.cfg and back.iteration == 11 and idir.endswith("iter_0000011")
    assert set(back.weights) == set(ex.weights)
    for name, value in ex.weights.items():
        assert torch.equal(back.weights[name], value), name


def test_older_qkv_orderings_read_as_version_3():
    conv = hf_converter("gpt2")
    heads, hd, h = 4, 16, 64
    ours = torch.randn(heads * 3 * hd, h)
    v0 = conv.fix_query_key_value_ordering(ours, CHECKPOINT_VERSION, 3, heads, hd)  # [3, heads, hd]
    v1 = ours.view(heads, 3, hd, h).transpose(1, 2).reshape(-1, h)  # [heads, hd, 3]
    assert torch.equal(conv.fix_query_key_value_ordering(v1, 1.0, 3, heads, hd), v0)
    assert torch.equal(qkv_from_version(v0, 0.0, heads), ours)
    assert torch.equal(qkv_from_version(v1, 1.0, heads), ours)
    assert torch.equal(qkv_from_version(ours, 2.0, heads), ours)
