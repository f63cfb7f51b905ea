"""GPT samples: a split's documents concatenated and cut into ``seq_length + 1`` token windows.

As in Megatron's GPTDataset: each epoch visits the split's documents in a fresh shuffled
order, epochs are appended until ``num_samples`` windows fit, window ``i`` starts at token
``i * seq_length`` of that stream (consecutive windows share one token: the last input of
one is the first label of the next), and the window order is shuffled. All index arrays
are built with numpy (cumsum/searchsorted), so construction is fast for millions of samples;
only ``__getitem__`` walks the few documents one window spans.

The window order is shuffled in blocks of about one epoch's windows (``tokens per epoch //
seq_length``), each block by its own rows of one generator, so the first N samples are the same
whatever ``num_samples`` is: a run whose ``--train-iters`` is raised on resume continues exactly the
sample order that the longer run would have had from the start (Megatron reshuffles instead).

With ``cache_dir`` (``--data-cache-path``) the index arrays are saved there once, named by a hash
of what they depend on (the data files' size and time, the documents, sequence length, sample
count and seed; the description is written beside them as JSON), and later runs load them
instead of rebuilding: Megatron's index cache. Files are written atomically (temp + rename), so
ranks building the same index at once never read a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from ..errors import ConfigError
from .indexed_dataset import IndexedDataset, index_file_path

CACHE_VERSION = 3  # 3: window starts per sample, not per window
_CACHED = ("order", "stream_cum", "pos", "offset", "shuffle")


def _describe(indexed, documents: np.ndarray, seq_length: int, num_samples: int, seed: int) -> dict:
    """What a GPT sample index depends on (its cache key)."""
    desc: dict = {"class": "GPTDataset", "version": CACHE_VERSION, "seq_length": seq_length,
                  "num_samples": num_samples, "seed": seed, "documents": [int(documents[0]) if documents.size else 0,
                                                                         int(documents.size)]}
    idx = index_file_path(indexed.prefix)
    if os.path.isfile(idx):
        st = os.stat(idx)
        desc.update(prefix=os.path.realpath(indexed.prefix), index_bytes=st.st_size, index_mtime_ns=st.st_mtime_ns)
    else:  # synthetic documents (--mock-data)
        desc.update(prefix=indexed.prefix, vocab_size=getattr(indexed, "vocab_size", None),
                    eod=getattr(indexed, "eod", None))
    contiguous = documents.size == 0 or bool(np.all(np.diff(documents) == 1))
    if not contiguous:
        desc["documents_sha1"] = hashlib.sha1(documents.tobytes()).hexdigest()
    return desc


def _cache_files(cache_dir: str, desc: dict) -> tuple[str, str]:
    key = hashlib.sha1(json.dumps(desc, sort_keys=True).encode()).hexdigest()
    base = os.path.join(cache_dir, f"{key}-GPTDataset")
    return base + "-index.npz", base + "-description.json"


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError(f"--data-cache-path {os.path.dirname(path)}: cannot write {path}: "
                          f"{e.strerror or e}") from None


def _first_in_order(keys: np.ndarray, n: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")[:n]`` without sorting all of ``keys`` when ``n`` is a small part of it
    (a short run on a large corpus: Megatron's mock corpus is 12.8M windows of 16 tokens in one block). The n
    smallest keys are found by a partition (linear), ties at the boundary taken in index order, and only
    they are sorted by (key, index): the stable sort's order exactly."""
    if n * 8 >= keys.size:
        return np.argsort(keys, kind="stable")[:n]
    kth = np.partition(keys, n - 1)[n - 1]
    below = np.flatnonzero(keys < kth)
    chosen = np.concatenate([below, np.flatnonzero(keys == kth)[:n - below.size]])
    return chosen[np.lexsort((chosen, keys[chosen]))]


class GPTDataset:
    """``ds[i] == {"tokens": int64[seq_length + 1]}``, deterministic given (seed, data)."""

    def __init__(
        self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int, num_samples: int, seed: int,
        cache_dir: str | None = None,
    ) -> None:
        if seq_length < 1:
            raise ConfigError(f"--seq-length must be positive, got {seq_length}")
        if num_samples < 1:
            raise ConfigError(f"GPTDataset needs at least one sample, got num_samples={num_samples}")
        documents = np.asarray(documents, dtype=np.int64)
        if documents.size and (documents.min() < 0 or documents.max() >= indexed.num_documents):
            raise ConfigError(f"document indices must lie in [0, {indexed.num_documents}) for {indexed.prefix}")
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed

        # Documents are item ranges; a document's tokens are its items back to back.
        item_cum = np.concatenate([[0], np.cumsum(indexed.sizes, dtype=np.int64)])
        doc_start_item = indexed.doc_idx[documents]
        doc_end_item = indexed.doc_idx[documents + 1]
        doc_tokens = item_cum[doc_end_item] - item_cum[doc_start_item]
        tokens_per_epoch = int(doc_tokens.sum())
        if tokens_per_epoch == 0:
            raise ConfigError(f"the {len(documents)} documents given to GPTDataset from {indexed.prefix} "
                              "hold no tokens")
        block = max(tokens_per_epoch // seq_length, 1)  # windows shuffled together
        needed = -(-num_samples // block) * block * seq_length + 1  # whole blocks of windows
        num_epochs = -(-needed // tokens_per_epoch)

        arrays = None
        self.cache_file: str | None = None  # the index file used (loaded or written), with --data-cache-path
        if cache_dir:
            desc = _describe(indexed, documents, seq_length, num_samples, seed)
            self.cache_file, desc_file = _cache_files(cache_dir, desc)
            if os.path.isfile(self.cache_file):
                with np.load(self.cache_file) as z:
                    arrays = {k: z[k] for k in _CACHED}
        if arrays is None:
            arrays = self._build(doc_tokens, num_epochs, len(documents), num_samples, seq_length, seed, block)
            if cache_dir:
                try:
                    os.makedirs(cache_dir, exist_ok=True)
                except OSError as e:
                    raise ConfigError(f"--data-cache-path {cache_dir}: {e.strerror or e}") from None
                _atomic_write(self.cache_file, lambda f: np.savez(f, **arrays))
                _atomic_write(desc_file, lambda f: f.write(json.dumps(desc, indent=1, sort_keys=True).encode()))
        order, stream_cum = arrays["order"], arrays["stream_cum"]
        self._stream_docs = order  # position in the stream -> index into ``documents``
        self._stream_cum = stream_cum
        self._doc_start_item = doc_start_item
        self._doc_end_item = doc_end_item
        self._item_cum = item_cum
        self._sample_pos = arrays["pos"]
        self._sample_offset = arrays["offset"]
        self._shuffle = arrays["shuffle"]
        self.block = block
        self.num_epochs = num_epochs
        # For inspection and tests: document ids in stream order, and sample i's window number.
        self.doc_order = documents[order]
        self.sample_order = self._shuffle

    @staticmethod
    def _build(doc_tokens: np.ndarray, num_epochs: int, num_docs: int, num_samples: int, seq_length: int,
               seed: int, block: int) -> dict[str, np.ndarray]:
        """The index arrays: epochs' document order, its token offsets, each window's start and the
        shuffle (in blocks of ``block`` windows: the module docstring)."""
        n_blocks = -(-num_samples // block)  # whole blocks, so a block's order never depends on num_samples
        rng = np.random.default_rng(seed)
        # One independent shuffle per epoch, as a single vectorized argsort of random keys.
        order = np.argsort(rng.random((num_epochs, num_docs)), axis=1, kind="stable").ravel()
        stream_cum = np.concatenate([[0], np.cumsum(doc_tokens[order])])
        # Block k's windows in the order of row k of one generator's draws (its own stream: the document
        # draws above depend on the number of epochs): the first rows never depend on num_samples.
        keys = np.random.default_rng([seed, 1]).random((n_blocks, block))
        last = num_samples - (n_blocks - 1) * block  # the windows used of the last block
        within = [np.argsort(row, kind="stable") for row in keys[:-1]] + [_first_in_order(keys[-1], last)]
        shuffle = np.concatenate([w + block * k for k, w in enumerate(within)]).astype(np.int64)
        # where each sample's window starts (only the windows drawn: a short run on a large corpus draws few);
        # side="right" skips empty documents: the window starts in the last document beginning at or before it
        starts = shuffle * seq_length
        pos = np.searchsorted(stream_cum, starts, side="right") - 1
        return {"order": order, "stream_cum": stream_cum, "pos": pos, "offset": starts - stream_cum[pos],
                "shuffle": shuffle}

    def __len__(self) -> int:
        return self.num_samples

    def _doc_tokens(self, d: int, offset: int, length: int) -> list[np.ndarray]:
        """Up to ``length`` tokens of (split-local) document ``d`` from ``offset``, as item views."""
        out = []
        first, last = int(self._doc_start_item[d]), int(self._doc_end_item[d])
        # The item holding ``offset``: items are contiguous in the token count.
        base = int(self._item_cum[first])
        item = int(np.searchsorted(self._item_cum[first : last + 1], base + offset, side="right")) - 1 + first
        offset -= int(self._item_cum[item]) - base
        while length > 0 and item < last:
            size = int(self.indexed.sizes[item])
            take = min(length, size - offset)
            if take > 0:
                out.append(self.indexed.get(item, offset, take))
                length -= take
            offset = 0
            item += 1
        return out

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        pos, offset = int(self._sample_pos[i]), int(self._sample_offset[i])  # sample i's window (_build)
        remaining = self.seq_length + 1
        pieces = []
        while remaining > 0:
            length = int(self._stream_cum[pos + 1] - self._stream_cum[pos])
            take = min(remaining, length - offset)
            if take > 0:
                pieces.extend(self._doc_tokens(int(self._stream_docs[pos]), offset, take))
                remaining -= take
            offset = 0
            pos += 1
        return {"tokens": np.concatenate(pieces).astype(np.int64)}
