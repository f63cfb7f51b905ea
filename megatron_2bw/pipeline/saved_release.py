"""Free, at a split backward's input-gradient pass, the saved activations its weight-gradient pass never reads.

BACKWARD_INPUT keeps the autograd graph for BACKWARD_WEIGHT (``autograd.grad(..., retain_graph=True)``), and
a retained graph keeps every tensor its nodes saved: the attention scores, the softmax of the loss, the
GeLU's input, the dropout masks. W runs only the first-use nodes of the parameters and the few nodes
between them and the parameters (``split_backward._Group``), which read the weight GEMMs' inputs and the
norms' inputs and statistics. This is the Zero Bubble paper's accounting (a microbatch holds ``M_B`` from
F to B and only ``M_W`` from B to W); torch's ``stage_backward_input`` frees nothing.

PyTorch has no call that drops one node's saved tensors, so the forward saves through
``saved_tensors_hooks`` that put each tensor in a :class:`_Box`. After I, every node W will run has its
saved tensors read once through the unpack hook (``_saved_*`` attributes; ``saved_tensors`` of a custom
Function), which marks their boxes; every other box is emptied and its tensor freed with its last
reference. A W that touched an emptied box would fail with one line, never read a wrong tensor.

Not for graphs with layer-level recomputation (``torch.utils.checkpoint``): its own hooks pack those
tensors, and reading them would re-run the region.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.autograd.graph import Node

from .split_backward import DeferredWeightGrad


class _Box:
    """One saved tensor, droppable."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t: torch.Tensor | None = t


_MARKING: list[set[int] | None] = [None]  # ids of the boxes read while :func:`release_unread` marks
_NAMES: dict[type, tuple[str, ...]] = {}  # node type -> its saved-tensor attributes


def _unpack(box: _Box) -> torch.Tensor:
    marking = _MARKING[0]
    if marking is not None:
        marking.add(id(box))
    if box.t is None:
        raise RuntimeError("a split backward's W read an activation its I released (saved_release)")
    return box.t


class BoxedSaves:
    """Saved-tensor hooks that box what autograd saves and count the bytes of the activations among it
    (each storage once, the ``exclude`` storages, weights and gradient buffers, left out), like
    :class:`~.accounting.SavedBytes`."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.boxes: list[_Box] = []
        self.bytes = 0
        self._seen: set[int] = set()

    def _pack(self, t: torch.Tensor) -> _Box:
        key = t.untyped_storage().data_ptr()
        if key not in self.exclude and key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        box = _Box(t)
        self.boxes.append(box)
        return box

    @contextlib.contextmanager
    def measure(self) -> Iterator[BoxedSaves]:
        """Box what autograd saves inside; ``boxes`` and ``bytes`` are this block's."""
        self.boxes, self.bytes, self._seen = [], 0, set()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self


def _saved_names(node: Node) -> tuple[str, ...]:
    names = _NAMES.get(type(node))
    if names is None:
        names = _NAMES[type(node)] = tuple(
            n for n in dir(node) if n.startswith("_saved_") or n == "saved_tensors")
    return names


def release_unread(boxes: list[_Box], deferred: DeferredWeightGrad, exclude: set[int]) -> int:
    """Empty the boxes no node of ``deferred``'s W reads; returns the activation bytes still held in boxes
    (each storage once, ``exclude`` left out)."""
    marked: set[int] = set()
    _MARKING[0] = marked
    try:
        for g in deferred.groups:
            for node in (*g.nodes, *g.side):
                for name in _saved_names(node):
                    getattr(node, name)
    finally:
        _MARKING[0] = None
    held: set[int] = set()
    total = 0
    for box in boxes:
        t = box.t
        if t is None:
            continue
        if id(box) not in marked:
            box.t = None
            continue
        key = t.untyped_storage().data_ptr()
        if key not in exclude and key not in held:
            held.add(key)
            total += t.untyped_storage().nbytes()
    return total
