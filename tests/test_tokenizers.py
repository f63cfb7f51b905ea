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
        proc = run_tool("train_tokenizer.py", "--input", demo_corpus, "--vocab-size", "1000",
                        "--model-prefix", str(prefix))
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
        bpe.train_from_iterator(SAMPLES * 20, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"],
                                show_progress=False)
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
    proc = run_tool("train_tokenizer.py", "--input", demo_corpus, "--vocab-size", "100",
                    "--model-prefix", str(tmp_path / "t"))
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
        (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nope/x.model"),
         "--tokenizer-model /nope/x.model does not exist"),
        (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nope/vocab.json", merge_file="/nope/m.txt"),
         "--vocab-file /nope/vocab.json does not exist"),
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


# ---- the same ids as Megatron-LM's tokenizers --------------------------------------------------
# Megatron's GPT-2 BPE (the original OpenAI encoder) and BERT WordPiece (Google's FullTokenizer)
# match no special tokens inside text; its WordPiece splits words up to 200 characters; its
# lower-casing is Python's str.lower (final sigma -> ς). The references below follow those rules:
# transformers' Python BERT tokenizer parts (with Megatron's 200-character limit) and a plain
# Python byte-level BPE written after the original GPT-2 encoder.

LONG_WORD = "ab" * 75  # 150 characters: Hugging Face's fast WordPiece (limit 100) gives [UNK]
MEGATRON_CASES = [
    "first document. [SEP] not a boundary [CLS] [MASK] [PAD]",
    "the quick brown fox " + LONG_WORD + " jumps",
    "ΟΔΟΣ Σ ΣΑΣ ΣΟΦΟΣ. ὈΔΥΣΣΕΎΣ",
    "Café naïve déjà vu, 日本語 and\x00control\u200bchars\tand\u3000spaces!",
    "a" * 201 + " " + "ab" * 100,
]
GREEK = ["ο", "δ", "σ", "ς", "α", "φ", "υ", "ε"]


@pytest.fixture(scope="session")
def megatron_bert_vocab(tmp_path_factory) -> str:
    path = tmp_path_factory.getbasetemp() / "megatron_bert_vocab.txt"
    if not path.exists():
        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
        pieces = letters + GREEK + [g.upper() for g in GREEK if g != "ς"] + ["Ὀ", "Ύ"]
        tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[", "]", ".", ",", "!", "the", "sep", "SEP", "first"]
        tokens += pieces + ["##" + p for p in pieces]
        path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(path)


def _reference_wordpiece_ids(vocab_file: str, text: str, lower: bool) -> list[int]:
    try:
        from transformers.models.bert.tokenization_bert_legacy import BasicTokenizer, WordpieceTokenizer, load_vocab
    except ImportError:  # transformers 4
        from transformers.models.bert.tokenization_bert import BasicTokenizer, WordpieceTokenizer, load_vocab
    vocab = load_vocab(vocab_file)
    basic = BasicTokenizer(do_lower_case=lower, never_split=None, tokenize_chinese_chars=True, strip_accents=None)
    pieces = WordpieceTokenizer(vocab, "[UNK]", max_input_chars_per_word=200)
    return [vocab[p] for word in basic.tokenize(text) for p in pieces.tokenize(word)]


@pytest.mark.parametrize("kind, lower", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)])
def test_bert_wordpiece_ids_equal_megatrons(megatron_bert_vocab, kind, lower):
    tok = build_tokenizer(kind, vocab_file=megatron_bert_vocab)
    vocab = open(megatron_bert_vocab, encoding="utf-8").read().split("\n")
    for text in MEGATRON_CASES + SAMPLES:
        assert tok.tokenize(text) == _reference_wordpiece_ids(megatron_bert_vocab, text, lower), text
    sep_text = tok.tokenize(MEGATRON_CASES[0])
    assert tok.sep not in sep_text and tok.cls not in sep_text and tok.mask not in sep_text
    long_ids = tok.tokenize(MEGATRON_CASES[1])
    start = len(tok.tokenize("the quick brown fox"))
    assert [vocab[i] for i in long_ids[start : start + 150]] == ["a"] + ["##b", "##a"] * 74 + ["##b"]
    over = tok.tokenize(MEGATRON_CASES[4])  # 201 characters: [UNK]; exactly 200: split
    assert over[0] == vocab.index("[UNK]") and len(over) == 201
    if lower:
        greek = [vocab[i] for i in tok.tokenize("ΟΔΟΣ ΣΑΣ")]
        assert greek == ["ο", "##δ", "##ο", "##ς", "σ", "##α", "##ς"]


def test_hugging_face_fast_wordpiece_differs_on_these_cases(megatron_bert_vocab):
    """Why the fast tokenizer is not used for BERT: each case gives different ids there."""
    from transformers import BertTokenizerFast

    fast = BertTokenizerFast(vocab_file=megatron_bert_vocab, do_lower_case=True) if "vocab_file" in __import__(
        "inspect").signature(BertTokenizerFast.__init__).parameters else None
    if fast is None:
        from megatron_2bw.data.wordpiece import load_vocab

        fast = BertTokenizerFast(vocab=load_vocab(megatron_bert_vocab), do_lower_case=True)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=megatron_bert_vocab)
    for text in MEGATRON_CASES[:3]:
        assert fast.encode(text, add_special_tokens=False) != tok.tokenize(text), text


def _reference_gpt2_bpe(vocab_file: str, merge_file: str):
    """The original GPT-2 encoder's algorithm: regex pre-split, bytes -> printable characters,
    lowest-rank merge first over the whole word, unknown pieces -> 0."""
    import regex

    encoder = json.load(open(vocab_file, encoding="utf-8"))
    lines = open(merge_file, encoding="utf-8").read().split("\n")[1:-1]
    ranks = {tuple(line.split()): i for i, line in enumerate(lines)}
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_char[b] = chr(b)
        else:
            byte_char[b], extra = chr(256 + extra), extra + 1
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(word: tuple[str, ...]) -> tuple[str, ...]:
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(text: str) -> list[int]:
        ids = []
        for piece in pattern.findall(text):
            chars = tuple(byte_char[b] for b in piece.encode("utf-8"))
            ids.extend(encoder.get(t, 0) for t in bpe(chars))
        return ids

    return encode


def test_gpt2_bpe_ids_equal_megatrons(gpt2_files):
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    reference = _reference_gpt2_bpe(vocab, merges)
    texts = SAMPLES + [
        "end of one story.<|endoftext|>Not a new document, just text.",
        "<|endoftext|>",
        "Spaces   and\n\nnewlines  \t, numbers 3.14159 and 'quotes' it's we'll.",
    ]
    for text in texts:
        assert tok.tokenize(text) == reference(text), text
    ids = tok.tokenize(texts[3])
    assert tok.eod not in ids and tok.detokenize(ids) == texts[3]
    # The Hugging Face tokenizer object itself still knows the special token.
    assert tok.hf.encode("<|endoftext|>", add_special_tokens=False) == [tok.eod]


def test_wordpiece_tokenizer_pickles_and_needs_its_special_tokens(megatron_bert_vocab, tmp_path):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=megatron_bert_vocab)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(MEGATRON_CASES[2]) == tok.tokenize(MEGATRON_CASES[2]) and clone.sep == tok.sep
    no_mask = tmp_path / "vocab.txt"
    no_mask.write_text("\n".join(t for t in open(megatron_bert_vocab).read().split("\n") if t != "[MASK]"))
    with pytest.raises(ConfigError, match=r"has no \[MASK\] token"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(no_mask))
