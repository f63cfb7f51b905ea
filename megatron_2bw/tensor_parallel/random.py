"""RNG tracker: dropout that differs across tensor ranks yet replays exactly under recomputation.

Dropout on replicated activations (hidden dropout) uses the default generator, seeded the same
on every tensor rank, so the ranks agree. Dropout on sharded activations (attention probabilities
of this rank's heads) runs inside ``tracker.fork()``, which swaps in a generator state seeded by
the tensor rank. Recomputation saves and restores both states, so a replayed forward draws the
same masks (see ``pipeline/recompute.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

import torch

log = logging.getLogger(__name__)

_TP_SEED_OFFSET = 2718


class RNGTracker:
    """Holds the tensor-parallel RNG state of one device; forked around sharded dropout."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seed = seed + _TP_SEED_OFFSET + tp_rank
        self._state = self._make_state(self.seed)

    def __deepcopy__(self, memo) -> "RNGTracker":
        return self  # weight versions of a stage share one RNG stream

    def _make_state(self, seed: int) -> torch.Tensor:
        if self.device.type == "cuda":
            saved = torch.cuda.get_rng_state(self.device)
            with torch.cuda.device(self.device):  # manual_seed seeds the current device: make it this one
                torch.cuda.manual_seed(seed)
            state = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(saved, self.device)
            return state
        g = torch.Generator()
        g.manual_seed(seed)
        return g.get_state()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self):
        """Run the body on the tensor-parallel RNG stream, then restore the default stream."""
        default = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(default)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor, device_type: str | None = None) -> None:
        """Adopt a saved state; one from another device type (a CPU checkpoint resumed on a GPU, or the
        reverse: a 5056-byte Mersenne-Twister state vs a 16-byte Philox seed and offset) cannot be
        used as is, so the stream is re-seeded deterministically from this tracker's seed and the
        saved state's bytes, with a warning. ``device_type`` None (older checkpoints): judged by size."""
        foreign = (device_type is not None and device_type != self.device.type) or \
            state.numel() != self._state.numel()
        if not foreign:
            self._state = state.clone()
            return
        digest = hashlib.sha256(state.cpu().numpy().tobytes()).digest()
        seed = (self.seed + int.from_bytes(digest[:7], "little")) % 2**63
        log.warning("the saved tensor-parallel RNG state is from a %s device (%d bytes); this run is on %s: "
                    "re-seeded it deterministically (dropout masks differ from an uninterrupted run)",
                    device_type or "different", state.numel(), self.device.type)
        self._state = self._make_state(seed)


def seed_everything(seed: int, device: torch.device | str = "cpu") -> None:
    """Seed the default generators (same value on every tensor rank: replicated dropout agrees)."""
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(seed)
