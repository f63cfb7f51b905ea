"""GPT and BERT samples, blending and splits, each checked against a slow independent reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megatron_2bw.data.bert_dataset import BertDataset
from megatron_2bw.data.blend import BlendedDataset, blending_indices, parse_data_path
from megatron_2bw.data.build import build_datasets, check_vocab, parse_split, split_document_ranges
from megatron_2bw.data.gpt_dataset import GPTDataset
from megatron_2bw.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_2bw.errors import ConfigError


def make_indexed(prefix: str, docs: list[list[list[int]]], dtype=np.int32) -> IndexedDataset:
    """docs[d] is a list of items (token lists)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        for item in doc:
            builder.add_item(np.asarray(item, dtype=np.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def random_docs(seed: int, n: int, max_items: int = 3, max_len: int = 30, base: int = 0) -> list[list[list[int]]]:
    """Documents of 0-3 items of 0-30 tokens; every token id is unique (base + running count)."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], base
    for _ in range(n):
        doc = []
        for _ in range(rng.integers(0, max_items + 1)):
            size = int(rng.integers(0, max_len + 1))
            doc.append(list(range(next_id, next_id + size)))
            next_id += size
        docs.append(doc)
    return docs


# ---- GPT ---------------------------------------------------------------------------------------


@pytest.fixture
def gpt_data(tmp_path):
    docs = random_docs(0, 40)
    return docs, make_indexed(str(tmp_path / "gpt"), docs)


def test_gpt_samples_are_windows_of_the_shuffled_document_stream(gpt_data):
    docs, indexed = gpt_data
    documents = np.arange(5, 35)
    seq, n = 16, 100
    ds = GPTDataset(indexed, documents, seq, n, seed=7)
    assert len(ds) == n
    # Slow reference: plain Python lists, document by document, epoch by epoch.
    epoch_tokens = sum(len(item) for d in documents for item in docs[d])
    windows = -(-n // ds.block) * ds.block  # whole shuffle blocks of about an epoch's windows
    assert ds.block == epoch_tokens // seq
    assert (ds.num_epochs - 1) * epoch_tokens < windows * seq + 1 <= ds.num_epochs * epoch_tokens
    order = ds.doc_order.tolist()
    assert len(order) == ds.num_epochs * len(documents)
    for e in range(ds.num_epochs):  # every epoch visits every document once
        assert sorted(order[e * len(documents) : (e + 1) * len(documents)]) == documents.tolist()
    stream = []
    for d in order:
        for item in docs[d]:
            stream.extend(item)
    got = ds.sample_order.tolist()
    assert len(set(got)) == n  # no window twice
    for k in range(0, n, ds.block):  # each block's samples are a shuffle of that block's windows
        assert all(k <= j < k + ds.block for j in got[k:k + ds.block])
    for i in range(n):
        j = int(ds.sample_order[i])
        sample = ds[i]["tokens"]
        assert sample.dtype == np.int64 and sample.tolist() == stream[j * seq : j * seq + seq + 1]
    # Consecutive windows overlap by exactly one token.
    inverse = np.argsort(ds.sample_order)
    assert ds[int(inverse[0])]["tokens"][-1] == ds[int(inverse[1])]["tokens"][0]


def test_gpt_sample_order_does_not_depend_on_the_number_of_samples(gpt_data):
    """Raising --train-iters on resume asks for more samples: the ones already trained on keep their order."""
    _, indexed = gpt_data
    docs = np.arange(40)
    short, long = GPTDataset(indexed, docs, 8, 30, 3), GPTDataset(indexed, docs, 8, 700, 3)
    assert long.num_epochs > short.num_epochs >= 1
    assert [short[i]["tokens"].tolist() for i in range(30)] == [long[i]["tokens"].tolist() for i in range(30)]
    assert not np.array_equal(long.sample_order[:30], np.arange(30))  # still shuffled


def test_gpt_is_deterministic_by_seed(gpt_data):
    _, indexed = gpt_data
    docs = np.arange(40)
    a, b, c = (GPTDataset(indexed, docs, 8, 50, seed) for seed in (1, 1, 2))
    samples = lambda ds: [ds[i]["tokens"].tolist() for i in range(len(ds))]  # noqa: E731
    assert samples(a) == samples(b)
    assert samples(a) != samples(c)
    assert sorted(map(tuple, samples(a))) != sorted(map(tuple, samples(c)))  # different documents order, not just order


def test_gpt_errors(gpt_data):
    docs, indexed = gpt_data
    empty = [d for d in range(40) if not any(docs[d])]
    with pytest.raises(ConfigError, match="hold no tokens"):
        GPTDataset(indexed, np.array(empty[:2]), 8, 10, 0)
    with pytest.raises(ConfigError, match="at least one sample"):
        GPTDataset(indexed, np.arange(40), 8, 0, 0)


# ---- BERT --------------------------------------------------------------------------------------

CLS, SEP, MASK, PAD = 1, 2, 3, 0
BASE = 10


@pytest.fixture
def bert_data(tmp_path):
    """Mostly single-item documents (what preprocessing writes), a few multi-item ones."""
    rng = np.random.default_rng(3)
    docs, next_id = [], BASE
    for d in range(60):
        n_items = 1 if d % 5 else 4
        doc = []
        for _ in range(n_items):
            size = int(rng.integers(1, 200 if n_items == 1 else 40))
            doc.append(list(range(next_id, next_id + size)))
            next_id += size
        docs.append(doc)
    vocab = next_id + 5
    return docs, make_indexed(str(tmp_path / "bert"), docs), vocab


def bert(indexed, vocab, n=2000, seed=5, seq=64, **kw) -> BertDataset:
    return BertDataset(indexed, np.arange(60), seq, n, seed, cls=CLS, sep=SEP, mask=MASK, pad=PAD, vocab_size=vocab,
                       **kw)


def test_bert_sample_structure(bert_data):
    docs, indexed, vocab = bert_data
    where = {}  # token id -> (document, position in the document)
    for d, doc in enumerate(docs):
        for p, t in enumerate(t for item in doc for t in item):
            where[t] = (d, p)
    ds = bert(indexed, vocab, n=400)
    for i in range(len(ds)):
        s = ds[i]
        tokens, types, labels = s["tokens"], s["token_types"], s["labels"]
        loss_mask, pad_mask = s["loss_mask"], s["padding_mask"]
        assert all(v.shape == (64,) for v in (tokens, types, labels, loss_mask, pad_mask))
        assert s["sop_label"].shape == ()
        assert loss_mask.dtype == np.float32 and tokens.dtype == types.dtype == labels.dtype == np.int64
        n = int(pad_mask.sum())
        assert pad_mask[:n].all() and (tokens[n:] == PAD).all() and (types[n:] == 0).all()
        original = np.where(loss_mask > 0, labels, tokens)
        assert (labels[loss_mask == 0] == 0).all() and loss_mask.sum() >= 1
        b_start = int(np.argmax(types))
        assert (types[b_start:n] == 1).all() and (types[:b_start] == 0).all()
        assert original[0] == CLS and original[b_start - 1] == SEP and original[n - 1] == SEP
        first, second = original[1 : b_start - 1].tolist(), original[b_start : n - 1].tolist()
        assert first and second and len(first) + len(second) <= 61
        assert all(t >= BASE for t in first + second)
        # Each segment is a contiguous run of one document, both from the same document.
        for seg in (first, second):
            pos = [where[t] for t in seg]
            assert len({d for d, _ in pos}) == 1 and [p for _, p in pos] == list(range(pos[0][1], pos[0][1] + len(seg)))
        (d1, p1), (d2, p2) = where[first[0]], where[second[0]]
        assert d1 == d2
        a_before_b = p1 + len(first) <= p2
        assert a_before_b == (s["sop_label"] == 0)  # label 1: the segments were swapped


def test_bert_masking_and_sop_rates(bert_data):
    _, indexed, vocab = bert_data
    ds = bert(indexed, vocab, n=2000)
    selected = candidates = masked = unchanged = sop = 0
    for i in range(len(ds)):
        s = ds[i]
        sel = s["loss_mask"] > 0
        n = int(s["padding_mask"].sum())
        candidates += n - 3
        selected += int(sel.sum())
        masked += int((s["tokens"][sel] == MASK).sum())
        unchanged += int((s["tokens"][sel] == s["labels"][sel]).sum())
        sop += int(s["sop_label"])
    assert abs(selected / candidates - 0.15) < 0.01
    assert abs(masked / selected - 0.8) < 0.02
    assert abs(unchanged / selected - 0.1) < 0.02  # a random replacement rarely hits the original
    assert abs((selected - masked - unchanged) / selected - 0.1) < 0.02
    assert abs(sop / len(ds) - 0.5) < 0.04


def test_bert_is_deterministic_per_index(bert_data):
    _, indexed, vocab = bert_data
    a, b, c = bert(indexed, vocab, n=50), bert(indexed, vocab, n=50), bert(indexed, vocab, n=50, seed=6)
    order = list(range(50))[::-1]
    forward = [a[i] for i in range(50)]
    backward = {i: b[i] for i in order}
    for i in range(50):
        for key in forward[i]:
            np.testing.assert_array_equal(forward[i][key], backward[i][key])
    assert any(not np.array_equal(forward[i]["tokens"], c[i]["tokens"]) for i in range(50))


def test_bert_short_sequences_and_errors(bert_data, tmp_path):
    _, indexed, vocab = bert_data
    full = np.mean([bert(indexed, vocab, n=200, short_seq_prob=0.0)[i]["padding_mask"].sum() for i in range(200)])
    short = np.mean([bert(indexed, vocab, n=200, short_seq_prob=1.0)[i]["padding_mask"].sum() for i in range(200)])
    assert short < 0.8 * full
    tiny = make_indexed(str(tmp_path / "tiny"), [[[10]], [[11]]])
    with pytest.raises(ConfigError, match="has 2 tokens for a sentence pair"):
        BertDataset(tiny, np.arange(2), 16, 4, 0, cls=CLS, sep=SEP, mask=MASK, pad=PAD, vocab_size=20)
    with pytest.raises(ConfigError, match=r"\[MASK\] token id"):
        BertDataset(tiny, np.arange(2), 16, 4, 0, cls=CLS, sep=SEP, mask=None, pad=PAD, vocab_size=20)


# ---- blending ----------------------------------------------------------------------------------


def test_parse_data_path():
    assert parse_data_path(["data/a"]) == (["data/a"], [1.0])
    prefixes, weights = parse_data_path(["3", "a", "1", "b"])
    assert prefixes == ["a", "b"] and weights == [0.75, 0.25]


@pytest.mark.parametrize(
    "data_path, expected",
    [
        ([], "is empty"),
        (["1", "a", "2"], "odd number"),
        (["a", "b"], "weight 'a' is not a number"),
        (["0", "a", "1", "b"], "weight '0' (for a) must be a positive number"),
        (["-1", "a", "1", "b"], "must be a positive number"),
        (["nan", "a", "1", "b"], "must be a positive number"),
    ],
)
def test_parse_data_path_errors(data_path, expected):
    with pytest.raises(ConfigError) as e:
        parse_data_path(data_path)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_blending_matches_weights_at_every_prefix():
    w = np.array([0.2, 0.3, 0.45, 0.05])
    ds_index, sample_index = blending_indices(w, 20000)
    counts = np.bincount(ds_index, minlength=4)
    assert np.all(np.abs(counts / 20000 - w) < 0.01)
    running = np.cumsum(np.eye(4, dtype=np.int64)[ds_index], axis=0)
    ideal = np.outer(np.arange(1, 20001), w)
    assert np.abs(running - ideal).max() <= 2  # low discrepancy, not just the right totals
    for d in range(4):  # each dataset is read in order 0, 1, 2, ...
        assert sample_index[ds_index == d].tolist() == list(range(counts[d]))
    # The greedy rule it implements, run slowly: argmin (count_d + 1/2) / w_d.
    c = np.zeros(4)
    ref = []
    for _ in range(500):
        d = int(np.argmin((c + 0.5) / w))
        ref.append(d)
        c[d] += 1
    assert ds_index[:500].tolist() == ref


def test_blended_datasets_from_build(tmp_path):
    make_indexed(str(tmp_path / "a"), [[list(range(0, 100))] for _ in range(20)])
    make_indexed(str(tmp_path / "b"), [[list(range(1000, 1100))] for _ in range(20)])
    train, valid, test = build_datasets(
        "gpt", ["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")], "90,10,0", 16, (1000, 100, 50), seed=1
    )
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and len(valid) == 100 and test is None
    assert train.samples_per_dataset.tolist() == [700, 300]
    assert [len(d) for d in train.datasets] == [700, 300]  # each component built with exactly its share
    from_b = np.mean([train[i]["tokens"][0] >= 1000 for i in range(1000)])
    assert abs(from_b - 0.3) < 0.01


# ---- splits and build_datasets ------------------------------------------------------------------


def megatron_split(splits_string: str, size: int) -> list[int]:
    """Megatron-LM's get_train_valid_test_split_, verbatim in substance."""
    if splits_string.find(",") != -1:
        splits = [float(s) for s in splits_string.split(",")]
    elif splits_string.find("/") != -1:
        splits = [float(s) for s in splits_string.split("/")]
    else:
        splits = [float(splits_string)]
    while len(splits) < 3:
        splits.append(0.0)
    splits = splits[:3]
    splits_sum = sum(splits)
    splits = [split / splits_sum for split in splits]
    splits_index = [0]
    for index, split in enumerate(splits):
        splits_index.append(splits_index[index] + int(round(split * float(size))))
    diff = splits_index[-1] - size
    for index in range(1, len(splits_index)):
        splits_index[index] -= diff
    return splits_index


@pytest.mark.parametrize("split", ["969,30,1", "949,50,1", "98,2,0", "1,1,1", "100", "8/1/1", "0.5,0.25", "3,3,4"])
def test_split_ranges_match_megatron(split):
    for size in range(0, 400):
        ref = megatron_split(split, size)
        assert split_document_ranges(split, size) == [(ref[0], ref[1]), (ref[1], ref[2]), (ref[2], ref[3])], size


def test_split_known_values():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("969,30,1", 579) == [(0, 561), (561, 578), (578, 579)]
    assert parse_split("2,1,1") == [0.5, 0.25, 0.25]


@pytest.mark.parametrize(
    "split, expected",
    [("969,-30,1", "negative"), ("0,0,0", "all zeros"), ("a,b", "not comma-separated numbers"), ("1,1,1,1", "4 parts")],
)
def test_split_errors(split, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_split(split)


@pytest.fixture
def small_prefix(tmp_path) -> str:
    make_indexed(str(tmp_path / "s"), [[list(range(i * 50, i * 50 + 50))] for i in range(10)])
    return str(tmp_path / "s")


def test_build_datasets_none_and_too_small(small_prefix):
    train, valid, test = build_datasets("gpt", [small_prefix], "8,2,0", 16, (10, 0, 5), seed=0)
    assert len(train) == 10 and valid is None and test is None  # valid: 0 asked; test: 0 documents
    with pytest.raises(ConfigError) as e:
        build_datasets("gpt", [small_prefix], "9,1,0", 64, (10, 5, 0), seed=0)
    msg = str(e.value)
    assert msg.startswith("the valid split of") and "holds 50 tokens" in msg and "\n" not in msg


def test_build_datasets_errors(small_prefix, tmp_path):
    with pytest.raises(ConfigError, match="cannot open .*nope.idx"):
        build_datasets("gpt", [str(tmp_path / "nope")], "1", 16, (1, 0, 0), seed=0)
    with pytest.raises(ConfigError, match="token id 499 but the tokenizer's vocabulary has 300 entries"):
        build_datasets("gpt", [small_prefix], "1", 16, (1, 0, 0), seed=0, tokenizer=SimpleNamespace(vocab_size=300))
    with pytest.raises(ConfigError, match="need a tokenizer"):
        build_datasets("bert", [small_prefix], "1", 16, (1, 0, 0), seed=0)
    with pytest.raises(ConfigError, match="kind must be"):
        build_datasets("t5", [small_prefix], "1", 16, (1, 0, 0), seed=0)


def test_check_vocab_bounded_scan(small_prefix):
    indexed = IndexedDataset(small_prefix)
    check_vocab(indexed, 500)
    with pytest.raises(ConfigError, match="token id 499"):
        check_vocab(indexed, 499)
    # With a budget far below the data size only sampled windows are scanned; the last window
    # always ends at the last token, so the maximum here is still found.
    with pytest.raises(ConfigError, match="token id 499"):
        check_vocab(indexed, 499, max_tokens=64)


def test_build_bert_datasets(small_prefix):
    tok = SimpleNamespace(vocab_size=600, cls=501, sep=502, mask=503, pad=500)
    train, valid, _ = build_datasets("bert", [small_prefix], "8,2,0", 32, (20, 4, 0), seed=3, tokenizer=tok)
    assert len(train) == 20 and len(valid) == 4
    s = train[0]
    assert s["tokens"][0] == 501 and s["tokens"].shape == (32,)


def test_too_small_test_split_is_dropped_with_a_warning(tmp_path, caplog):
    """Megatron's default --split 969,30,1 on a small corpus: the test sliver is dropped, not fatal."""
    prefix = str(tmp_path / "t")
    make_indexed(prefix, [[list(range(50))] for _ in range(9)] + [[[1, 2, 3, 4, 5]]])
    with caplog.at_level("WARNING"):
        train, valid, test = build_datasets("gpt", [prefix], "8,1,1", 32, (10, 5, 5), seed=0)
    assert len(train) == 10 and len(valid) == 5 and test is None
    assert any("no test split" in r.getMessage() and "holds 5 tokens" in r.getMessage() for r in caplog.records)
    blended = build_datasets("gpt", ["1", prefix, "1", prefix], "8,1,1", 32, (10, 5, 5), seed=0)
    assert blended[2] is None and len(blended[0]) == 10
