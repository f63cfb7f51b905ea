"""The checkpoint formats under their ``--ckpt-format`` names: one small protocol the trainer and the
launcher ask, instead of an ``if`` on the format at every call site.

A format answers five questions: is this iteration folder mine (``detect``), what does this rank read
before any process group exists (``read_before_init``), does it fit the run (``check_compatible``), how
does it go into the live stage (``restore``) and how is it written (``save``). Adding a format is its own
module (``<name>_format.py``, found by its name) plus its name in ``config.CKPT_FORMATS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..config import CKPT_FORMATS
from ..errors import ConfigError
from .layout import iteration_dir


@dataclass
class SaveRequest:
    """What a save may need; each format takes its part (the torch format a payload per rank, torch_dist the
    rank-independent ``common`` state and the optional background writer)."""

    root: str
    iteration: int
    stage: Any
    state: Any
    tracker: Any
    payload: Callable[[], dict]
    common: Callable[[], dict]
    async_writer: Any = None


class CheckpointFormat(Protocol):
    name: str

    def detect(self, iter_dir: str) -> bool: ...
    def read_before_init(self, load: str, iteration: int, rank: int, cfg) -> dict: ...
    def check_compatible(self, sd: dict, cfg, weights_only: bool) -> None: ...
    def restore(self, sd: dict, stage, tracker, device, **options) -> None: ...
    def save(self, req: SaveRequest) -> str: ...


def get_format(name: str) -> CheckpointFormat:
    """The format ``--ckpt-format NAME`` names: the ``FORMAT`` of this package's module ``<name>_format``
    (``torch_format.py``, ``torch_dist_format.py``), loaded on first use, so a new format is its module and
    its name in :data:`~megatron_2bw.config.CKPT_FORMATS`."""
    if name not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, got {name!r}")
    return importlib.import_module(f"{__package__}.{name}_format").FORMAT


def detect(load: str, iteration: int) -> CheckpointFormat:
    """The format of the checkpoint at ``load``'s ``iteration``: the first whose marker is there, Megatron's
    plain layout (``torch``) when none is."""
    idir = iteration_dir(load, iteration)
    named = [get_format(n) for n in CKPT_FORMATS if n != "torch"]
    return next((f for f in named if f.detect(idir)), get_format("torch"))


def of_file(sd: dict) -> CheckpointFormat:
    """The format a read checkpoint came from (its ``format`` field: a name, or the torch format's number)."""
    name = sd.get("format")
    return get_format(name if name in CKPT_FORMATS else "torch")
