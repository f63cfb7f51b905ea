"""Writing a torch_dist checkpoint: every rank writes its chunks into a temporary folder, checksums
its files, and rank 0 publishes the manifest, the folder and then the pointer (atomic: a crash
leaves the previous checkpoint the newest).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ... import faults
from ...errors import ConfigError, os_error_line
from ...tensor_parallel.recompute import RNGSnapshot
from .. import manifest, trainer_format
from ..compat import stage_model
from ..layout import iteration_dir
from ..manifest import write_tracker
from .collective import checkpoint_group, global_rank, write_error
from .files import COMMON, DATA_RE, FORMAT, METADATA, rng_key
from .planners import SavePlanner
from .router_state import save_router_chunks
from .shard_map import Chunk, save_chunks


class BackgroundWriter(Protocol):
    """What :func:`save` hands an asynchronous save to (``async_writer.AsyncWriter``, which imports this module)."""

    def start(self, root: str, iteration: int, chunks: list[Chunk], objects: dict, group) -> None: ...


def _publish(root: str, iteration: int, tmp: str, entries: dict) -> str:
    """Rank 0: the manifest into ``tmp``, ``tmp`` renamed to ``iter_N``, then the pointer file."""

    final = iteration_dir(root, iteration)
    manifest.write_manifest(tmp, iteration, entries)
    old = None
    if os.path.exists(final):  # the same iteration saved again (a resumed run): replace it whole
        old = f"{final}.old.tmp.{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    manifest.fsync_dir(root)
    write_tracker(root, iteration)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_and_publish(root: str, iteration: int, chunks: list[Chunk], objects: dict, group) -> str:
    """Every rank: write its chunks with DCP into a temporary folder, checksum its files; rank 0 publishes.

    Collective over ``group``; a failure on any rank is a one-line :class:`ConfigError` on every rank
    and nothing is published (the temporary folder is removed at once or by the next start-up).
    """
    rank = global_rank()
    pid = [os.getpid()]
    if group is not None:
        dist.broadcast_object_list(pid, src=0, group=group)
    tmp = f"{iteration_dir(root, iteration)}.tmp.{pid[0]}"
    error = None
    try:
        os.makedirs(tmp, exist_ok=True)
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process" without a group
            dcp.save({}, storage_writer=writer, planner=SavePlanner(chunks, objects), process_group=group,
                     no_dist=group is None)
        mine = [n for n in os.listdir(tmp) if (m := DATA_RE.fullmatch(n)) and int(m.group(1)) == rank]
        if rank == 0:
            mine.append(METADATA)
        ident = {"iteration": int(iteration), "rank": rank, "format": FORMAT}
        entries = dict(manifest.manifest_entry(tmp, os.path.join(tmp, n), ident) for n in sorted(mine))
        faults.before_publish(iteration)
    except OSError as e:
        error, entries = ConfigError(os_error_line(e, tmp, "writing")), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException) carries each rank's failure
        error, entries = write_error(e, tmp, rank), None
    gathered = [entries if error is None else str(error)]  # each rank's files, or its failure
    if group is not None:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, entries if error is None else str(error), group=group)
    status = [None]
    if rank == 0:
        bad = next((g for g in gathered if not isinstance(g, dict)), None)
        if bad is not None:
            status[0] = bad
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                _publish(root, iteration, tmp, {k: v for g in gathered for k, v in g.items()})
            except OSError as e:
                status[0] = os_error_line(e, tmp, "publishing")
    if group is not None:
        dist.broadcast_object_list(status, src=0, group=group)
    if error is not None:
        raise error
    if status[0] is not None:
        raise ConfigError(f"checkpoint save of iteration {iteration} failed: {status[0]}")

    return iteration_dir(root, iteration)


def common_state(stage, *, iteration: int, config: dict, args, consumed_samples: int, global_batch: int) -> dict:
    """The rank-independent state (the same on every rank): written once, by rank 0."""
    st, u = stage.state, stage.updater
    split = config.get("pipeline", {}).get("layer_split")
    return {
        "format": FORMAT, "iteration": int(iteration), "step": int(stage.step), "schedule": stage.pipe.schedule,
        "layout": {"t": st.t, "d": st.d, "w": st.replicas, "schedule": stage.pipe.schedule,
                   "split": list(split) if split else None, "distributed_optimizer": u.shard is not None,
                   "chunks": stage.chunks},  # model chunks per rank (interleaved); the tensors are global either way
        "config": config, "args": args,
        "data": {"consumed_train_samples": int(consumed_samples), "global_batch_size": int(global_batch)},
        "scaler": u.scaler.state_dict(),
        "optimizer": u.state_scalars(),  # the tensors are families (Updater.state_spans)
        "extrapolate_has_prev": bool(u.ef_prev is not None and u.ef_has_prev),  # read by earlier versions
        "time": time.time(),
    }


def megatron_namespace(stage, cfg, cli_args: dict, iteration: int):
    """Megatron's ``args`` as the torch format records them (what ``--override-resumed-settings`` compares)."""

    st, split = stage.state, cfg.pipeline.layer_split
    return trainer_format.train_args(cfg.model, cli_args, iteration=iteration, t=st.t, d=st.d,
                                     schedule=stage.pipe.schedule, dtype=cfg.optimizer.dtype,
                                     split=list(split) if split else None, chunks=stage.chunks)


def _objects(stage, tracker, common: dict) -> dict:
    out = {rng_key(global_rank()): RNGSnapshot.capture(stage.state.device, tracker, host_libraries=True).as_dict()}
    if global_rank() == 0:
        out[COMMON] = common
    return out


def save(root: str, iteration: int, stage, tracker, common: dict, writer: BackgroundWriter | None = None) -> str:
    """Write this iteration's torch_dist checkpoint (every rank calls it, at a drained boundary).

    With ``writer`` (``--async-save``) the chunks are copied to host memory here and written in the
    background; the return value is the folder the checkpoint will be published as.
    """

    stage.reducer.wait_all()  # no all-gather may still write the weight buffers
    chunks = save_chunks(stage, stage_model(common["config"])) + save_router_chunks(stage)
    objects = _objects(stage, tracker, common)
    group = checkpoint_group()
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(os_error_line(e, root, "creating")) from None
    if writer is not None:
        writer.start(root, iteration, chunks, objects, group)
        return iteration_dir(root, iteration)
    return write_and_publish(root, iteration, chunks, objects, group)


def write_whole(root: str, iteration: int, common: dict, families: dict[str, dict[str, torch.Tensor]]) -> str:
    """Write full tensors (family -> global name -> tensor) and ``common`` as a torch_dist checkpoint
    from one process, published like a training save; returns the iteration folder."""
    chunks = [Chunk(f"{family}/{name}", (0,) * t.dim(), tuple(t.shape), t)
              for family, named in families.items() for name, t in named.items()]
    os.makedirs(root, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return write_and_publish(root, iteration, chunks, {COMMON: common}, None)
