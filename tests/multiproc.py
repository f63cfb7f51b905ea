"""The one helper multi-process tests use (it lives in the package so benchmarks and the profiler share it).

Tests fork their workers from a server that has imported torch and the package once (``forkserver``):
the same fresh processes as ``spawn`` gives, without paying 1-3 s of imports per worker per test.
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_2bw import local_workers
from megatron_2bw.local_workers import free_port  # noqa: F401

PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "megatron_2bw.training.loop",
           "megatron_2bw.pipeline.build", "megatron_2bw.checkpoint.dist_checkpoint.writer",
           "megatron_2bw.checkpoint.dist_checkpoint.reshard", "megatron_2bw.models.spec",
           # the trainer's entry (tests/inproc.py forks whole ranks of pretrain_*.py from this server too)
           "megatron_2bw.training.launch", "megatron_2bw.training.session", "megatron_2bw.data", "megatron_2bw.cli")


def run_workers(fn: Callable, world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`megatron_2bw.local_workers.run_workers` on workers forked from the preloaded server."""
    kwargs.setdefault("start_method", "forkserver")
    kwargs.setdefault("preload", PRELOAD)
    return local_workers.run_workers(fn, world, *args, **kwargs)
