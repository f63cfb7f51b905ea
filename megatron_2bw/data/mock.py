"""``--mock-data``: Megatron's synthetic GPT documents, made on the fly, no file read or written.

As Megatron's ``MockGPTLowLevelDataset``: ``MOCK_DOCUMENTS`` documents whose lengths are drawn
once from ``numpy.random.default_rng(0)`` in ``[1, MOCK_MAX_LENGTH)``; document tokens count up
``1, 2, ...`` and end with the tokenizer's eod. Ids above the vocabulary wrap (``(j % (V - 1)) + 1``),
so every id fits even a small ``NullTokenizer``. The documents then go through the same
:class:`~megatron_2bw.data.gpt_dataset.GPTDataset` (split, epochs, windows, shuffle) as real data.
"""

from __future__ import annotations

import numpy as np

MOCK_DOCUMENTS = 100_000
MOCK_MAX_LENGTH = 4096
MOCK_PREFIX = "mock-data"


class MockDocuments:
    """The read interface of ``IndexedDataset`` (one item per document) over synthetic documents."""

    def __init__(self, vocab_size: int, eod: int | None, documents: int = MOCK_DOCUMENTS,
                 max_length: int = MOCK_MAX_LENGTH) -> None:
        self.prefix = MOCK_PREFIX
        self.vocab_size, self.eod = int(vocab_size), (int(eod) if eod is not None else int(vocab_size) - 1)
        rng = np.random.default_rng(0)
        self._sizes = rng.integers(low=1, high=max_length, size=documents, dtype=np.int32)
        self._doc_idx = np.arange(documents + 1, dtype=np.int64)

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def document_sizes(self) -> np.ndarray:
        return self._sizes.astype(np.int64)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``i``: ``j + 1`` (wrapped), eod last."""
        size = int(self._sizes[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"[{offset}, {offset + length}) runs past mock document {i} of size {size}")
        j = np.arange(offset, offset + length, dtype=np.int64)
        out = j % max(self.vocab_size - 1, 1) + 1
        out[j == size - 1] = self.eod
        return out
