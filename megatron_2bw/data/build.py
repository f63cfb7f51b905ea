"""Train/valid/test datasets from ``--data-path``, ``--split`` and sample counts, as Megatron.

Each prefix's documents are split into three consecutive ranges by ``--split`` (Megatron's
rounding, reproduced exactly); a blend builds every component on its own ranges and mixes
them with :class:`BlendedDataset`, asking each component for exactly the samples the blend
will draw from it. Every mistake in the inputs is a one-line ConfigError.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from .bert_dataset import BertDataset
from .blend import BlendedDataset, blending_indices, parse_data_path
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset, data_file_path, index_file_path
from .mock import MockDocuments

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
VOCAB_CHECK_TOKENS = 1 << 26  # 64M tokens: a full scan reads at most 256 MB


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``/``-separated, fewer parts padded with 0) -> three weights summing to 1."""
    sep = "," if "," in split else "/"
    parts = [p.strip() for p in split.split(sep)]
    if len(parts) > 3:
        raise ConfigError(f"--split {split!r} has {len(parts)} parts; give at most three (train,valid,test)")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r} is not comma-separated numbers like 969,30,1") from None
    if any(not np.isfinite(v) or v < 0 for v in values):
        raise ConfigError(f"--split {split!r} has a negative or non-finite part")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ConfigError(f"--split {split!r} is all zeros")
    return [v / total for v in values]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's ``get_train_valid_test_split_``: [start, end) document ranges per split."""
    fractions = parse_split(split)
    index = [0]
    for f in fractions:
        index.append(index[-1] + int(round(f * float(num_documents))))
    diff = index[-1] - num_documents
    index = [index[0]] + [i - diff for i in index[1:]]
    # Megatron's rounding fix can, in degenerate cases, push a boundary below its predecessor.
    bounds = np.maximum.accumulate(np.clip(index, 0, num_documents))
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def check_vocab(indexed: IndexedDataset, vocab_size: int, max_tokens: int = VOCAB_CHECK_TOKENS) -> None:
    """Refuse data holding a token id outside ``[0, vocab_size)`` (a tokenizer/data mismatch).

    Datasets up to ``max_tokens`` tokens are scanned fully (a max over the memory map); for
    bigger ones only 64 evenly spaced windows totalling ``max_tokens`` tokens are checked here; the
    trainer checks every batch as well (``training.data_iter.MicrobatchProvider``), so a stray id
    elsewhere is one line when its batch comes, never an embedding's IndexError.
    """
    views = [v for v in _windows(indexed.token_stream(), max_tokens) if v.size]
    if not views:
        return
    lo = min(int(v.min()) for v in views)
    hi = max(int(v.max()) for v in views)
    if lo < 0:
        raise ConfigError(f"data {indexed.prefix} has negative token id {lo}")
    if hi >= vocab_size:
        raise ConfigError(f"data {indexed.prefix} has token id {hi} but the tokenizer's vocabulary has "
                          f"{vocab_size} entries")


def _windows(stream: np.ndarray, max_tokens: int, count: int = 64) -> list[np.ndarray]:
    if len(stream) <= max_tokens:
        return [stream]
    width = max(1, max_tokens // count)
    starts = np.linspace(0, len(stream) - width, count).astype(np.int64)
    return [stream[s : s + width] for s in starts]


def _open(prefix: str) -> IndexedDataset:
    for path in (index_file_path(prefix), data_file_path(prefix)):
        try:
            open(path, "rb").close()
        except OSError as e:
            raise ConfigError(f"--data-path {prefix}: cannot open {path}: {e.strerror or e}") from None
    return IndexedDataset(prefix)


def _build_one(
    kind: str, indexed: IndexedDataset, split_name: str, docs: tuple[int, int], num_samples: int, *,
    seq_length: int, seed: int, tokenizer, masked_lm_prob: float, short_seq_prob: float, cache_dir: str | None = None,
):
    documents = np.arange(docs[0], docs[1], dtype=np.int64)
    where = f"the {split_name} split of {indexed.prefix} (documents [{docs[0]}, {docs[1]}))"
    tokens = int(indexed.document_sizes()[docs[0] : docs[1]].sum())
    # the kind stays here: which dataset a family reads is data/'s own choice (GPTDataset, BertDataset)
    need = seq_length + 1 if kind == "gpt" else 2
    if tokens < need:
        if split_name == "test":  # small corpora: Megatron's default 969,30,1 leaves a sliver for test
            logger.warning("%s holds %d tokens, too few for one sample (%d): no test split", where, tokens, need)
            return None
        raise ConfigError(f"{where} holds {tokens} tokens, too few for one sample ({need}); change --split or add data")
    try:
        if kind == "gpt":
            return GPTDataset(indexed, documents, seq_length, num_samples, seed, cache_dir=cache_dir)
        return BertDataset(
            indexed, documents, seq_length, num_samples, seed,
            cls=tokenizer.cls, sep=tokenizer.sep, mask=tokenizer.mask, pad=tokenizer.pad,
            vocab_size=tokenizer.vocab_size, masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob,
        )
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_request(kind: str, tokenizer, num_samples: tuple[int, int, int]) -> None:
    if kind not in ("gpt", "bert"):
        raise ConfigError(f"dataset kind must be 'gpt' or 'bert', got {kind!r}")
    if kind == "bert" and tokenizer is None:  # stays: BertDataset's own need (data/ picks datasets by kind)
        raise ConfigError("BERT datasets need a tokenizer for the [CLS]/[SEP]/[MASK]/[PAD] ids")
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ConfigError(f"num_samples must be three non-negative counts (train, valid, test), got {num_samples}")


def _split(build: Callable, indexed: list, weights: list[float], ranges: list, s: int, name: str, n: int):
    """Split ``s`` (``name``) of ``n`` samples: one dataset's documents, or a blend of every dataset's; None
    when it is asked for nothing or has no documents."""
    if len(indexed) == 1:
        lo, hi = ranges[0][s]
        return None if n == 0 or hi == lo else build(indexed[0], name, (lo, hi), n)
    if n == 0 or all(r[s][1] == r[s][0] for r in ranges):
        return None
    ds_index, _ = blending_indices(weights, n)
    counts = np.bincount(ds_index, minlength=len(indexed))
    parts = []
    for d, ds in enumerate(indexed):
        lo, hi = ranges[d][s]
        if counts[d] and hi == lo:
            raise ConfigError(
                f"the {name} split of {ds.prefix} has no documents but its --data-path weight asks for "
                f"{counts[d]} samples"
            )
        parts.append(build(ds, name, (lo, hi), int(counts[d])) if counts[d] else None)
    dropped = any(p is None for d, p in enumerate(parts) if counts[d])
    return None if dropped else BlendedDataset(parts, weights, n)


def build_datasets(
    kind: str,
    data_path: Sequence[str],
    split: str,
    seq_length: int,
    num_samples: tuple[int, int, int],
    seed: int,
    tokenizer=None,
    *,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    mock_data: bool = False,
    cache_dir: str | None = None,
    split_paths: Sequence[Sequence[str] | None] | None = None,
) -> tuple:
    """(train, valid, test); a split asked for 0 samples, or with 0 documents, is None.

    ``tokenizer`` (needed for BERT's special ids) also enables :func:`check_vocab`. ``mock_data``:
    Megatron's synthetic documents (data/mock.py; ``data_path`` empty) from the tokenizer's vocabulary
    and eod. ``cache_dir`` (``--data-cache-path``): where GPT sample indices are cached.
    """
    _check_request(kind, tokenizer, num_samples)
    parse_split(split)
    build = partial(
        _build_one, kind, seq_length=seq_length, seed=seed, tokenizer=tokenizer,
        masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob, cache_dir=cache_dir,
    )
    if split_paths is not None:
        return tuple(_own_split(build, split_paths[s], s, name, int(num_samples[s]), tokenizer)
                     for s, name in enumerate(SPLIT_NAMES))
    if mock_data:
        if kind != "gpt" or tokenizer is None:  # stays: mock documents are GPT's stream (data/mock.py)
            raise ConfigError("--mock-data makes GPT documents and needs the tokenizer's vocabulary")
        indexed, weights = [MockDocuments(tokenizer.vocab_size, tokenizer.eod)], [1.0]
    else:
        prefixes, weights = parse_data_path(data_path)
        indexed = [_open(p) for p in prefixes]
    if tokenizer is not None and not mock_data:  # mock ids are below the vocabulary by construction
        for ds in indexed:
            check_vocab(ds, tokenizer.vocab_size)
    ranges = [split_document_ranges(split, ds.num_documents) for ds in indexed]

    return tuple(_split(build, indexed, weights, ranges, s, name, int(num_samples[s]))
                 for s, name in enumerate(SPLIT_NAMES))



def _own_split(build: Callable, paths: Sequence[str] | None, s: int, name: str, n: int, tokenizer):
    """Split ``s`` from its own data (``--train-data-path`` and its kin, Megatron's): every document of its
    prefixes (or blend); None when it has no data or is asked for nothing."""
    if not paths or n == 0:
        return None
    prefixes, weights = parse_data_path(paths)
    indexed = [_open(p) for p in prefixes]
    if tokenizer is not None:
        for ds in indexed:
            check_vocab(ds, tokenizer.vocab_size)
    ranges = [[(0, 0)] * 3 for _ in indexed]
    for r, ds in zip(ranges, indexed):
        r[s] = (0, ds.num_documents)
    return _split(build, indexed, weights, ranges, s, name, n)
