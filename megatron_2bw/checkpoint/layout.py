"""Megatron's checkpoint directory layout, stated once: the pointer file, the iteration and rank folders,
the file name and the patterns that recognise them. Torch-free, so tools and the launcher read it before
anything heavy is imported::

    ROOT/latest_checkpointed_iteration.txt        the pointer, written last (the commit point)
    ROOT/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
"""

from __future__ import annotations

import os
import re

from ..errors import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
RANK_DIR_RE = re.compile(r"mp_rank_(\d+)(?:_(\d+))?")
ITER_DIR_RE = re.compile(r"iter_(\d+)")  # iteration_name writes 7 digits or more


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, iteration_name(iteration))


def rank_dir_name(tp: int, pp: int, d: int) -> str:
    """Megatron's name: ``mp_rank_TT`` without pipelining, ``mp_rank_TT_PPP`` with it."""
    return f"mp_rank_{tp:02d}" if d == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


def checkpoint_path(root: str, iteration: int, tp: int, pp: int, d: int) -> str:
    return os.path.join(iteration_dir(root, iteration), rank_dir_name(tp, pp, d), FILENAME)


def read_tracker(root: str) -> int | None:
    """The iteration the pointer file names, or None when ``root`` holds no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} does not hold an iteration number (not UTF-8 text: a corrupt or foreign file); "
                          "write the iteration to resume into it") from None
    if not re.fullmatch(r"\d+", text):
        raise ConfigError(f"{path} does not hold an iteration number (got {text[:40]!r})")
    return int(text)
