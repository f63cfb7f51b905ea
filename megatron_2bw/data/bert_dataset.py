"""BERT samples: sentence-order prediction pairs with masked-LM corruption.

Each document is a list of "sentences": its items in the indexed dataset, or, when a
document is a single item (what tools/preprocess_data.py writes), chunks of about
``seq_length / 4`` tokens. Consecutive sentences of a document are grouped into blocks
of about ``seq_length - 3`` tokens (vectorized: a sentence joins block ``start // max_tokens``
of its document), and each block becomes one sample: ``[CLS] A [SEP] B [SEP]`` padded to
``seq_length``, with A and B split at a random sentence boundary (a random token when the
block is one sentence) and swapped with probability 1/2 (``sop_label`` 1 when swapped).

Masking as BERT: ``round(masked_lm_prob * n)`` of the ``n`` non-special tokens (at least one)
are selected; of those 80% become [MASK], 10% a random token, 10% stay. Megatron's
whole-word and n-gram masking are not reproduced. With probability ``short_seq_prob`` a
sample is truncated to a random shorter length, and over-long pairs are cut from the longer
segment (from its front or back at random), as Megatron's truncate_segments does.

Every random choice in ``__getitem__`` comes from a Generator seeded with (seed, index), so a
sample does not depend on which samples were read before it or by which worker.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .indexed_dataset import IndexedDataset


class BertDataset:
    """``ds[i]`` -> tokens, token_types, labels, loss_mask, padding_mask, sop_label (numpy)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        *,
        cls: int,
        sep: int,
        mask: int,
        pad: int,
        vocab_size: int,
        masked_lm_prob: float = 0.15,
        short_seq_prob: float = 0.1,
    ) -> None:
        _check_arguments(seq_length, num_samples, masked_lm_prob, short_seq_prob, vocab_size,
                         {"cls": cls, "sep": sep, "mask": mask, "pad": pad})
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.cls, self.sep, self.mask, self.pad = cls, sep, mask, pad
        self.vocab_size = vocab_size
        self.masked_lm_prob = masked_lm_prob
        self.short_seq_prob = short_seq_prob
        self.max_tokens = seq_length - 3

        documents = np.asarray(documents, dtype=np.int64)
        self._sent_item, self._sent_offset, self._sent_len, sent_doc = _sentences(indexed, documents, seq_length)
        self._block_start, self._block_end = _blocks(self._sent_len, sent_doc, len(documents), self.max_tokens)
        if len(self._block_start) == 0:
            raise ConfigError(
                f"no document among the {len(documents)} given to BertDataset from {indexed.prefix} "
                "has 2 tokens for a sentence pair"
            )
        # Epochs of independently shuffled blocks, truncated to num_samples.
        n_blocks = len(self._block_start)
        epochs = -(-num_samples // n_blocks)
        rng = np.random.default_rng(seed)
        self._sample_block = np.argsort(rng.random((epochs, n_blocks)), axis=1, kind="stable").ravel()[:num_samples]
        self.num_blocks = n_blocks

    def __len__(self) -> int:
        return self.num_samples

    def _sentence(self, s: int) -> np.ndarray:
        return self.indexed.get(int(self._sent_item[s]), int(self._sent_offset[s]), int(self._sent_len[s]))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        rng = np.random.default_rng([self.seed, index])
        b = int(self._sample_block[index])
        lo, hi = int(self._block_start[b]), int(self._block_end[b])
        if hi - lo >= 2:
            cut = int(rng.integers(lo + 1, hi))
            a = np.concatenate([self._sentence(s) for s in range(lo, cut)])
            b_seg = np.concatenate([self._sentence(s) for s in range(cut, hi)])
        else:
            whole = np.concatenate([self._sentence(s) for s in range(lo, hi)])
            # A single sentence longer than the sample is cut to a random window first.
            if len(whole) > self.max_tokens:
                start = int(rng.integers(0, len(whole) - self.max_tokens + 1))
                whole = whole[start : start + self.max_tokens]
            cut = int(rng.integers(1, len(whole)))
            a, b_seg = whole[:cut], whole[cut:]
        target = self.max_tokens
        if rng.random() < self.short_seq_prob:
            target = int(rng.integers(2, self.max_tokens + 1))
        a, b_seg = _truncate_pair(a.astype(np.int64), b_seg.astype(np.int64), target, rng)
        sop = int(rng.random() < 0.5)
        if sop:
            a, b_seg = b_seg, a
        return self._build(a, b_seg, sop, rng)

    def _build(self, a: np.ndarray, b: np.ndarray, sop: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        s = self.seq_length
        n = len(a) + len(b) + 3
        tokens = np.full(s, self.pad, dtype=np.int64)
        tokens[:n] = np.concatenate([[self.cls], a, [self.sep], b, [self.sep]])
        token_types = np.zeros(s, dtype=np.int64)
        token_types[len(a) + 2 : n] = 1
        padding_mask = np.zeros(s, dtype=np.int64)
        padding_mask[:n] = 1
        # Maskable positions: the A and B tokens (never [CLS], [SEP] or padding).
        cand = np.concatenate([np.arange(1, 1 + len(a)), np.arange(len(a) + 2, n - 1)])
        n_pred = max(1, int(round(len(cand) * self.masked_lm_prob)))
        chosen = rng.choice(cand, size=n_pred, replace=False)
        labels = np.zeros(s, dtype=np.int64)
        labels[chosen] = tokens[chosen]
        loss_mask = np.zeros(s, dtype=np.float32)
        loss_mask[chosen] = 1.0
        r = rng.random(n_pred)
        tokens[chosen[r < 0.8]] = self.mask
        rand_pos = chosen[r >= 0.9]
        tokens[rand_pos] = rng.integers(0, self.vocab_size, size=len(rand_pos))
        return {
            "tokens": tokens,
            "token_types": token_types,
            "labels": labels,
            "loss_mask": loss_mask,
            "padding_mask": padding_mask,
            "sop_label": np.int64(sop),
        }


def _check_arguments(seq_length: int, num_samples: int, masked_lm_prob: float, short_seq_prob: float,
                     vocab_size: int, specials: dict[str, int | None]) -> None:
    if seq_length < 5:
        raise ConfigError(f"BERT needs --seq-length >= 5 ([CLS] A [SEP] B [SEP]), got {seq_length}")
    if num_samples < 1:
        raise ConfigError(f"BertDataset needs at least one sample, got num_samples={num_samples}")
    if not 0.0 < masked_lm_prob < 1.0:
        raise ConfigError(f"masked_lm_prob must be in (0, 1), got {masked_lm_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ConfigError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    for name, v in specials.items():
        if v is None or not 0 <= v < vocab_size:
            raise ConfigError(f"BERT needs a [{name.upper()}] token id in [0, {vocab_size}), got {v}")


def _sentences(indexed: IndexedDataset, documents: np.ndarray, seq_length: int):
    """(item, token offset, length, document position) per sentence, vectorized.

    Sentences are every item of a multi-item document, and ``seq_length // 4``-token chunks of
    a single-item document (what tools/preprocess_data.py writes); empty items give none.
    """
    first, last = indexed.doc_idx[documents], indexed.doc_idx[documents + 1]
    n_items = last - first
    chunk = max(1, seq_length // 4)
    items = np.repeat(first, n_items) + _ranks(n_items)
    item_doc = np.repeat(np.arange(len(documents)), n_items)
    sizes = indexed.sizes[items].astype(np.int64)
    single = n_items[item_doc] == 1
    n_sent = np.where(single, -(-sizes // chunk), (sizes > 0).astype(np.int64))
    sent_single = np.repeat(single, n_sent)
    sent_item = np.repeat(items, n_sent)
    sent_offset = np.where(sent_single, _ranks(n_sent) * chunk, 0)
    rest = np.repeat(sizes, n_sent) - sent_offset
    sent_len = np.where(sent_single, np.minimum(rest, chunk), rest)
    return sent_item, sent_offset, sent_len, np.repeat(item_doc, n_sent)


def _blocks(sent_len: np.ndarray, sent_doc: np.ndarray, n_docs: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) sentence ranges of the blocks with at least 2 tokens (A and B need one each).

    A sentence belongs to block ``floor(start-in-document / max_tokens)`` of its document.
    """
    cum = np.concatenate([[0], np.cumsum(sent_len)])
    doc_first_sent = np.searchsorted(sent_doc, np.arange(n_docs), side="left")
    start_in_doc = cum[:-1] - cum[doc_first_sent[sent_doc]]
    key_change = np.ones(len(sent_doc), dtype=bool)
    if len(sent_doc) > 1:
        block_no = start_in_doc // max_tokens
        key_change[1:] = (sent_doc[1:] != sent_doc[:-1]) | (block_no[1:] != block_no[:-1])
    block_start = np.flatnonzero(key_change)
    block_end = np.append(block_start[1:], len(sent_doc))
    usable = cum[block_end] - cum[block_start] >= 2
    return block_start[usable], block_end[usable]


def _ranks(counts: np.ndarray) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] for counts c: the position of each element within its group."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts


def _truncate_pair(a: np.ndarray, b: np.ndarray, target: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Cut the longer segment until ``len(a) + len(b) <= target`` (``target >= 2``).

    Megatron drops one token at a time from the longer segment (ties: B); the closed form
    below gives the same lengths, and each segment loses its tokens from one random end.
    """
    la, lb = len(a), len(b)
    excess = la + lb - target
    if excess <= 0:
        return a, b
    if la > lb and la - excess >= lb:
        new_a, new_b = la - excess, lb
    elif lb >= la and lb - excess >= la:
        new_a, new_b = la, lb - excess
    else:  # both end up cut to halves; an odd target leaves A the extra token
        new_a, new_b = -(-target // 2), target // 2

    def cut(x: np.ndarray, keep: int) -> np.ndarray:
        if keep >= len(x):
            return x
        return x[len(x) - keep :] if rng.random() < 0.5 else x[:keep]

    return cut(a, new_a), cut(b, new_b)
