"""The tokenizer travels with the model (issue 37): every export writes it, and ``AutoTokenizer.from_pretrained``
on the GPT-2, Llama and BERT exports gives the ids the training data was made with on a multi-line text; a
SentencePiece model exports as a tokenizer class that keeps its spaces (it gave ``GPT2Tokenizer``, which
dropped every space: "The subroutine returns" -> "Thesubroutinereturns")."""

from __future__ import annotations

import json
import os

import pytest
from e2e import shared_corpus
from export_helpers import tiny
from test_offline_tools import tool

from megatron_2bw.checkpoint.megatron_format import write_megatron_dir
from megatron_2bw.data.fingerprint import tokenizer_fingerprint
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.export.hf_tokenizer import RECORD

TEXT = ("The subroutine returns  two values:\n\tthe first one, and 12345 more\n\n"
        "Second paragraph -- with trailing spaces   \nand a last line without one")


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2_bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT] * 20, vocab_size=350, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bert_vocab") / "vocab.txt"
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    words = sorted({w.strip(".,:-").lower() for w in TEXT.split()} - {""})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", ":", "-"] + words + letters
    path.write_text("\n".join(tokens + ["##" + c for c in letters]) + "\n")
    return str(path)


def _export(tmp_path, kind: str, flags: dict, **model) -> tuple[str, object]:
    """A tiny model trained (as far as its checkpoint says) with ``flags``' tokenizer, exported by checkpoint_util."""
    tok = build_tokenizer(flags["tokenizer_type"], flags.get("tokenizer_model"), flags.get("vocab_file"),
                          flags.get("merge_file"))
    ex, _ = tiny(kind, vocab_size=tok.vocab_size, **model)
    ex.tokenizer = {**flags, "fingerprint": tokenizer_fingerprint(tok)}
    write_megatron_dir(str(tmp_path / "ckpt"), ex, t=2, d=1)
    out = str(tmp_path / "hf")
    assert tool("checkpoint_util").main(["--load-dir", str(tmp_path / "ckpt"), "--save-dir", out, "--saver", "hf"]) == 0
    return out, tok


def _same_ids(out: str, tok, *, specials_added: bool) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    want = tok.tokenize(TEXT)
    assert hf(TEXT, add_special_tokens=False).input_ids == want, type(hf).__name__
    if not specials_added:  # a GPT's exported tokenizer adds no BOS: the training data has none
        assert hf(TEXT).input_ids == want
    assert hf.decode(want) == tok.detokenize(want)
    with open(os.path.join(out, RECORD)) as f:
        assert json.load(f)["fingerprint"] == tokenizer_fingerprint(tok)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sentencepiece_exports_keep_their_spaces(family, tmp_path, tmp_path_factory):
    sp = shared_corpus(tmp_path_factory).model
    model = {} if family == "gpt2" else {"position_embedding_type": "rope", "swiglu": True, "normalization": "RMSNorm"}
    out, tok = _export(tmp_path, "gpt", {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp}, **model)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == ("gpt2" if family == "gpt2" else "llama")
    _same_ids(out, tok, specials_added=False)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert hf.decode(hf("The subroutine returns").input_ids) == "The subroutine returns"
    assert hf.eos_token_id == tok.eod and hf.bos_token_id is None


def test_gpt2_bpe_export(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    out, tok = _export(tmp_path, "gpt",
                       {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges})
    _same_ids(out, tok, specials_added=False)


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_wordpiece_export(kind, bert_vocab, tmp_path):
    out, tok = _export(tmp_path, "bert", {"tokenizer_type": kind, "vocab_file": bert_vocab})
    _same_ids(out, tok, specials_added=True)


def test_gpt2_bpe_with_a_llama_model(gpt2_files, tmp_path):
    """A Llama-style model trained with GPT-2 BPE: the tokenizer class is written, not taken from the model type."""
    vocab, merges = gpt2_files
    out, tok = _export(tmp_path, "gpt",
                       {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges},
                       position_embedding_type="rope", swiglu=True, normalization="RMSNorm")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    _same_ids(out, tok, specials_added=False)
