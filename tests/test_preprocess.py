"""JSONL -> .bin/.idx: exact round trips, worker pool equivalence, clean errors, and the CLIs."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
from test_tokenizers import REPO, demo_corpus, run_tool, sp_model  # noqa: F401 - session fixtures

from megatron_2bw.data.indexed_dataset import IndexedDataset
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.errors import ConfigError

DOCS = [
    {"text": "The first document.\nIt has two lines.", "title": "One"},
    {"text": "", "title": "Empty body"},  # skipped for "text", as Megatron skips empty documents
    {"text": "Second: digits 42 and café.", "title": "Two"},
]


def write_jsonl(path, docs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
        f.write("\n")  # a blank line is ignored
    return str(path)


@pytest.fixture(scope="module")
def tok(sp_model):  # noqa: F811
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)


@pytest.mark.parametrize("append_eod", [False, True])
def test_round_trip_exact_ids(tmp_path, tok, append_eod):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    result = preprocess_jsonl(src, str(tmp_path / "out" / "ds"), tok, ("text", "title"), append_eod=append_eod)
    assert result.prefixes == {"text": str(tmp_path / "out" / "ds_text_document"),
                               "title": str(tmp_path / "out" / "ds_title_document")}
    for key in ("text", "title"):
        expected = [tok.tokenize(d[key]) + ([tok.eod] if append_eod else []) for d in DOCS if d[key]]
        ds = IndexedDataset(result.prefixes[key])
        assert ds.dtype == np.uint16  # vocabulary 1000 < 65500
        assert [ds[i].tolist() for i in range(len(ds))] == expected
        assert ds.doc_idx.tolist() == list(range(len(expected) + 1))  # one item per document
        assert result.documents[key] == len(expected) and result.tokens[key] == sum(map(len, expected))
    text = IndexedDataset(result.prefixes["text"])
    assert tok.detokenize(text[0]) == DOCS[0]["text"]  # (an eod renders as nothing)


def test_worker_pool_writes_identical_files(tmp_path, tok, demo_corpus):  # noqa: F811
    one = preprocess_jsonl(demo_corpus, str(tmp_path / "w1"), tok, append_eod=True, workers=1)
    two = preprocess_jsonl(demo_corpus, str(tmp_path / "w2"), tok, append_eod=True, workers=2)
    for ext in (".bin", ".idx"):
        a = open(one.prefixes["text"] + ext, "rb").read()
        assert a == open(two.prefixes["text"] + ext, "rb").read()
    ds = IndexedDataset(one.prefixes["text"])
    first = json.loads(open(demo_corpus, encoding="utf-8").readline())["text"]
    assert ds[0].tolist() == tok.tokenize(first) + [tok.eod]


@pytest.mark.parametrize(
    "lines, expected",
    [
        (['{"text": "ok"}', '{"text": "ok", }'], "in.jsonl:2: invalid JSON"),
        (['{"text": "ok"}', '{"text": "fine"}', '{"body": "x"}'], "in.jsonl:3: no key 'text'"),
        (['{"text": ["a list"]}'], "in.jsonl:1: key 'text' is a list, not a string"),
        (["[1, 2]"], "in.jsonl:1: expected a JSON object"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_is_one_line_and_leaves_no_files(tmp_path, tok, lines, expected, workers):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        preprocess_jsonl(str(src), str(tmp_path / "ds"), tok, workers=workers)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("ds_")]


def test_missing_input_and_eod_less_tokenizer(tmp_path, tok):
    with pytest.raises(ConfigError, match="--input .*nope.jsonl does not exist"):
        preprocess_jsonl(str(tmp_path / "nope.jsonl"), str(tmp_path / "ds"), tok)

    class NoEod:
        vocab_size, eod = 10, None

    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    with pytest.raises(ConfigError, match="--append-eod"):
        preprocess_jsonl(src, str(tmp_path / "ds"), NoEod(), append_eod=True)


def test_build_demo_corpus_is_deterministic(tmp_path):
    spec = importlib.util.spec_from_file_location("build_demo_corpus",
                                                  os.path.join(REPO, "tools", "build_demo_corpus.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    na = mod.build_corpus(str(a), 0.05)
    assert na == mod.build_corpus(str(b), 0.05) and na[0] > 3 and 0 < na[1] <= 50_000
    assert a.read_bytes() == b.read_bytes()


# ---- the CLI, once each way ------------------------------------------------------------------


def test_preprocess_cli(tmp_path, sp_model, tok):  # noqa: F811
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    proc = run_tool(
        "preprocess_data.py", "--input", src, "--output-prefix", str(tmp_path / "cli"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod",
    )
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(str(tmp_path / "cli_text_document"))
    assert ds[1].tolist() == tok.tokenize(DOCS[2]["text"]) + [tok.eod]


def test_preprocess_cli_bad_input(tmp_path, sp_model):  # noqa: F811
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{not json}\n')
    proc = run_tool(
        "preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / "cli"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "bad.jsonl:2: invalid JSON" in proc.stderr and "Traceback" not in proc.stderr


# ---- integrity: failures leave existing datasets intact; empty and plain-text input ---------


def _snapshot(prefix: str) -> dict[str, bytes]:
    return {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}


@pytest.mark.parametrize("workers", [1, 2])
def test_failed_run_leaves_the_existing_dataset_intact(tmp_path, tok, workers):
    good = write_jsonl(tmp_path / "good.jsonl", DOCS)
    prefix = preprocess_jsonl(good, str(tmp_path / "ds"), tok).prefixes["text"]
    before = _snapshot(prefix)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a new first document"}\n{"text": broken}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: invalid JSON"):
        preprocess_jsonl(str(bad), str(tmp_path / "ds"), tok, workers=workers)
    assert _snapshot(prefix) == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "ds_text_document.bin", "ds_text_document.idx",
                                            "ds_text_document.tokenizer.json", "good.jsonl"]  # with its tokenizer
    expected = [tok.tokenize(d["text"]) for d in DOCS if d["text"]]
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_open_dataset_reads_its_old_tokens_after_re_preprocessing(tmp_path, tok):
    """Re-preprocessing over a running job's data renames new files in: the job's memory map
    keeps the old inode (no SIGBUS, no mixed tokens); a new reader sees the new data."""
    first = write_jsonl(tmp_path / "a.jsonl", DOCS)
    prefix = preprocess_jsonl(first, str(tmp_path / "ds"), tok).prefixes["text"]
    running = IndexedDataset(prefix)
    old = [running[i].tolist() for i in range(len(running))]
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": "A different, much shorter corpus."}])
    preprocess_jsonl(second, str(tmp_path / "ds"), tok)
    assert [running[i].tolist() for i in range(len(running))] == old
    assert old == [tok.tokenize(d["text"]) for d in DOCS if d["text"]]
    assert IndexedDataset(prefix)[0].tolist() == tok.tokenize("A different, much shorter corpus.")


@pytest.mark.parametrize("lines", [[], ['{"text": ""}', '{"text": ""}']], ids=["no documents", "empty texts"])
def test_empty_corpus_is_refused(tmp_path, tok, lines):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(line + "\n" for line in lines) + "\n")
    with pytest.raises(ConfigError) as e:
        preprocess_jsonl(str(src), str(tmp_path / "ds"), tok)
    msg = str(e.value)
    assert "\n" not in msg and "in.jsonl has no non-empty text under key 'text'" in msg
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_a_tokenizer_that_encodes_everything_to_nothing_is_blamed(tmp_path, tok):
    """Issue 19: the text is there; the tokenizer (here one that yields no ids) is what is wrong."""

    class Silent(type(tok)):
        def __init__(self):  # noqa: D107 - a stand-in with no vocabulary file
            self.vocab_size, self.eod = 10, 9

        def tokenize(self, text):
            return []

        def __repr__(self):
            return "Silent(vocab_size=10)"

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "real text"}, {"text": "more"}, {"text": ""}])
    with pytest.raises(ConfigError) as e:
        preprocess_jsonl(src, str(tmp_path / "ds"), Silent())
    msg = str(e.value)
    assert msg.startswith("the tokenizer Silent(vocab_size=10) encoded all 2 non-empty texts under key 'text'")
    assert "no token ids" in msg and "not the corpus" in msg and "\n" not in msg


def test_plain_text_input_says_what_to_do(tmp_path, tok):
    src = tmp_path / "corpus.txt"
    src.write_text("Just some prose, one paragraph per line.\nAnother line.\n")
    with pytest.raises(ConfigError) as e:
        preprocess_jsonl(str(src), str(tmp_path / "ds"), tok, json_keys=("body",))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{src}:1: not JSON (the line starts 'Just some prose, one')")
    assert 'must be JSONL, one JSON object per line' in msg and '{"body": "first document ..."}' in msg
    assert "--json-keys" in msg and "Expecting value" not in msg


def test_preprocess_cli_refuses_an_empty_corpus(tmp_path, sp_model):  # noqa: F811
    src = tmp_path / "empty.jsonl"
    src.write_text('{"text": ""}\n')
    proc = run_tool(
        "preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / "cli"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "empty.jsonl has no non-empty text under key 'text'" in proc.stderr


def test_a_byte_order_mark_is_not_an_error(tmp_path, tok):
    src = tmp_path / "bom.jsonl"
    src.write_bytes('\ufeff{"text": "Written by an editor that adds a BOM."}\n'.encode("utf-8"))
    prefix = preprocess_jsonl(str(src), str(tmp_path / "ds"), tok).prefixes["text"]
    assert IndexedDataset(prefix)[0].tolist() == tok.tokenize("Written by an editor that adds a BOM.")
