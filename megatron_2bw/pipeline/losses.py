"""The last stage's loss as one row per microbatch (the total and its named parts), summed per step and read
with one host sync: on CUDA through a pinned copy that waits for itself alone."""

from __future__ import annotations

from typing import Callable

import torch


def loss_parts(loss_fn: Callable, out, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total loss, named detached components): a loss function with ``parts`` reports its terms
    (e.g. BERT's MLM and sentence-order losses); any other returns its total alone."""
    parts = getattr(loss_fn, "parts", None)
    return parts(out, batch) if parts is not None else (loss_fn(out, batch), {})


def _loss_row(total: torch.Tensor, comps: dict[str, torch.Tensor]) -> torch.Tensor:
    """The total and its components as one float32 vector, so a step needs one host sync."""
    return torch.stack([total.detach().float(), *(c.detach().float() for c in comps.values())])


class _HostCopy:
    """A device tensor on its way to pinned host memory; :meth:`result` waits for that copy alone (an
    event), not for everything queued on the stream since, as ``tolist()`` would."""

    def __init__(self, t: torch.Tensor) -> None:
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def result(self) -> list[float]:
        self.done.synchronize()
        return self.host.tolist()
