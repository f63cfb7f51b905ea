"""Which half of a split backward is running: the one fact a tensor-parallel layer needs from the
zero-bubble schedules (its all-reduce belongs to the input-gradient half only).

The pipeline's split backward (``pipeline/split_backward.py``) sets it around each autograd call; the
layers read it. It lives on this floor so that the layers never import the pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_PHASE: list[str | None] = [None]


def phase() -> str | None:
    """``"input"`` while a BACKWARD_INPUT runs autograd, ``"weight"`` while a BACKWARD_WEIGHT does, None
    otherwise (a whole backward)."""
    return _PHASE[0]


@contextlib.contextmanager
def in_phase(name: str) -> Iterator[None]:
    """Run the body as the ``name`` half of a split backward."""
    _PHASE[0] = name
    try:
        yield
    finally:
        _PHASE[0] = None
