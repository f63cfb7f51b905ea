"""``--async-save`` on CUDA, checked on the CPU with the CUDA calls replaced (gpu-review-2 N4, N5).

N4: threads start on device 0, and DCP's writer touches the current CUDA stream, so the writer thread must
take the saving rank's device before DCP runs. N5: the staging buffers are page-locked at exactly the bytes
staged (``cudaHostRegister``), not through torch's caching host allocator, which rounds each block up to a
power of two.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_2bw.checkpoint.dist_checkpoint import async_writer as aw
from megatron_2bw.checkpoint.dist_checkpoint.shard_map import Chunk

pytestmark = pytest.mark.torch_floor


def test_writer_thread_takes_the_ranks_device_before_dcp_runs(monkeypatch, tmp_path) -> None:
    calls: list[tuple[str, str, object]] = []  # (what, thread, argument)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append(("set_device", threading.current_thread().name, d)))

    def write(root, iteration, staged, objects, group) -> str:
        calls.append(("write", threading.current_thread().name, iteration))
        return str(root)

    monkeypatch.setattr(aw, "write_and_publish", write)
    writer = aw.AsyncWriter()
    writer.start(str(tmp_path), 7, [Chunk("w", (0,), (4,), torch.arange(4.0))], {}, None)
    writer.wait()
    assert calls == [("set_device", "async-save-7", 3), ("write", "async-save-7", 7)]


class _CudaRt:
    """Records page-locking: ptr -> bytes."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}
        self.registrations = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert ptr not in self.locked
        self.locked[ptr] = size
        self.registrations += 1
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.locked[ptr]
        return 0


def test_staging_pins_exactly_the_bytes_staged_and_reuses_them(monkeypatch) -> None:
    rt = _CudaRt()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    st = aw._Staging()
    a = st._buffer(torch.float32, 3000, cuda=True)  # 12000 bytes: the caching allocator would pin 16384
    b = st._buffer(torch.bfloat16, 5, cuda=True)
    assert sorted(rt.locked.values()) == [10, 12000] and st.pinned_bytes() == 12010
    assert st._buffer(torch.float32, 3000, cuda=True) is a and rt.registrations == 2  # kept between saves
    c = st._buffer(torch.float32, 1000, cuda=True)  # the stage's bytes changed: the old buffer is released
    assert c is not a and sorted(rt.locked.values()) == [10, 4000] and st.pinned_bytes() == 4010
    assert st._buffer(torch.bfloat16, 5, cuda=False) is not b and sorted(rt.locked.values()) == [4000]


def test_staging_copies_every_chunk_into_its_dtypes_buffer() -> None:
    st = aw._Staging()
    chunks = [Chunk("a", (0, 0), (2, 3), torch.arange(6.0).view(2, 3)),
              Chunk("b", (0,), (4,), torch.arange(4, dtype=torch.bfloat16)),
              Chunk("c", (2,), (5,), torch.tensor([7.0, 8.0, 9.0]))]
    out = st.stage(chunks)
    assert [(o.fqn, o.offsets, o.global_shape) for o in out] == [(c.fqn, c.offsets, c.global_shape) for c in chunks]
    for o, c in zip(out, chunks):
        assert torch.equal(o.tensor, c.tensor) and o.tensor.data_ptr() != c.tensor.data_ptr()
    assert st.buffers[torch.float32].numel() == 9 and st.pinned_bytes() == 0  # CPU: nothing page-locked
