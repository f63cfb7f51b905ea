"""What a stage holds: weight versions alive, in-flight microbatches, stashed activation bytes.

Stashed bytes are measured, not estimated: a saved-tensor hook sees every tensor autograd keeps
for backward and counts each storage once, leaving out the weight and gradient buffers.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from ..schedule.actions import COMPUTE_OPS
from .transport import RECV_OPS


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
    # host clocks of the training loop, cumulative (a log window's bubble is their difference over it)
    # time spent receiving activations / gradients: in receive units (posting) and, on gloo, where a compute
    # waits for its input (the transport hands a receive on; PipelineRank._received books the wait here)
    recv_wait_s: float = 0.0
    compute_s: float = 0.0  # time in compute actions (forward, backward and its halves)
    train_s: float = 0.0  # time inside PipelineRank.train, so boundaries (evaluation, saves) do not count

    @property
    def idle_s(self) -> float:
        """The stage's idle time: waiting on receives and on the reductions before an update, nothing else."""
        return self.recv_wait_s + self.update_wait_s

    def as_dict(self) -> dict:
        return asdict(self)


def clock_units(stats: StageStats, unit, seconds: float) -> None:
    """Book one executed unit's host seconds: compute actions to ``compute_s``, transfer units that
    receive to ``recv_wait_s`` (sends never block; the update's wait is booked by the update itself).

    Host wall clock: exact on CPU. On CUDA compute is the host's dispatch time and a receive's wait
    is the host's (NCCL's ``wait()`` makes the stream wait, not the host), so the bubble from these
    clocks reads low there; no device synchronization is added to measure it."""
    op = unit[0].op
    if op in COMPUTE_OPS:
        stats.compute_s += seconds
    elif any(a.op in RECV_OPS for a in unit):
        stats.recv_wait_s += seconds


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
