"""Stage-to-stage transfers of activations (forward) and gradients (backward).

Op order, fixed and the same for every schedule: a stage posts the receive for an activation
or gradient no later than the action that consumes it (earlier when the executor prefetches),
and sends right after the compute that produced the tensor, never blocking. Activations only
flow r -> r+1 and gradients only r+1 -> r, so each direction carries one message kind in
microbatch order; with non-blocking sends, the schedule checker's simulation proves this order
cannot deadlock. Shapes are known ahead (``[b, s, h]``), so no shape messages are exchanged.

Receives posted early matter: gloo moves a message only once both its send and its receive are
posted (the sender waits for the receiver's "ready"), so a receive posted just before it is
needed costs a round trip of both processes' I/O threads on the critical path. ``plan()`` takes
the segment's ordered receives and keeps the next ``ahead`` of each kind posted at all times
(each into its own fresh buffer, which the consumer keeps); receives of one kind are always
posted in plan order, which is the order the peer sends them, so matching by (peer, tag) is
exact. Without a plan the behaviour is the executor's one-action prefetch.

Plans and the executor's one-action prefetch apply to the "prefetch" mode, for gloo, whose
sends and receives match independently per (peer, tag). NCCL runs the transfers between two
ranks on one stream in issue order, where a receive posted ahead of a send to the same peer
deadlocks against the peer doing the same. The "grouped" mode (the default except on gloo)
never posts ahead: :meth:`exchange` issues each run of transfers with one peer as one
``batch_isend_irecv`` group and waits for all of it, sends included, which is the rendezvous
model that ``grouping.check_grouped`` proves deadlock-free for every schedule.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

_TAG = {"act": 1, "grad": 2}


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, *, ahead: int = 2, mode: str = "auto") -> None:
        self.prev, self.next, self.shape, self.dtype, self.device = prev_rank, next_rank, shape, dtype, device
        self.ahead = max(int(ahead), 1)
        self._recvs: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}
        self._sends: deque[tuple[torch.Tensor, object]] = deque()
        self._plan: dict[str, deque[int]] = {"act": deque(), "grad": deque()}
        self._posted = {"act": 0, "grad": 0}  # receives of each kind posted and not yet consumed
        if mode == "auto":
            mode = "prefetch" if not dist.is_initialized() or dist.get_backend() == "gloo" else "grouped"
        if mode not in ("prefetch", "grouped"):
            raise ValueError(f"unknown p2p mode {mode!r}")
        self.mode = mode
        self.grouped = mode == "grouped"
        # receives posted early are safe on gloo (independent matching per peer and tag), not on NCCL
        self.can_plan = (prev_rank is not None or next_rank is not None) and dist.is_initialized() and not self.grouped

    # ------------------------------------------------------------------ receives
    def plan(self, recvs) -> None:
        """The ordered receives ``[(kind, mb), ...]`` this stage will consume next (a segment's).

        Keeps up to ``ahead`` of each kind posted from now on. Receives already posted are kept;
        the plan must list the remaining ones in consumption order. Ignored unless on gloo.
        """
        if not self.can_plan:
            return
        for kind, mb in recvs:
            if (kind, mb) not in self._recvs:
                self._plan[kind].append(mb)
        self._fill()

    def _fill(self) -> None:
        for kind, queue in self._plan.items():
            while queue and self._posted[kind] < self.ahead:
                self._post(kind, queue.popleft())

    def _post(self, kind: str, mb: int) -> None:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        src = self.prev if kind == "act" else self.next
        self._recvs[(kind, mb)] = (buf, dist.irecv(buf, src=src, tag=_TAG[kind]))
        self._posted[kind] += 1

    def post_recv(self, kind: str, mb: int) -> None:
        """Post the receive of ``kind`` ('act' from the previous stage, 'grad' from the next) for ``mb``.

        Idempotent; with a plan, every planned receive of this kind before ``mb`` is posted first,
        so the posting order always equals the sending order.
        """
        if (kind, mb) in self._recvs:
            return
        queue = self._plan[kind]
        if mb in queue:
            while queue:
                nxt = queue.popleft()
                self._post(kind, nxt)
                if nxt == mb:
                    return
        self._post(kind, mb)

    def recv(self, kind: str, mb: int) -> torch.Tensor:
        self.post_recv(kind, mb)
        buf, work = self._recvs.pop((kind, mb))
        self._posted[kind] -= 1
        self._fill()  # the next planned receive goes up before we block on this one
        work.wait()
        return buf

    # ------------------------------------------------------------------ grouped
    def exchange(self, sends: list[tuple[str, torch.Tensor]], recvs: list[tuple[str, int]]) -> list[torch.Tensor]:
        """Issue ``sends`` and ``recvs`` as one ``batch_isend_irecv`` group and wait for all of it.

        Returns the received tensors in the order of ``recvs``. Transfers of one kind keep their
        list order, which is the order the peer issues the counterparts in.
        """
        ops, bufs = [], []
        for kind, tensor in sends:
            tensor = tensor.detach()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, self.next if kind == "act" else self.prev, tag=_TAG[kind]))
        for kind, _ in recvs:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            bufs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, self.prev if kind == "act" else self.next, tag=_TAG[kind]))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return bufs

    # ------------------------------------------------------------------ sends
    def send(self, kind: str, tensor: torch.Tensor) -> None:
        dst = self.next if kind == "act" else self.prev
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self._sends.append((tensor, dist.isend(tensor, dst=dst, tag=_TAG[kind])))
        self.reap()

    def reap(self) -> None:
        """Release sends that have completed (keeps their buffers alive until then)."""
        while self._sends and self._sends[0][1].is_completed():
            self._sends.popleft()

    def drain(self) -> None:
        """Wait for every send; every receive posted must have been consumed (a plan ends with its segment)."""
        for _, work in self._sends:
            work.wait()
        self._sends.clear()
        if self._recvs or any(self._plan.values()):
            left = sorted(self._recvs) + [(k, mb) for k, q in self._plan.items() for mb in q]
            raise RuntimeError(f"pipeline segment ended with receives still posted or planned: {left[:4]}")
