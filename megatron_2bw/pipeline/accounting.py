"""What a stage holds: weight versions alive, in-flight microbatches, stashed activation bytes.

Stashed bytes are measured, not estimated: a saved-tensor hook sees every tensor autograd keeps
for backward and counts each storage once, leaving out the weight and gradient buffers.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch


@dataclass
class StageStats:
    stage: int = 0
    weight_versions: int = 0  # versions held in memory (2 for 2BW, 1 otherwise)
    max_live_versions: int = 0  # most versions referenced at once by in-flight work or as newest
    max_inflight: int = 0
    stashed_bytes: int = 0  # now
    peak_stashed_bytes: int = 0
    weight_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    cuda_peak_bytes: int | None = None
    update_wait_s: float = 0.0  # time APPLY_UPDATE waited for its reductions (hidden when ~0)

    def as_dict(self) -> dict:
        return asdict(self)


class SavedBytes:
    """Counts bytes of the storages autograd saves inside ``measure()`` (each storage once)."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += st.nbytes()
        return t

    @contextlib.contextmanager
    def measure(self):
        self.seen, self.bytes = set(), 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
