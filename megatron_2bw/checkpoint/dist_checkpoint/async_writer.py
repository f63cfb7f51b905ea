"""``--async-save``: the chunks copied into host buffers (pinned on CUDA, kept between saves) at the
drained boundary, then written and published by a thread over the checkpoint's own gloo group
while training goes on; the next save and the exit wait for it, and its failure stops the run
with one line and publishes nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from .collective import first_line
from .shard_map import Chunk
from .writer import write_and_publish


def _pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf``'s exact bytes (``cudaHostRegister``). ``pin_memory=True`` would go through torch's
    caching host allocator, which rounds every block up to a power of two: up to twice the bytes the
    memory model counts, pinned for the whole run, on every rank of a node."""
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel() * buf.element_size()} bytes failed (error {int(err)})")


def _unpin(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


@dataclass
class _Staging:
    """Host buffers the chunks are copied into for an asynchronous save, one per dtype of exactly the bytes
    needed (page-locked on CUDA), kept between saves."""

    buffers: dict = field(default_factory=dict)  # dtype -> flat host tensor
    pinned: set = field(default_factory=set)  # dtypes whose buffer is page-locked

    def _buffer(self, dtype: torch.dtype, n: int, cuda: bool) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is not None and buf.numel() == n and (dtype in self.pinned) == cuda:
            return buf
        if dtype in self.pinned:
            _unpin(self.buffers[dtype])
            self.pinned.discard(dtype)
        buf = self.buffers[dtype] = torch.empty(n, dtype=dtype)
        if cuda:
            _pin(buf)
            self.pinned.add(dtype)
        return buf

    def pinned_bytes(self) -> int:
        """Bytes page-locked for staging (what ``async_save_host_bytes`` models)."""
        return sum(self.buffers[t].numel() * self.buffers[t].element_size() for t in self.pinned)

    def stage(self, chunks: list[Chunk]) -> list[Chunk]:
        need: dict = {}
        for c in chunks:
            need[c.tensor.dtype] = need.get(c.tensor.dtype, 0) + c.tensor.numel()
        cuda = any(c.tensor.is_cuda for c in chunks)
        bufs = {dtype: self._buffer(dtype, n, cuda) for dtype, n in need.items()}
        used = dict.fromkeys(need, 0)
        out = []
        for c in chunks:
            n, buf = c.tensor.numel(), bufs[c.tensor.dtype]
            o = used[c.tensor.dtype]
            host = buf[o:o + n].view(c.tensor.shape)
            host.copy_(c.tensor, non_blocking=cuda)
            used[c.tensor.dtype] = o + n
            out.append(Chunk(c.fqn, c.offsets, c.global_shape, host))
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

    def start(self, root: str, iteration: int, chunks: list[Chunk], objects: dict, group) -> None:
        self.wait()
        staged = self.staging.stage(chunks)
        t0 = time.perf_counter()
        self.pending = (iteration, t0)
        # threads start on device 0: DCP's writer touches the current CUDA stream, which would make a context
        # on GPU 0 from every local rank; the thread takes this rank's device first
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def work() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
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
            line = str(e) if isinstance(e, ConfigError) else first_line(e)
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
