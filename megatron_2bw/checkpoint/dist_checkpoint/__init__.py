"""``--ckpt-format torch_dist``: the run's whole state written with torch.distributed.checkpoint (DCP).

Layout::

    SAVE/latest_checkpointed_iteration.txt      the newest complete checkpoint (as the torch format)
    SAVE/iter_0000100/.metadata                 DCP's index: every tensor's global shape and chunks
    SAVE/iter_0000100/__R_0.distcp              what rank R wrote (every rank writes, in parallel)
    SAVE/iter_0000100/manifest.json             size and CRC-32 of every file above

State as layout-independent global tensors. Every per-parameter tensor of the engine is stored
as the full single-stage (t = 1) model's tensor under ``FAMILY/GLOBAL_NAME``: ``model`` (the
newest weights W(step)), ``older`` (2BW's other version), ``master`` (the fp32 copy) and
``optimizer.KEY`` (Adam's moments, SGD's momentum), the vocabulary rows padded to a multiple of
128 as the t = 1 model holds them, which is what ``tools/checkpoint_util.py`` merges to, so the
two agree by construction. A rank offers DCP the chunks it owns: of each flat buffer, the range
its data-parallel rank holds (the distributed optimizer's shard; for replicated buffers the
same equal split, so replicas share the writing), cut per parameter into at most three
rectangles of the tensor-parallel shard, placed in the global tensor by the shard's offset.
Tensors replicated over the tensor group come from tensor rank 0, the tied word embedding from
the first stage. A resume at any t, d, w, stage split, schedule or with the distributed
optimizer on or off asks DCP for the rectangles it holds and DCP reads their overlap with what
was written (load-time resharding; no offline step). RNG states are per rank (objects): they
are restored at the same layout only, so a resharded resume is not bitwise (as the offline tool's).

Integrity: the ranks write into ``iter_N.tmp.PID``; after DCP's ``.metadata`` (written last by
DCP) every rank checksums its files, rank 0 writes the manifest, renames the folder to
``iter_N`` and then replaces the pointer file: a crash leaves the previous checkpoint the newest.
Before ``init_process_group`` every rank checks every file's size and the CRC-32 of its share of
the files, and reads the rank-independent state (``common``) without a process group.

``--async-save``: the chunks are copied into host buffers (pinned on CUDA, kept between saves)
at the drained boundary, and a writer thread writes and publishes them over a gloo group of its
own while training goes on; the next save and the exit wait for it, a failed write stops the
run with one line and publishes nothing.

Modules: ``files`` (the folder's names), ``shard_map`` (where a rank's elements sit in the global
tensors), ``planners`` (DCP planners over those chunks), ``collective`` (the checkpoint's gloo group,
one-line failures), ``writer`` and ``async_writer`` (saving), ``reader`` (checking and reading
before init), ``reshard`` (restoring at any layout).
"""

import importlib
from typing import Any

from ...config import CKPT_FORMATS
from .files import COMMON, FORMAT, METADATA, clean_stale_temporaries, is_dist_checkpoint
from .shard_map import EF_PREV, MASTER, MODEL, OLDER, save_chunks, stage_params

# torch.distributed.checkpoint takes about 0.9 s of every process's start-up to import (DTensor's operator
# tables): the modules that use it load on first use, so a run that neither saves nor loads this format
# never pays for it.
_LAZY = {
    "AsyncWriter": "async_writer", "check_compatible": "reader", "read_checkpoint": "reader", "read_whole": "reader",
    "restore": "reshard", "common_state": "writer", "megatron_namespace": "writer", "save": "writer",
    "write_and_publish": "writer", "write_whole": "writer",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "CKPT_FORMATS", "COMMON", "EF_PREV", "FORMAT", "MASTER", "METADATA", "MODEL", "OLDER", "AsyncWriter",
    "check_compatible", "clean_stale_temporaries", "common_state", "is_dist_checkpoint", "megatron_namespace",
    "read_checkpoint", "read_whole", "restore", "save", "save_chunks", "stage_params", "write_and_publish",
    "write_whole",
]
