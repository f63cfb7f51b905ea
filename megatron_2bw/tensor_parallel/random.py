"""RNG tracker: dropout that differs across tensor ranks yet replays exactly under recomputation.

Dropout on replicated activations (hidden dropout) uses the default generator, seeded the same
on every tensor rank, so the ranks agree. Dropout on sharded activations (attention probabilities
of this rank's heads) runs inside ``tracker.fork()``, which swaps in a generator state seeded by
the tensor rank. Recomputation saves and restores both states, so a replayed forward draws the
same masks (see ``pipeline/recompute.py``).
"""

from __future__ import annotations

import contextlib

import torch

_TP_SEED_OFFSET = 2718


class RNGTracker:
    """Holds the tensor-parallel RNG state of one device; forked around sharded dropout."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._state = self._make_state(seed + _TP_SEED_OFFSET + tp_rank)

    def __deepcopy__(self, memo) -> "RNGTracker":
        return self  # weight versions of a stage share one RNG stream

    def _make_state(self, seed: int) -> torch.Tensor:
        if self.device.type == "cuda":
            saved = torch.cuda.get_rng_state(self.device)
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

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()


def seed_everything(seed: int, device: torch.device | str = "cpu") -> None:
    """Seed the default generators (same value on every tensor rank: replicated dropout agrees)."""
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(seed)
