"""The checkpoint formats under their ``--ckpt-format`` names: one small protocol the trainer and the
launcher ask (``format_protocol.py``), instead of an ``if`` on the format at every call site.

Adding a format is its own module (``<name>_format.py``, whose ``FORMAT`` implements the protocol), its row
in :data:`MODULES` and its name in ``config.CKPT_FORMATS``.
"""

from __future__ import annotations

import importlib

from ..config import CKPT_FORMATS
from ..errors import ConfigError
from .format_protocol import CheckpointFormat, SaveRequest
from .layout import iteration_dir

__all__ = ["MODULES", "CheckpointFormat", "SaveRequest", "detect", "get_format", "of_file"]

# --ckpt-format NAME -> the module of this package whose FORMAT implements it, a literal table the layering
# test reads; each loads on first use
MODULES = {"torch": "torch_format", "torch_dist": "torch_dist_format"}


def get_format(name: str) -> CheckpointFormat:
    """The format ``--ckpt-format NAME`` names: the ``FORMAT`` of its module in :data:`MODULES`
    (``torch_format.py``, ``torch_dist_format.py``), loaded on first use."""
    if name not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, got {name!r}")
    return importlib.import_module(f"{__package__}.{MODULES[name]}").FORMAT


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
