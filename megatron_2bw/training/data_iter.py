"""Microbatches for the pipeline engine, per data-parallel rank.

Step ``t``'s global batch is the ``B`` samples ``[base(t), base(t) + B)`` of the dataset, with
``base(t) = start_sample + (t - start_step) * B``; data-parallel replica ``j`` takes its
contiguous ``B / w`` slice, cut into ``m`` microbatches of ``b``. So every layout sees the same
global batches, and a resumed run (``start_step``/``start_sample`` from the checkpoint) reads
exactly the samples the uninterrupted run would have read.

On CUDA the provider prefetches: when microbatch ``mb`` is handed out, the host-to-device copy of the
next one not yet handed out is issued on a side stream, and the compute stream waits only for that
copy's event when the batch is taken. The values are the same either way; on the CPU nothing is
prefetched unless asked (``prefetch=True`` runs the same bookkeeping with no streams).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from ..errors import ConfigError


def collate(samples: list) -> torch.Tensor | dict[str, torch.Tensor]:
    """GPT samples ``{"tokens": [s+1]}`` -> int64 ``[b, s+1]``; BERT sample dicts -> dict of stacked tensors."""
    if set(samples[0]) == {"tokens"}:
        return torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))
    return {k: torch.from_numpy(np.stack([np.asarray(s[k]) for s in samples])) for k in samples[0]}


class CopyStreams(Protocol):
    """Where a prefetched microbatch's copies run and how the compute stream takes it over (the seam tests fake)."""

    def issuing(self) -> contextlib.AbstractContextManager: ...

    def mark(self) -> object: ...

    def hand_over(self, mark: object, tensors: list[torch.Tensor]) -> None: ...


class SideStream:
    """A CUDA side stream for the copies: the compute stream waits for one batch's event, and each tensor
    is recorded on the compute stream so the caching allocator keeps its memory until that stream is done."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stream = device, torch.cuda.Stream(device)

    def issuing(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def mark(self) -> object:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def hand_over(self, mark: object, tensors: list[torch.Tensor]) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(mark)
        for t in tensors:
            if t.device.type == "cuda":
                t.record_stream(compute)


class NoStreams:
    """The CPU's copy streams: none (the copies are synchronous), so prefetching only loads a batch earlier."""

    def issuing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def mark(self) -> object:
        return None

    def hand_over(self, mark: object, tensors: list[torch.Tensor]) -> None:
        pass


@dataclass
class _Ahead:
    mb: int
    batch: dict
    mark: object


class MicrobatchProvider:
    """``provider(mb)`` -> the tensors of global microbatch ``mb`` (``mb // m`` is its step) on this rank.

    ``prefetch`` (default: on CUDA or with ``copy_streams``): each call also issues the copies of the next
    microbatch not handed out yet (``copy_streams``: a :class:`SideStream` on CUDA). A re-request of an
    earlier microbatch (another chunk's forward, a re-run) loads it on the spot and keeps the prefetched
    one; a prefetch that cannot load (past the data's end, a bad token id) is dropped, so its error comes
    only if that microbatch is asked for. ``make_batch`` then runs under the side stream one microbatch
    early, or not at all for a dropped one: it must stay local (no collective) and keep no device tensor
    from one call to the next.
    """

    def __init__(
        self, dataset, make_batch: Callable, *, global_batch: int, micro_batch: int, m: int, w: int, dp_rank: int,
        device: torch.device, start_step: int = 0, start_sample: int = 0, vocab_size: int | None = None,
        prefetch: bool | None = None, copy_streams: CopyStreams | None = None,
    ) -> None:
        self.dataset, self.make_batch, self.device = dataset, make_batch, device
        # every batch's token ids are checked against it (start-up scans sample 64 windows)
        self.vocab_size = vocab_size
        self.B, self.b, self.m, self.w, self.dp_rank = global_batch, micro_batch, m, w, dp_rank
        self.start_step, self.start_sample = start_step, start_sample
        if prefetch is None:  # given streams ask for it
            prefetch = device.type == "cuda" or copy_streams is not None
        self.copies: CopyStreams | None = None if not prefetch else copy_streams or (
            SideStream(device) if device.type == "cuda" else NoStreams())
        self._ahead: _Ahead | None = None
        self._highest = -1  # the highest microbatch handed out
        self.served_ahead = 0  # microbatches handed out from a prefetch (the rest were loaded on the spot)

    def consumed_samples(self, step: int) -> int:
        """Samples consumed by all replicas before step ``step`` (the checkpoint's data position)."""
        return self.start_sample + (step - self.start_step) * self.B

    def sample_range(self, mb: int) -> tuple[int, int]:
        step, i = divmod(mb, self.m)
        lo = self.consumed_samples(step) + self.dp_rank * (self.B // self.w) + i * self.b
        return lo, lo + self.b

    def __call__(self, mb: int) -> dict:
        if self.copies is None:
            return self._load(mb)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.mb == mb:
            self.copies.hand_over(ahead.mark, [v for v in ahead.batch.values() if isinstance(v, torch.Tensor)])
            batch = ahead.batch
            self.served_ahead += 1
        else:
            self._ahead = ahead  # an earlier microbatch asked again: the prefetched one stays
            batch = self._load(mb)
        self._highest = max(self._highest, mb)
        if self._ahead is None or self._ahead.mb != self._highest + 1:
            self._ahead = self._prefetch(self._highest + 1)
        return batch

    def _prefetch(self, mb: int) -> _Ahead | None:
        """Load ``mb`` with its copies on the side stream, or None where it cannot be loaded now."""
        lo, hi = self.sample_range(mb)
        if lo < 0 or hi > len(self.dataset):
            return None
        try:
            with self.copies.issuing():
                batch = self._load(mb)
                return _Ahead(mb, batch, self.copies.mark())
        except Exception:  # noqa: BLE001 - loaded again, and its error raised, only if mb is asked for
            return None

    def _load(self, mb: int) -> dict:
        lo, hi = self.sample_range(mb)
        if lo < 0 or hi > len(self.dataset):
            raise IndexError(f"microbatch {mb} needs samples [{lo}, {hi}) but the dataset has {len(self.dataset)}")
        raw = collate([self.dataset[j] for j in range(lo, hi)])
        if self.vocab_size is not None:
            self._check_ids(raw, lo, hi)
        pinned = self.device.type == "cuda"  # pinned, so the copy is asynchronous and off the compute's way
        if isinstance(raw, torch.Tensor):  # GPT: tokens first, so masks built from them are built on the device
            raw = (raw.pin_memory() if pinned else raw).to(self.device, non_blocking=True)
        batch = self.make_batch(raw)
        if pinned:
            return {k: v if v.device == self.device else v.pin_memory().to(self.device, non_blocking=True)
                    for k, v in batch.items()}
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _check_ids(self, stacked, lo: int, hi: int) -> None:
        """A token id outside the vocabulary is a data/tokenizer mismatch: one line, not an IndexError in the
        embedding (or a "diverged" verdict) later. One min and max over the CPU batch: no device sync."""
        tokens = (stacked if isinstance(stacked, torch.Tensor)
                  else stacked.get("tokens") if isinstance(stacked, dict) else None)
        if tokens is None or tokens.numel() == 0:
            return
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ConfigError(f"samples [{lo}, {hi}) of the data hold token id {bad} but the tokenizer's "
                              f"vocabulary has {self.vocab_size} entries: the data was made with another tokenizer "
                              "(or is corrupt)")
