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
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .indexed_dataset import IndexedDataset


class GPTDataset:
    """``ds[i] == {"tokens": int64[seq_length + 1]}``, deterministic given (seed, data)."""

    def __init__(
        self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int, num_samples: int, seed: int,
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
            raise ConfigError(f"the {len(documents)} documents given to GPTDataset from {indexed.prefix} hold no tokens")
        block = max(tokens_per_epoch // seq_length, 1)  # windows shuffled together
        n_blocks = -(-num_samples // block)
        windows = n_blocks * block  # whole blocks, so a block's order never depends on num_samples
        needed = windows * seq_length + 1
        num_epochs = -(-needed // tokens_per_epoch)

        rng = np.random.default_rng(seed)
        # One independent shuffle per epoch, as a single vectorized argsort of random keys.
        order = np.argsort(rng.random((num_epochs, len(documents))), axis=1, kind="stable").ravel()
        stream_len = doc_tokens[order]
        stream_cum = np.concatenate([[0], np.cumsum(stream_len)])
        starts = np.arange(windows, dtype=np.int64) * seq_length
        # side="right" skips empty documents: the window starts in the last document beginning at or before it.
        pos = np.searchsorted(stream_cum, starts, side="right") - 1
        self._stream_docs = order  # position in the stream -> index into ``documents``
        self._stream_cum = stream_cum
        self._doc_start_item = doc_start_item
        self._doc_end_item = doc_end_item
        self._item_cum = item_cum
        self._sample_pos = pos
        self._sample_offset = starts - stream_cum[pos]
        # Block k's windows in the order of row k of one generator's draws (its own stream: the document
        # draws above depend on the number of epochs): the first rows never depend on num_samples.
        keys = np.random.default_rng([seed, 1]).random((n_blocks, block))
        within = np.argsort(keys, axis=1, kind="stable")
        self._shuffle = (within + block * np.arange(n_blocks, dtype=np.int64)[:, None]).ravel()[:num_samples]
        self.block = block
        self.num_epochs = num_epochs
        # For inspection and tests: document ids in stream order, and sample i's window number.
        self.doc_order = documents[order]
        self.sample_order = self._shuffle

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
        s = int(self._shuffle[i])
        pos, offset = int(self._sample_pos[s]), int(self._sample_offset[s])
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
