"""DCP planners that write and read given chunks (views of live or staged buffers) and objects,
with no state dict in between: no copy of the state is ever assembled.
"""

from __future__ import annotations

import ctypes
import io

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list

from ...errors import ConfigError
from .shard_map import Chunk, bounded


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


def _write_item(c: Chunk) -> WriteItem:
    t = c.tensor
    return WriteItem(index=MetadataIndex(c.fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(c.offsets), t.size()),
                                                 properties=TensorProperties.create_from_tensor(t),
                                                 size=torch.Size(c.global_shape)))


class SavePlanner(DefaultSavePlanner):
    """Writes given chunks under their global names and offsets (cut into items of at most
    ``shard_map.MAX_CHUNK_BYTES``, which bounds a resume's read buffer), and given objects."""

    def __init__(self, chunks: list[Chunk], objects: dict) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.fqn, tuple(c.offsets)): c for c in bounded(chunks)}
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


class LoadPlanner(DefaultLoadPlanner):
    """Reads given chunks (into given views) and objects, checking names and global shapes first."""

    def __init__(self, chunks: list[Chunk], objects: list[str], where: str) -> None:
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
