"""Llama-style models in and out: ``--loader hf`` from a random LlamaForCausalLM (GQA, untied),
Megatron-layout files at t x d, ``--saver hf`` back, ``from_pretrained`` logits; the KV-cache
generator against the model and transformers' greedy ``generate``; a trainer run to HF."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from export_helpers import gpt_logits, max_err

from megatron_2bw.checkpoint.megatron_format import Exported, read_megatron_dir, read_rank_files
from megatron_2bw.config.presets import get_preset
from megatron_2bw.export.checkpoints import load_checkpoint
from megatron_2bw.export.generation import CachedGPT, KVCache, generate
from megatron_2bw.export.hf_io import hf_model
from megatron_2bw.export.model_io import build_full_model, global_state_dict, load_full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _random_hf_llama(path: str, tied: bool = False, vocab: int = 200):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                       initializer_range=0.2, tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(conf).eval()
    with torch.no_grad():  # norms away from 1 so a misplaced norm weight shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def test_loader_hf_reshard_saver_hf_round_trip(tmp_path):
    hf = _random_hf_llama(str(tmp_path / "hf"))
    util = _tool("checkpoint_util")
    assert util.main(["--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ckpt"),
                      "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]) == 0
    files = read_rank_files(str(tmp_path / "ckpt" / "iter_0000000"))
    last = files[(1, 1)]["model"]["language_model"]
    assert last["output_layer"]["weight"].shape == (128, 48)  # untied, vocabulary 200 padded to 256, half of it
    layer = last["encoder"]
    assert layer["layers.0.mlp.dense_h_to_4h.weight"].shape == (80, 48)  # this rank's [gate; up]: 2 x 80 / 2
    assert layer["layers.0.self_attention.query_key_value.weight"].shape == ((2 + 2) * 12, 48)  # 1 group: 2 q, k, v
    assert "final_layernorm.bias" not in layer
    assert "position_embeddings" not in files[(0, 0)]["model"]["language_model"]["embedding"]
    ex = read_megatron_dir(str(tmp_path / "ckpt"))
    cfg = ex.cfg
    assert (cfg.query_groups, cfg.swiglu, cfg.normalization, cfg.tied_output, cfg.add_bias_linear) == (
        2, True, "RMSNorm", False, False)
    model = load_full(build_full_model(cfg), cfg, ex.weights).eval()
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert max_err(gpt_logits(model, tokens, 200), theirs) < 1e-5
    assert util.main(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf2"), "--saver", "hf"]) == 0
    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    a, b = hf.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, theirs)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_greedy_generate_matches_transformers(tmp_path, tied):
    hf = _random_hf_llama(str(tmp_path / "hf"), tied=tied)
    ex, _ = load_checkpoint(str(tmp_path / "hf"))
    assert ex.cfg.tied_output == tied
    gen = CachedGPT(ex.cfg, ex.weights)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(4))
    model = load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()
    ref = gpt_logits(model, tokens, 200)
    cache = KVCache()  # prefill 5 positions, then 3, then one at a time: RoPE offsets by the cache length
    pieces = [gen.forward(tokens[:, :5], cache), gen.forward(tokens[:, 5:8], cache)]
    pieces += [gen.forward(tokens[:, j:j + 1], cache) for j in range(8, 16)]
    assert max_err(torch.cat(pieces, 1), ref) < 1e-5
    prompt = [5, 17, 150, 3]
    ours = generate(gen, prompt, 20)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                         pad_token_id=0, eos_token_id=None, attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert ours == theirs[0, 4:].tolist() == generate(gen, prompt, 20, use_cache=False)
    assert len(set(ours)) > 3


def test_saver_hf_refuses_what_llama_cannot_hold(tmp_path, capsys):
    cfg = get_preset("llama-tiny", rotary_percent=0.5)
    ex = Exported(cfg, global_state_dict(build_full_model(cfg)))
    from megatron_2bw.errors import ConfigError

    with pytest.raises(ConfigError, match="--rotary-percent 0.5 cannot be exported"):
        hf_model(ex)
    cfg = get_preset("gpt-tiny", swiglu=True, ffn_hidden_size=128)  # SwiGLU with LayerNorm and learned positions
    with pytest.raises(ConfigError, match="mixes them"):
        hf_model(Exported(cfg, global_state_dict(build_full_model(cfg))))


def test_trainer_llama_run_to_hf_and_generate(tmp_path_factory, capsys):
    """pretrain_gpt.py trains llama-tiny at t = 2, d = 2 (2BW, sequence parallel), checkpoint_util writes
    LlamaForCausalLM, and
    tools/generate.py prints the same greedy text from the trainer checkpoint and from the HF directory,
    which is transformers' own greedy continuation."""
    from e2e import shared_corpus, torchrun
    from transformers import LlamaForCausalLM

    from megatron_2bw.data.tokenizers import build_tokenizer

    corpus = shared_corpus(tmp_path_factory)
    out = tmp_path_factory.mktemp("llama_trainer")
    save, hf_dir = str(out / "ckpt"), str(out / "hf")
    res = torchrun("pretrain_gpt.py", [
        "--model-preset", "llama-tiny", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "2bw", "--sequence-parallel", *corpus.data_args("98,1,1"), "--train-iters", "3",
        "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2", "--eval-iters", "0", "--device", "cpu",
        "--save", save], nproc=4)
    assert res.returncode == 0, res.describe()
    # the tools in this process (their main, as their command lines run it): no interpreter and imports per call
    assert _tool("checkpoint_util").main(["--load-dir", save, "--save-dir", hf_dir, "--saver", "hf",
                                          "--no-optimizer"]) == 0
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ex, _ = load_checkpoint(save)
    assert ex.iteration == 3 and not ex.cfg.tied_output and ex.cfg.query_groups == 2
    model = load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_err(hf(tokens).logits, gpt_logits(model, tokens, ex.cfg.vocab_size)) < 1e-5
    tok = build_tokenizer("SentencePieceTokenizer", corpus.model)
    texts = []
    for load in (save, hf_dir):
        capsys.readouterr()
        code = _tool("generate").main(["--load", load, "--prompt", "The story", "--max-new-tokens", "8",
                                       "--temperature", "0", "--device", "cpu", "--tokenizer-type",
                                       "SentencePieceTokenizer", "--tokenizer-model", corpus.model])
        got = capsys.readouterr()
        assert code == 0, got.err
        texts.append(got.out)
    ids = tok.tokenize("The story")
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=tok.eod,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want = "The story" + tok.detokenize(theirs[0].tolist())[len(tok.detokenize(ids)):]
    assert texts[0] == texts[1] and texts[0].rstrip("\n") == want
