"""The torch_dist folder's names: DCP's index, the rank-independent state, each rank's RNG, and the
stale temporaries a killed save leaves.
"""

from __future__ import annotations

import os
import re
import shutil

from .. import manifest

FORMAT = "torch_dist"
METADATA = ".metadata"
COMMON = "common"
DATA_RE = re.compile(r"__(\d+)_\d+\.distcp")


def is_dist_checkpoint(iter_dir: str) -> bool:
    """Whether ``iter_dir`` holds a torch_dist checkpoint (DCP's ``.metadata``)."""
    return os.path.isfile(os.path.join(iter_dir, METADATA))


def rng_key(rank: int) -> str:
    return f"rng/{rank}"


def clean_stale_temporaries(save_dir: str, pid_alive=None) -> list[str]:
    """Remove ``iter_N.tmp.PID`` folders (and ``iter_N.old.tmp.PID``) a killed torch_dist save left."""
    alive = pid_alive or manifest._pid_alive
    if not os.path.isdir(save_dir):
        return []
    removed = []
    for name in sorted(os.listdir(save_dir)):
        m = re.fullmatch(r"iter_\d+(?:\.old)?\.tmp\.(\d+)", name)
        path = os.path.join(save_dir, name)
        if m and os.path.isdir(path) and not alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
