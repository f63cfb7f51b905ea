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
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

from ..config import CKPT_FORMATS, ModelConfig  # noqa: F401 - CKPT_FORMATS re-exported
from ..errors import ConfigError
from ..export.names import WORD
from ..export.reshard import is_vocab, split_dim
from ..pipeline.recompute import RNGSnapshot
from ..pipeline.zero import ShardLayout
from ..testing import faults
from . import manifest
from .supervision import os_error_line

log = logging.getLogger("megatron_2bw")

FORMAT = "torch_dist"
METADATA = ".metadata"
COMMON = "common"
MODEL, OLDER, MASTER = "model", "older", "master"
EF_PREV = "optimizer.ef_prev_grad"  # --2bw-compensation ef's previous gradient (pipeline/compensation.py)
_DATA_RE = re.compile(r"__(\d+)_\d+\.distcp")


def is_dist_checkpoint(iter_dir: str) -> bool:
    """Whether ``iter_dir`` holds a torch_dist checkpoint (DCP's ``.metadata``)."""
    return os.path.isfile(os.path.join(iter_dir, METADATA))


def _rng_key(rank: int) -> str:
    return f"rng/{rank}"


# --------------------------------------------------------------------------- where a rank's elements sit
@dataclass(frozen=True)
class _Param:
    """One parameter of a stage: where it sits in the flat buffers and in the global tensor."""

    name: str  # global name
    offset: int  # in the stage's flat buffer
    shape: tuple[int, ...]  # local, as 1-D (n,) or 2-D (rows, cols)
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]  # of the local tensor's first element
    rows: int  # local rows (elements of a 1-D tensor) inside the global tensor (vocabulary padding cut)
    writes: bool  # this rank writes it (replicated over the tensor group: rank 0; tied copy: the first stage)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def stage_params(weights, cfg: ModelConfig, t: int, tp: int, pp: int) -> list[_Param]:
    """The stage's parameters in flat-buffer order with their global placement."""
    out = []
    for name, off, shape in zip(weights.global_names, weights.offsets, weights.shapes):
        shape = tuple(shape)
        if len(shape) > 2:
            shape = (shape[0], int(torch.Size(shape[1:]).numel()))
        dim = split_dim(cfg, name)
        if dim is not None and dim >= len(shape):
            raise ValueError(f"parameter {name} of shape {shape} is split along dimension {dim}")
        g, o = list(shape), [0] * len(shape)
        if dim is not None and t > 1:
            g[dim], o[dim] = shape[dim] * t, shape[dim] * tp
        rows = shape[0]
        if is_vocab(cfg, name):  # the t = 1 model's padded rows
            g[0] = cfg.padded_vocab_size(1)
            rows = max(0, min(shape[0], g[0] - o[0]))
        writes = (dim is not None or tp == 0) and (name != WORD or pp == 0)
        out.append(_Param(name, off, shape, tuple(g), tuple(o), rows, writes))
    return out


def _rects(p: _Param, a: int, b: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Rectangles covering local elements ``[a, b)`` of ``p`` (inside the global tensor):
    (first local element, sizes, global offsets)."""
    if len(p.shape) == 1:
        b = min(b, p.rows)
        return [(a, (b - a,), (p.global_offset[0] + a,))] if a < b else []
    cols = p.shape[1]
    (ra, ca), (rb, cb) = divmod(a, cols), divmod(b, cols)
    boxes = []  # (row, col, rows, cols)
    if ra == rb:
        boxes.append((ra, ca, 1, cb - ca))
    else:
        full = ra
        if ca:
            boxes.append((ra, ca, 1, cols - ca))
            full += 1
        if rb > full:
            boxes.append((full, 0, rb - full, cols))
        if cb:
            boxes.append((rb, 0, 1, cb))
    out = []
    for r, c, nr, nc in boxes:
        nr = min(nr, p.rows - r)
        if nr > 0 and nc > 0:
            out.append((r * cols + c, (nr, nc), (p.global_offset[0] + r, p.global_offset[1] + c)))
    return out


@dataclass
class _Chunk:
    fqn: str
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    tensor: torch.Tensor  # a view of the live buffer (or of a host staging buffer)


def _chunks(family: str, buf: torch.Tensor, base: int, lo: int, hi: int, params: list[_Param],
            writing: bool) -> list[_Chunk]:
    """The chunks of flat range ``[lo, hi)`` of a buffer whose element 0 is flat index ``base``."""
    out = []
    for p in params:
        if writing and not p.writes:
            continue
        a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
        if a >= b:
            continue
        for start, sizes, goff in _rects(p, a - p.offset, b - p.offset):
            n = 1
            for s in sizes:
                n *= s
            first = p.offset + start - base
            out.append(_Chunk(f"{family}/{p.name}", goff, p.global_shape, buf[first:first + n].view(sizes)))
    return out


def _families(stage) -> list[tuple[str, torch.Tensor, bool]]:
    """(family, buffer, sharded) of every per-parameter buffer: the two versions, master, optimizer."""
    w, u = stage.weights, stage.updater
    out = [(MODEL, w.flat[w.slot(stage.step)], False)]
    if w.num_versions > 1:
        out.append((OLDER, w.flat[w.slot(stage.step + 1)], False))
    sharded = u.shard is not None
    size = u.shard.size if sharded else w.numel
    if u.master is not None:
        out.append((MASTER, u.master, sharded))
    for k, v in u.optimizer.state_dict().items():
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == size:
            out.append((f"optimizer.{k}", v, sharded))
    if u.ef_prev is not None:  # --2bw-compensation ef: the previous gradient, sharded as the optimizer state
        out.append((EF_PREV, u.ef_prev, sharded))
    return out


def _range(stage, sharded: bool) -> tuple[int, int, int]:
    """(base, lo, hi): a buffer's first flat index and the range this rank writes."""
    st, u, n = stage.state, stage.updater, stage.weights.numel
    if sharded:
        return u.shard.lo, u.shard.lo, u.shard.hi
    lo, hi = ShardLayout(n, st.w, st.dp_rank).bounds(st.dp_rank)
    return 0, lo, hi


def save_chunks(stage, cfg: ModelConfig) -> list[_Chunk]:
    """What this rank writes: views of its live buffers (no copy)."""
    st = stage.state
    params = stage_params(stage.weights, cfg, st.t, st.tp_rank, st.pp_rank)
    out = []
    for family, buf, sharded in _families(stage):
        base, lo, hi = _range(stage, sharded)
        out += _chunks(family, buf, base, lo, hi, params, writing=True)
    return out


# --------------------------------------------------------------------------- DCP planners
def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous CPU view) as a tensor whose storage is exactly its bytes, sharing them.

    DCP's writer clones a tensor whose storage is larger than itself (so that ``torch.save`` does
    not write the whole storage) and keeps every written tensor of a file until the file is done:
    views of the flat buffers would cost a full copy of what the rank writes. A storage over the
    view's own bytes costs nothing. (Device tensors are copied to the host by DCP, one at a time.)"""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes == 0 or t.untyped_storage().nbytes() == nbytes:
        return t
    raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return torch.frombuffer(raw, dtype=t.dtype, count=t.numel()).view(t.shape)


def _write_item(c: _Chunk) -> WriteItem:
    t = c.tensor
    return WriteItem(index=MetadataIndex(c.fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(c.offsets), t.size()),
                                                 properties=TensorProperties.create_from_tensor(t),
                                                 size=torch.Size(c.global_shape)))


class _SavePlanner(DefaultSavePlanner):
    """Writes given chunks under their global names and offsets, and given objects."""

    def __init__(self, chunks: list[_Chunk], objects: dict) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.fqn, tuple(c.offsets)): c for c in chunks}
        self._objects = objects

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self._objects]
        items += [_write_item(c) for c in self._chunks.values()]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.offset is None:
            return self._objects[index.fqn]
        return _own_storage(self._chunks[(index.fqn, tuple(index.offset))].tensor)


class _LoadPlanner(DefaultLoadPlanner):
    """Reads given chunks (into given views) and objects, checking names and global shapes first."""

    def __init__(self, chunks: list[_Chunk], objects: list[str], where: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._dest = {(c.fqn, tuple(c.offsets)): c for c in chunks}
        self._wanted = objects
        self.objects: dict = {}
        self._where = where

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md, items = self.metadata.state_dict_metadata, []
        for key in self._wanted:
            if not isinstance(md.get(key), BytesStorageMetadata):
                raise ConfigError(f"checkpoint {self._where} lacks {key} (not a megatron_2bw torch_dist checkpoint?)")
            items += _create_read_items(key, md[key], None)
        for (fqn, offsets), c in self._dest.items():
            saved = md.get(fqn)
            if not isinstance(saved, TensorStorageMetadata):
                raise ConfigError(f"checkpoint {self._where} lacks {fqn} (another model or state?)")
            if tuple(saved.size) != tuple(c.global_shape):
                raise ConfigError(f"checkpoint {self._where} has {fqn} of shape {tuple(saved.size)} but this run "
                                  f"needs {tuple(c.global_shape)} (another model?)")
            items += create_read_items_for_chunk_list(
                fqn, saved, [ChunkStorageMetadata(torch.Size(offsets), c.tensor.size())])
        self.plan = LoadPlan(items)
        return self.plan

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        c = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return narrow_tensor_by_index(c.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # read into the live buffer's view itself


# --------------------------------------------------------------------------- writing
_GROUP: list = []  # the gloo group of checkpoint collectives (made on first use, by every rank at once)


def _group():
    """A gloo group over every rank for DCP's collectives (``None`` without a process group): CPU
    objects on any backend, and an asynchronous write's own communicator beside training's."""
    if not dist.is_initialized():
        return None
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    for line in text.splitlines():  # DCP's CheckpointException lists each rank's traceback: the error itself
        m = re.match(r"\s*(?:torch\.distributed\.checkpoint\.\S+\.)?(\w+(?:Error|Exception)): (.+)", line)
        if m and m.group(1) != "CheckpointException":
            return f"{m.group(1)}: {m.group(2)}"
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _config_error(e: BaseException) -> ConfigError:
    """A one-line error from a failure inside DCP (whose exception carries every rank's traceback)."""
    cause = e
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) else cause
    if isinstance(cause, ConfigError):
        return cause
    if isinstance(cause, OSError):
        return ConfigError(os_error_line(cause))
    return ConfigError(_first_line(cause))


def _publish(root: str, iteration: int, tmp: str, entries: dict) -> str:
    """Rank 0: the manifest into ``tmp``, ``tmp`` renamed to ``iter_N``, then the pointer file."""
    from .checkpointing import iteration_dir, write_tracker  # noqa: PLC0415 - checkpointing imports this module lazily

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


def write_and_publish(root: str, iteration: int, chunks: list[_Chunk], objects: dict, group) -> str:
    """Every rank: write its chunks with DCP into a temporary folder, checksum its files; rank 0 publishes.

    Collective over ``group``; a failure on any rank is a one-line :class:`ConfigError` on every rank
    and nothing is published (the temporary folder is removed at once or by the next start-up).
    """
    rank = _rank()
    pid = [os.getpid()]
    if group is not None:
        dist.broadcast_object_list(pid, src=0, group=group)
    tmp = os.path.join(root, f"iter_{iteration:07d}.tmp.{pid[0]}")
    error = None
    try:
        os.makedirs(tmp, exist_ok=True)
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process" without a group
            dcp.save({}, storage_writer=writer, planner=_SavePlanner(chunks, objects), process_group=group,
                     no_dist=group is None)
        mine = [n for n in os.listdir(tmp) if (m := _DATA_RE.fullmatch(n)) and int(m.group(1)) == rank]
        if rank == 0:
            mine.append(METADATA)
        ident = {"iteration": int(iteration), "rank": rank, "format": FORMAT}
        entries = dict(manifest.manifest_entry(tmp, os.path.join(tmp, n), ident) for n in sorted(mine))
        faults.before_publish(iteration)
    except OSError as e:
        error, entries = ConfigError(os_error_line(e, tmp, "writing")), None
    except Exception as e:  # noqa: BLE001 - DCP's CheckpointException carries each rank's failure
        error, entries = _config_error(e), None
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
    from .checkpointing import iteration_dir  # noqa: PLC0415

    return iteration_dir(root, iteration)


def common_state(stage, *, iteration: int, config: dict, args, consumed_samples: int, global_batch: int) -> dict:
    """The rank-independent state (the same on every rank): written once, by rank 0."""
    st, u = stage.state, stage.updater
    split = config.get("pipeline", {}).get("layer_split")
    return {
        "format": FORMAT, "iteration": int(iteration), "step": int(stage.step), "schedule": stage.pipe.schedule,
        "layout": {"t": st.t, "d": st.d, "w": st.w, "schedule": stage.pipe.schedule,
                   "split": list(split) if split else None, "distributed_optimizer": u.shard is not None,
                   "chunks": stage.chunks},  # model chunks per rank (interleaved); the tensors are global either way
        "config": config, "args": args,
        "data": {"consumed_train_samples": int(consumed_samples), "global_batch_size": int(global_batch)},
        "scaler": u.scaler.state_dict(),
        "optimizer": {k: v for k, v in u.optimizer.state_dict().items() if not isinstance(v, torch.Tensor)},
        "ef_has_prev": bool(u.ef_prev is not None and u.ef_has_prev),
        "time": time.time(),
    }


def megatron_namespace(stage, cfg, cli_args: dict, iteration: int):
    """Megatron's ``args`` as the torch format records them (what ``--override-resumed-settings`` compares)."""
    from ..export import trainer_format  # noqa: PLC0415

    st, split = stage.state, cfg.pipeline.layer_split
    return trainer_format.train_args(cfg.model, cli_args, iteration=iteration, t=st.t, d=st.d,
                                     schedule=stage.pipe.schedule, dtype=cfg.optimizer.dtype,
                                     split=list(split) if split else None, chunks=stage.chunks)


def _objects(stage, tracker, common: dict) -> dict:
    out = {_rng_key(_rank()): RNGSnapshot.capture(stage.state.device, tracker, host_libraries=True).as_dict()}
    if _rank() == 0:
        out[COMMON] = common
    return out


@dataclass
class _Staging:
    """Host buffers (pinned on CUDA) the chunks are copied into for an asynchronous save, kept between saves."""

    buffers: dict = field(default_factory=dict)  # dtype -> flat host tensor

    def stage(self, chunks: list[_Chunk]) -> list[_Chunk]:
        need: dict = {}
        for c in chunks:
            need[c.tensor.dtype] = need.get(c.tensor.dtype, 0) + c.tensor.numel()
        cuda = any(c.tensor.is_cuda for c in chunks)
        for dtype, n in need.items():
            if dtype not in self.buffers or self.buffers[dtype].numel() != n:
                self.buffers[dtype] = torch.empty(n, dtype=dtype, pin_memory=cuda)
        used = dict.fromkeys(need, 0)
        out = []
        for c in chunks:
            n, buf = c.tensor.numel(), self.buffers[c.tensor.dtype]
            o = used[c.tensor.dtype]
            host = buf[o:o + n].view(c.tensor.shape)
            host.copy_(c.tensor, non_blocking=cuda)
            used[c.tensor.dtype] = o + n
            out.append(_Chunk(c.fqn, c.offsets, c.global_shape, host))
        if cuda:
            torch.cuda.synchronize()
        return out


class AsyncWriter:
    """``--async-save``: one checkpoint write at a time in a thread; its failure stops the run at the next check."""

    def __init__(self) -> None:
        self.staging = _Staging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending: tuple[int, float] | None = None  # (iteration, start time) of the write in flight
        self.done: list[tuple[int, str, float]] = []  # (iteration, path, seconds) published since the last look

    def start(self, root: str, iteration: int, chunks: list[_Chunk], objects: dict, group) -> None:
        self.wait()
        staged = self.staging.stage(chunks)
        t0 = time.perf_counter()
        self.pending = (iteration, t0)

        def work() -> None:
            try:
                path = write_and_publish(root, iteration, staged, objects, group)
                self.done.append((iteration, path, time.perf_counter() - t0))
            except BaseException as e:  # noqa: BLE001 - reported by check() in the training thread
                self._error = e

        self._thread = threading.Thread(target=work, name=f"async-save-{iteration}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise (one line) if the last write failed."""
        if self._error is not None:
            e, self._error = self._error, None
            it = self.pending[0] if self.pending else "?"
            line = str(e) if isinstance(e, ConfigError) else _first_line(e)
            raise ConfigError(f"asynchronous checkpoint save of iteration {it} failed: {line}")

    def wait(self) -> None:
        """Wait for the write in flight (before the next save and at exit), then :meth:`check`."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
        self.pending = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def save(root: str, iteration: int, stage, tracker, common: dict, writer: AsyncWriter | None = None) -> str:
    """Write this iteration's torch_dist checkpoint (every rank calls it, at a drained boundary).

    With ``writer`` (``--async-save``) the chunks are copied to host memory here and written in the
    background; the return value is the folder the checkpoint will be published as.
    """
    from .checkpointing import iteration_dir, model_config  # noqa: PLC0415

    stage.reducer.wait_all()  # no all-gather may still write the weight buffers
    chunks = save_chunks(stage, model_config(common["config"]))
    objects = _objects(stage, tracker, common)
    group = _group()
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(os_error_line(e, root, "creating")) from None
    if writer is not None:
        writer.start(root, iteration, chunks, objects, group)
        return iteration_dir(root, iteration)
    return write_and_publish(root, iteration, chunks, objects, group)


# --------------------------------------------------------------------------- reading (before init)
def read_checkpoint(load: str, iteration: int, rank: int, world: int, layout: tuple) -> dict:
    """The checkpoint's rank-independent state, after checking its files; no process group needed.

    Every file's presence and size is checked, and the CRC-32 of this rank's share of them
    (file i by rank i mod world), so the whole checkpoint is verified once per resume.
    ``layout``: this run's (t, d, w, split); the RNG states load only at the saved layout.
    """
    from .checkpointing import TRACKER, iteration_dir  # noqa: PLC0415

    idir = iteration_dir(load, iteration)
    if not os.path.isdir(idir):
        raise ConfigError(f"{os.path.join(load, TRACKER)} names iteration {iteration} but {idir} is missing")
    doc = manifest.verify(idir, checksums=False, require=True)
    files = sorted(doc["files"])
    manifest.verify(idir, only=files[rank::world], checksums=True)
    reader = dcp.FileSystemReader(idir)
    try:
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001 - an unreadable index is a corrupt checkpoint
        raise ConfigError(f"checkpoint file {os.path.join(idir, METADATA)} is corrupt or unreadable "
                          f"({_first_line(e)})") from None
    keys = set(md.state_dict_metadata)
    wanted = [COMMON] + ([_rng_key(rank)] if _rng_key(rank) in keys else [])
    planner = _LoadPlanner([], wanted, idir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # no process group before init, by design
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint {idir} is unreadable ({_first_line(e)})") from None
    common = planner.objects[COMMON]
    if not isinstance(common, dict) or common.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {idir} is not a megatron_2bw {FORMAT} checkpoint")
    lay = common["layout"]
    same = (lay["t"], lay["d"], lay["w"], tuple(lay["split"] or ()) or None) == \
        (layout[0], layout[1], layout[2], tuple(layout[3] or ()) or None)
    return {"format": FORMAT, "path": idir, "iteration": common["iteration"], "common": common, "keys": keys,
            "stage": {"step": common["step"], "schedule": common["schedule"]}, "layout": lay,
            "config": common["config"], "args": common["args"], "data": common["data"],
            "rng": planner.objects.get(_rng_key(rank)) if same else None, "same_layout": same}


def check_compatible(sd: dict, model: dict, optimizer: dict, *, weights_only: bool = False) -> None:
    """Refuse a checkpoint of another model shape, optimizer or precision (layout and schedule may differ)."""
    from .checkpointing import _SHAPE_FIELDS  # noqa: PLC0415

    path, saved = sd["path"], sd["config"]
    for f in (f for f in _SHAPE_FIELDS if f in saved["model"]):
        if saved["model"][f] != model.get(f):
            raise ConfigError(f"checkpoint {path} has {f}={saved['model'][f]} but this run has {f}={model.get(f)}")
    if weights_only:
        return
    for f in ("optimizer", "dtype"):
        a, b = saved["optimizer"][f], optimizer[f]
        if a != b:
            raise ConfigError(f"checkpoint {path} has {f} {a} but this run uses {b} (--no-load-optim loads "
                              "the weights only)")
    if optimizer["optimizer"] == "sgd" and (saved["optimizer"]["sgd_momentum"] == 0) != (optimizer["sgd_momentum"] == 0):
        raise ConfigError(f"checkpoint {path} and this run disagree on whether SGD uses momentum")


# --------------------------------------------------------------------------- restoring (collective)
def _zero_cut_rows(buf: torch.Tensor, base: int, lo: int, hi: int, params: list[_Param]) -> None:
    """Zero the vocabulary rows beyond the t = 1 model's padding (what the checkpoint does not hold)."""
    for p in params:
        if p.rows >= p.shape[0]:
            continue
        per_row = p.numel // p.shape[0]
        a, b = max(lo, p.offset + p.rows * per_row), min(hi, p.offset + p.numel)
        if a < b:
            buf[a - base:b - base].zero_()


def restore(sd: dict, stage, tracker, device: torch.device, *, load_optim: bool = True, load_rng: bool = True,
            finetune: bool = False) -> None:
    """Load a torch_dist checkpoint read by :func:`read_checkpoint` into the live buffers (collective).

    Each rank reads its own elements: the whole tensor-parallel shard of its stage's weights and,
    with the distributed optimizer, its shard of the fp32 master and optimizer state. Options as
    :func:`checkpointing.restore`.
    """
    from .checkpointing import model_config  # noqa: PLC0415

    common, keys = sd["common"], sd["keys"]
    w, u, st = stage.weights, stage.updater, stage.state
    stage.reducer.wait_all()
    stage.step = 0 if finetune else int(common["step"])
    params = stage_params(w, model_config(sd["config"]), st.t, st.tp_rank, st.pp_rank)
    with_optim = load_optim and not finetune
    chunks, read = [], set()
    for family, buf, sharded in _families(stage):
        if family != MODEL and (family == OLDER and (finetune or f"{OLDER}/{params[0].name}" not in keys)
                                or family != OLDER and (not with_optim or f"{family}/{params[0].name}" not in keys)):
            continue
        base, lo, hi = (u.shard.lo, u.shard.lo, u.shard.hi) if sharded else (0, 0, w.numel)
        _zero_cut_rows(buf, base, lo, hi, params)
        chunks += _chunks(family, buf, base, lo, hi, params, writing=False)
        read.add(family)
    try:
        dcp.load({}, storage_reader=dcp.FileSystemReader(sd["path"]), planner=_LoadPlanner(chunks, [], sd["path"]),
                 process_group=_group(), no_dist=not dist.is_initialized())
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every rank sees every rank's failure
        raise ConfigError(f"checkpoint {sd['path']} could not be loaded: {_config_error(e)}") from None
    newest = w.slot(stage.step)
    if w.num_versions > 1 and OLDER not in read:  # a flush checkpoint (or --finetune): both versions equal
        w.flat[w.slot(stage.step + 1)].copy_(w.flat[newest])
    if with_optim:
        live = u.optimizer.state_dict()
        u.optimizer.load_state_dict({**live, **common["optimizer"]})
        u.scaler.load_state_dict(common["scaler"])
    if u.ef_prev is not None:  # a checkpoint without ef's gradient (another compensation's) starts ef afresh
        u.ef_has_prev = with_optim and EF_PREV in read and bool(common.get("ef_has_prev", False))
    if u.master is not None and MASTER not in read:
        u.master_from(newest)
    if load_rng and not finetune:
        if sd.get("rng") is not None:
            RNGSnapshot.from_dict(sd["rng"]).restore(device, tracker)
        elif st.rank == 0:
            lay = sd["layout"]
            log.info(" resuming %s (t=%d d=%d w=%d) at another layout: RNG states start from this run's seeds, "
                     "so the resume is not bitwise", sd["path"], lay["t"], lay["d"], lay["w"])


# --------------------------------------------------------------------------- start-up
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


# --------------------------------------------------------------------------- whole checkpoints (tools)
def read_whole(iter_dir: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(common state, family -> global name -> full tensor) of a torch_dist checkpoint, in one process
    (``tools/checkpoint_util.py``), after checking it against its manifest."""
    manifest.verify(iter_dir, require=True)
    reader = dcp.FileSystemReader(iter_dir)
    try:
        md = reader.read_metadata()
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint file {os.path.join(iter_dir, METADATA)} is corrupt or unreadable "
                          f"({_first_line(e)})") from None
    chunks, families = [], {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            family, name = fqn.split("/", 1)
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            families.setdefault(family, {})[name] = t
            chunks.append(_Chunk(fqn, (0,) * len(m.size), tuple(m.size), t))
    planner = _LoadPlanner(chunks, [COMMON], iter_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    return planner.objects[COMMON], families


def write_whole(root: str, iteration: int, common: dict, families: dict[str, dict[str, torch.Tensor]]) -> str:
    """Write full tensors (family -> global name -> tensor) and ``common`` as a torch_dist checkpoint
    from one process, published like a training save; returns the iteration folder."""
    chunks = [_Chunk(f"{family}/{name}", (0,) * t.dim(), tuple(t.shape), t)
              for family, named in families.items() for name, t in named.items()]
    os.makedirs(root, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return write_and_publish(root, iteration, chunks, {COMMON: common}, None)
