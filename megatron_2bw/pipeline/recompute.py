"""RNG snapshots for activation recomputation: a replayed forward draws the same dropout masks.

The stage saves the default generator state (CPU and, on CUDA, the device's) and the
tensor-parallel tracker's state before a forward, and restores them around the recomputation
during backward, then puts the current states back.
"""

from __future__ import annotations

import torch

from ..tensor_parallel.random import RNGTracker


class RNGSnapshot:
    __slots__ = ("cpu", "cuda", "tracker")

    def __init__(self, device: torch.device, tracker: RNGTracker | None) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.tracker = tracker.get_state() if tracker is not None else None

    def restore(self, device: torch.device, tracker: RNGTracker | None) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)
        if tracker is not None and self.tracker is not None:
            tracker.set_state(self.tracker)
