"""The protocol every checkpoint format implements, and what a save hands it.

A format answers five questions: is this iteration folder mine (``detect``), what does this rank read
before any process group exists (``read_before_init``), does it fit the run (``check_compatible``), how
does it go into the live stage (``restore``) and how is it written (``save``). Its own module, apart from
the registry (``formats.py``), so that the format modules import it and the registry imports them without
a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol


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
