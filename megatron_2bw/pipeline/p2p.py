"""Stage-to-stage transfers of activations (forward) and gradients (backward).

Op order, fixed and the same for every schedule: a stage posts the receive for an activation
or gradient no later than the action that consumes it (earlier when the executor prefetches),
and sends right after the compute that produced the tensor, never blocking. Activations only
flow r -> r+1 and gradients only r+1 -> r, so each direction carries one message kind in
microbatch order; with non-blocking sends, the schedule checker's simulation proves this order
cannot deadlock. Shapes are known ahead (``[b, s, h]``), so no shape messages are exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TAG = {"act": 1, "grad": 2}


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.prev, self.next, self.shape, self.dtype, self.device = prev_rank, next_rank, shape, dtype, device
        self._recvs: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}
        self._sends: list[tuple[torch.Tensor, object]] = []

    def post_recv(self, kind: str, mb: int) -> None:
        """Post the receive of ``kind`` ('act' from the previous stage, 'grad' from the next) for ``mb``."""
        key = (kind, mb)
        if key in self._recvs:
            return
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        src = self.prev if kind == "act" else self.next
        self._recvs[key] = (buf, dist.irecv(buf, src=src, tag=_TAG[kind]))

    def recv(self, kind: str, mb: int) -> torch.Tensor:
        self.post_recv(kind, mb)
        buf, work = self._recvs.pop((kind, mb))
        work.wait()
        return buf

    def send(self, kind: str, tensor: torch.Tensor) -> None:
        dst = self.next if kind == "act" else self.prev
        tensor = tensor.detach().contiguous()
        self._sends.append((tensor, dist.isend(tensor, dst=dst, tag=_TAG[kind])))
        self.reap()

    def reap(self) -> None:
        """Release sends that have completed (keeps their buffers alive until then)."""
        while self._sends and self._sends[0][1].is_completed():
            self._sends.pop(0)

    def drain(self) -> None:
        for _, work in self._sends:
            work.wait()
        self._sends.clear()
