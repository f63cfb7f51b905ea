"""RNG snapshots: the one place that captures and restores random-number-generator state.

Activation recomputation snapshots the torch generators (CPU and, on CUDA, the device's) and
the tensor-parallel tracker before a forward, and restores them around the replay during
backward so that the replay draws the same dropout masks. Checkpoints take the same snapshot
plus Python's and NumPy's generators (``host_libraries=True``) so a resume continues every
random stream exactly.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from .random import RNGTracker


@dataclass
class RNGSnapshot:
    torch_cpu: torch.Tensor
    torch_cuda: torch.Tensor | None = None
    tracker: Any = None
    python: Any = None
    numpy: Any = None
    tracker_device: str | None = None  # the device type the tracker state belongs to ("cpu", "cuda")

    @classmethod
    def capture(cls, device: torch.device, tracker: RNGTracker | None, *, host_libraries: bool = False) -> RNGSnapshot:
        """The current states; ``host_libraries`` adds Python's and NumPy's generators."""
        return cls(
            torch_cpu=torch.get_rng_state(),
            torch_cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            tracker=tracker.get_state() if tracker is not None else None,
            python=random.getstate() if host_libraries else None,
            numpy=np.random.get_state() if host_libraries else None,
            tracker_device=tracker.device.type if tracker is not None else None,
        )

    def restore(self, device: torch.device, tracker: RNGTracker | None) -> None:
        """Put every captured state back (states not captured are left alone)."""
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if device.type == "cuda" and self.torch_cuda is not None:
            torch.cuda.set_rng_state(self.torch_cuda, device)
        if tracker is not None and self.tracker is not None:
            tracker.set_state(self.tracker, self.tracker_device)

    def as_dict(self) -> dict:
        """The checkpoint form: keys ``python``, ``numpy``, ``torch_cpu``, ``torch_cuda``, ``tracker``,
        ``tracker_device``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, state: dict) -> RNGSnapshot:
        return cls(**{f.name: state.get(f.name) for f in fields(cls)})


# ---- recomputation inside a stage: Megatron's --recompute-granularity/-method/-num-layers --------

_REPLAYS = {"stash": 0, "checkpoint": 0}  # the replays enclosing the running code, by kind (they nest)


@contextlib.contextmanager
def replaying_forward(kind: str = "checkpoint") -> Iterator[None]:
    """Marks a forward that recomputes one already run: ``"checkpoint"``, a checkpoint's replay in backward
    (the second forward that records gradients); ``"stash"``, the pipeline's replay of a stashed input (the
    first forward with gradients, after one without). What a forward counts once per microbatch (an MoE
    router's tokens per expert) is not counted again inside either."""
    _REPLAYS[kind] += 1
    try:
        yield
    finally:
        _REPLAYS[kind] -= 1


def replaying(kind: str | None = None) -> bool:
    """Whether the running forward is a replay (of ``kind``; None: of either)."""
    return _REPLAYS[kind] > 0 if kind is not None else any(_REPLAYS.values())


class _Keep(torch.autograd.Function):
    """Identity that saves its input, so the stash accounting sees what a checkpoint holds."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def checkpointed(fn: Callable[..., Any], *args: Any, tracker: RNGTracker | None) -> Any:
    """``fn(*args)`` keeping only ``args`` for backward, which replays ``fn`` with the same RNG draws.

    The default generators and the tensor-parallel tracker are snapshotted before the forward and
    restored around the replay (torch's own RNG preservation does not know the tracker).
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    snap = RNGSnapshot.capture(device, tracker)
    calls = [0]

    def run(*a: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        now = RNGSnapshot.capture(device, tracker)
        snap.restore(device, tracker)
        try:
            with replaying_forward():
                return fn(*a)
        finally:
            now.restore(device, tracker)

    kept = [_Keep.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
    return checkpoint(run, *kept, use_reentrant=False, preserve_rng_state=False)
