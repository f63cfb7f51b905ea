"""Generation: the KV-cache forward against the model's own, and greedy output against transformers."""

from __future__ import annotations

import torch
from export_helpers import gpt_logits, max_err, tiny

from megatron_2bw.export.generation import CachedGPT, KVCache, Sampling, generate, next_token
from megatron_2bw.export.hf_io import hf_model


def test_cached_forward_equals_model_forward():
    ex, model = tiny("gpt")
    gen = CachedGPT(ex.cfg, ex.weights)
    tokens = torch.randint(0, ex.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    ref = gpt_logits(model, tokens, ex.cfg.vocab_size)
    assert max_err(gen.forward(tokens), ref) < 1e-5
    cache = KVCache()  # prefill 5 positions, then 3, then one at a time
    pieces = [gen.forward(tokens[:, :5], cache), gen.forward(tokens[:, 5:8], cache)]
    pieces += [gen.forward(tokens[:, j:j + 1], cache) for j in range(8, 16)]
    assert cache.length == 16
    assert max_err(torch.cat(pieces, 1), ref) < 1e-5


def test_greedy_matches_transformers_and_no_cache():
    ex, _ = tiny("gpt", max_position_embeddings=32)
    prompt = [5, 17, 250, 3]
    ours = generate(CachedGPT(ex.cfg, ex.weights), prompt, 20)
    again = generate(CachedGPT(ex.cfg, ex.weights), prompt, 20, use_cache=False)
    hf = hf_model(ex)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                         pad_token_id=0, eos_token_id=None, attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert ours == theirs[0, 4:].tolist() == again
    assert len(set(ours)) > 3  # a random model does not just repeat one token


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([next_token(logits, Sampling(1.0, top_k=2), g) for _ in range(400)])
    assert set(draws.tolist()) == {0, 1}
    draws = torch.cat([next_token(logits, Sampling(1.0, top_p=0.7), g) for _ in range(400)])
    assert set(draws.tolist()) == {0, 1}  # 0.5 < 0.7 needs the second token, not the third
    draws = torch.cat([next_token(logits, Sampling(1.0), g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert max_err(freq, torch.tensor([0.5, 0.3, 0.15, 0.05])) < 0.03
    assert int(next_token(logits, Sampling(0.0))) == 0


def test_sampling_is_seeded():
    ex, _ = tiny("gpt")
    model = CachedGPT(ex.cfg, ex.weights)
    a = generate(model, [1, 2], 8, Sampling(1.0, top_k=50), seed=3)
    b = generate(model, [1, 2], 8, Sampling(1.0, top_k=50), seed=3)
    c = generate(model, [1, 2], 8, Sampling(1.0, top_k=50), seed=4)
    assert a == b and a != c


def test_generate_tool_streams_transformers_greedy_text(tmp_path, tmp_path_factory, capsys):
    """tools/generate.py on a Megatron-layout checkpoint (t=2, d=2) prints HF's greedy continuation."""
    import importlib.util
    import os

    from megatron_2bw.checkpoint.megatron_format import write_megatron_dir
    from megatron_2bw.data.tokenizers import build_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from e2e import shared_corpus

    sp = shared_corpus(tmp_path_factory).model
    tok = build_tokenizer("SentencePieceTokenizer", sp)
    ex, _ = tiny("gpt", vocab_size=tok.vocab_size, max_position_embeddings=40)
    ex.tokenizer = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp}
    write_megatron_dir(str(tmp_path / "ckpt"), ex, t=2, d=2)
    prompts = ["The quick brown fox", "Once upon a time"]
    (tmp_path / "prompts.txt").write_text(prompts[1] + "\n")
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(root, "tools", "generate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rc = tool.main(["--load", str(tmp_path / "ckpt"), "--prompt", prompts[0],
                    "--prompt-file", str(tmp_path / "prompts.txt"),
                    "--max-new-tokens", "20", "--temperature", "0", "--device", "cpu"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    hf = hf_model(ex)
    for prompt, line in zip(prompts, lines, strict=True):
        ids = tok.tokenize(prompt)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                          eos_token_id=tok.eod, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.shape[1] == len(ids) + 20  # no end-of-document token came
        assert line == prompt + tok.detokenize(out[0].tolist())[len(tok.detokenize(ids)):]
