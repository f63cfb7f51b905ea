"""Tokenizers from local files: a SentencePiece model trained by our tools, GPT-2 BPE, BERT
WordPiece and a saved HuggingFace directory; plus the session fixtures other data tests import."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = [
    "Return the canonical string representation of the object.",
    "  Leading spaces, double  spaces,\ttabs\nand newlines; digits 12345 and UPPER case!",
    "Unicode survives byte fallback: café, naïve, 日本語, emoji \U0001F600.",
]


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", name), *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> str:
    """A ~0.25 MB corpus from tools/build_demo_corpus.py (the CLI's one subprocess test)."""
    path = tmp_path_factory.getbasetemp() / "shared_data" / "corpus.jsonl"
    if not path.exists():  # other test modules import this fixture; build once per session
        path.parent.mkdir(exist_ok=True)
        proc = run_tool("build_demo_corpus.py", "--output", str(path), "--max-mb", "0.25")
        assert proc.returncode == 0, proc.stderr
    return str(path)


@pytest.fixture(scope="session")
def sp_model(demo_corpus, tmp_path_factory) -> str:
    """A 1000-piece SentencePiece BPE model from tools/train_tokenizer.py (its subprocess test)."""
    prefix = tmp_path_factory.getbasetemp() / "shared_data" / "sp1000"
    model = str(prefix) + ".model"
    if not os.path.exists(model):
        proc = run_tool("train_tokenizer.py", "--input", demo_corpus, "--vocab-size", "1000", "--model-prefix", str(prefix))
        assert proc.returncode == 0, proc.stderr
        assert os.path.exists(str(prefix) + ".vocab")
    return model


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    """vocab.json + merges.txt of a tiny byte-level BPE trained with the `tokenizers` library."""
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.getbasetemp() / "gpt2_files"
    if not (d / "vocab.json").exists():
        d.mkdir(exist_ok=True)
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(SAMPLES * 20, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False)
        bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


BERT_WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", ",", ".", "!"]


@pytest.fixture(scope="session")
def bert_vocab(tmp_path_factory) -> str:
    path = tmp_path_factory.getbasetemp() / "bert_vocab.txt"
    if not path.exists():
        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
        tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + BERT_WORDS + ["The", "Quick"] + letters
        tokens += ["##" + c for c in letters]
        path.write_text("\n".join(tokens) + "\n")
    return str(path)


# ---- SentencePiece ------------------------------------------------------------------------


def test_demo_corpus_is_jsonl_of_english_text(demo_corpus):
    lines = open(demo_corpus, encoding="utf-8").read().splitlines()
    assert len(lines) > 20
    docs = [json.loads(line)["text"] for line in lines]
    assert all(d.strip() for d in docs)
    assert sum(len(line.encode()) + 1 for line in lines) <= 250_000
    assert " the " in " ".join(docs)


def test_sentencepiece_round_trip_and_specials(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert tok.vocab_size == 1000
    for text in SAMPLES:
        ids = tok.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    specials = [tok.eod, tok.pad, tok.cls, tok.sep, tok.mask]
    assert None not in specials and len(set(specials)) == 5
    assert tok.detokenize([tok.eod]) == ""  # eod is a control symbol: it never renders
    # The learned merges compress English: far fewer tokens than characters.
    assert len(tok.tokenize(SAMPLES[0])) < len(SAMPLES[0]) / 2.5


def test_tokenizer_pickles_by_construction_args(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(SAMPLES[1]) == tok.tokenize(SAMPLES[1]) and clone.eod == tok.eod


def test_train_tokenizer_refuses_tiny_vocab(demo_corpus, tmp_path):
    proc = run_tool("train_tokenizer.py", "--input", demo_corpus, "--vocab-size", "100", "--model-prefix", str(tmp_path / "t"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --vocab-size 100") and proc.stderr.count("\n") == 1


# ---- GPT-2 BPE, BERT WordPiece, HuggingFace directory -------------------------------------


def test_gpt2_bpe_from_local_files(gpt2_files):
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok.vocab_size == len(json.load(open(vocab)))
    assert tok.eod == json.load(open(vocab))["<|endoftext|>"]
    for text in SAMPLES:
        assert tok.detokenize(tok.tokenize(text)) == text  # byte-level BPE is lossless


@pytest.mark.parametrize("kind, lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_wordpiece_from_local_vocab(bert_vocab, kind, lower):
    tok = build_tokenizer(kind, vocab_file=bert_vocab)
    vocab = open(bert_vocab).read().split()
    assert tok.vocab_size == len(vocab)
    assert (tok.pad, tok.cls, tok.sep, tok.mask) == (0, 2, 3, 4)
    assert tok.eod == tok.sep
    ids = tok.tokenize("The quick brown fox jumps over the lazy dog!")
    pieces = [vocab[i] for i in ids]
    assert pieces[0] == ("the" if lower else "The")
    assert pieces[4:6] == ["jump", "##s"] and tok.cls not in ids and tok.sep not in ids
    assert tok.tokenize(tok.detokenize(ids)) == ids


def test_huggingface_directory(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    ref = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ref.hf.save_pretrained(str(tmp_path / "hf"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    assert tok.tokenize(SAMPLES[0]) == ref.tokenize(SAMPLES[0])
    assert tok.eod == ref.eod and tok.vocab_size == ref.vocab_size


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(tokenizer_type="SentencePieceTokenizer"), "needs --tokenizer-model"),
        (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nope/x.model"), "--tokenizer-model /nope/x.model does not exist"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nope/vocab.json", merge_file="/nope/m.txt"), "--vocab-file /nope/vocab.json does not exist"),
        (dict(tokenizer_type="BertWordPieceCase"), "needs --vocab-file"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"), "does not exist (only local"),
        (dict(tokenizer_type="Llama"), "unknown --tokenizer-type 'Llama'"),
    ],
)
def test_bad_tokenizer_arguments(kwargs, expected):
    with pytest.raises(ConfigError) as e:
        build_tokenizer(**kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_corrupt_sentencepiece_model(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a protobuf at all")
    with pytest.raises(ConfigError, match="is not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))
