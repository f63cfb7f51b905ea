"""Stage-to-stage transfers of activations (forward) and gradients (backward), driven by actions.

The executor hands the transport its segment's action list once (:meth:`Transport.units`) and
then runs each unit it gets back: a compute or step action on its own, or transfers, which it
passes to :meth:`Transport.run` with the tensors to send. Which peer, which tag, when receives
are posted and whether transfers are batched is decided here and nowhere else.

Op order, fixed and the same for every schedule: a stage posts the receive for an activation
or gradient no later than the action that consumes it (earlier when prefetching), and sends
right after the compute that produced the tensor, never blocking. Activations only flow
r -> r+1 and gradients only r+1 -> r, so each direction carries one message kind in
microbatch order; with non-blocking sends, the schedule checker's simulation proves this order
cannot deadlock. Shapes are known ahead (``[b, s, h]``), so no shape messages are exchanged.

A rank holding several model chunks (interleaved) names each transfer's peer by its chunk
(``peer_of``, from :class:`~.placement.Placement`): rank d-1 sends chunk c's activations to rank 0's
chunk c+1. Receives are then keyed by (kind, chunk, microbatch); each kind still comes from one
peer per chunk in the order that peer sends, which the checker proves per link.

Two modes:

- ``prefetch`` (gloo): gloo moves a message only once both its send and its receive are posted
  (the sender waits for the receiver's "ready"), so a receive posted just before it is needed
  costs a round trip of both processes' I/O threads on the critical path. The segment's
  receives are planned and the next ``ahead`` of each kind kept posted at all times (each into
  its own fresh buffer, which the consumer keeps); on top of that every receive is posted at
  least one action before its slot. Receives of one kind are posted in plan order, which is
  the order the peer sends them, so matching by (peer, tag) is exact.
  A receive action only hands its posted receive on (an :class:`Incoming`); the compute that consumes
  it waits (:meth:`Incoming.wait`), as ``torch.distributed.pipelining``'s runtime waits for a receive
  at its forward or backward. Where a schedule's lowering places a receive early (a multi-chunk
  schedule receives what a neighbour computed in a slot right after that slot), the stage then goes on
  with work it already has instead of idling until the neighbour's slot ends.
  Sends go out from a thread of their own (:class:`_SendThread`, on CPU): a gloo send whose
  receive is already posted, which prefetching makes the rule, writes its bytes from the calling
  thread and returns only once the peer's I/O thread has taken most of them (0.1-10 ms per
  512 KB activation on two loaded cores), time in which the stage would compute nothing.
- ``grouped`` (the default except on gloo): NCCL runs the transfers between two ranks on one
  stream in issue order, where a receive posted ahead of a send to the same peer deadlocks
  against the peer doing the same. Nothing is posted ahead: each run of transfers with one
  peer (``grouping.comm_groups``) is one ``batch_isend_irecv`` group, waited for as a whole,
  sends included, which is the rendezvous model that ``grouping.check_grouped`` proves
  deadlock-free for every schedule.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from ..schedule.actions import Action, Op
from ..schedule.grouping import comm_groups
from .grad_reducer import settle

RECV_OPS: frozenset[Op] = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
SEND_OPS: frozenset[Op] = frozenset({Op.SEND_ACT, Op.SEND_GRAD})

# a transfer's message kind is named by its receive op; the tag keeps the kinds apart on the wire
_KIND: dict[Op, Op] = {Op.RECV_ACT: Op.RECV_ACT, Op.SEND_ACT: Op.RECV_ACT,
                       Op.RECV_GRAD: Op.RECV_GRAD, Op.SEND_GRAD: Op.RECV_GRAD}
_TAG: dict[Op, int] = {Op.RECV_ACT: 1, Op.RECV_GRAD: 2}


def _outgoing(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class Incoming:
    """A posted receive that its consumer waits for (prefetch mode): the wait sits at the compute that
    needs the tensor, not at the receive action, which may come a whole round earlier."""

    __slots__ = ("buf", "work")

    def __init__(self, buf: torch.Tensor, work) -> None:
        self.buf, self.work = buf, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buf


class _Batch:
    """The works of one ``batch_isend_irecv`` as one work."""

    __slots__ = ("works",)

    def __init__(self, works: list) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


class _SendThread:
    """Issues a stage's sends in order from one daemon thread; the training thread never blocks in a send.

    The thread only issues (``dist.isend``), it never waits for a send to complete, so sends stay what
    the schedule checker assumes: buffered, never blocking the program. A send it issues can block it
    only while the peer's I/O thread takes the bytes of a receive already posted, which does not
    depend on the peer's program. The training thread reaps completed sends and waits for all at a
    drain; an error raised by an issue is raised there, on the training thread.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._works: deque[tuple[torch.Tensor, object]] = deque()  # issued, in order
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="p2p-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, threading.Event):  # a drain's marker: every send before it is issued
                job.set()
                continue
            tensor, dst, tag = job
            try:
                work = dist.isend(tensor, dst=dst, tag=tag)
            except BaseException as exc:  # handed to the training thread
                self._error = exc
                continue
            with self._lock:
                self._works.append((tensor, work))

    def _check(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._check()
        self._jobs.put((tensor, dst, tag))

    def reap(self) -> None:
        with self._lock:
            while self._works and self._works[0][1].is_completed():
                self._works.popleft()

    def drain(self) -> None:
        issued = threading.Event()
        self._jobs.put(issued)
        issued.wait()
        self._check()
        with self._lock:
            works, self._works = self._works, deque()
        for _, work in works:
            work.wait()


class Transport:
    """Point-to-point transfers of one stage with its previous and next stage."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, *, ahead: int = 2, mode: str = "auto",
                 peer_of: Callable[[Action], int | None] | None = None,
                 group_key: Callable[[Action], object] | None = None) -> None:
        """``peer_of``: the global rank of each transfer's peer where it depends on the chunk (None: activations
        from ``prev_rank``, gradients from ``next_rank``); ``group_key``: how runs of transfers are cut into
        groups (``grouping.comm_groups``' ``peer``; None: by peer)."""
        self.prev, self.next, self.shape, self.dtype, self.device = prev_rank, next_rank, shape, dtype, device
        self.peer_of, self.group_key = peer_of, group_key
        self.ahead = max(int(ahead), 1)
        if mode == "auto":
            mode = "prefetch" if not dist.is_initialized() or dist.get_backend() == "gloo" else "grouped"
        if mode not in ("prefetch", "grouped"):
            raise ValueError(f"unknown p2p mode {mode!r}")
        self.mode = mode
        self.grouped = mode == "grouped"
        # receives posted early are safe on gloo (independent matching per peer and tag), not on NCCL
        has_peers = prev_rank is not None or next_rank is not None or peer_of is not None
        self.can_plan = has_peers and dist.is_initialized() and not self.grouped
        self._recvs: dict[tuple[Op, int, int], tuple[torch.Tensor, object]] = {}  # by (kind, chunk, microbatch)
        self._sends: deque[tuple[torch.Tensor, object]] = deque()
        self._plan: dict[Op, deque[tuple[int, int]]] = {Op.RECV_ACT: deque(), Op.RECV_GRAD: deque()}  # (chunk, mb)
        self._posted = {Op.RECV_ACT: 0, Op.RECV_GRAD: 0}  # receives of each kind posted, not yet consumed
        # sends from their own thread (prefetch on CPU; see the module docstring); started at the first send
        self.send_thread = not self.grouped and torch.device(device).type == "cpu"
        self._sender: _SendThread | None = None
        # NCCL: single transfers go out as one-op batches, on the communicator the grouped ones use (a bare
        # isend/irecv makes a two-rank communicator per pair, hundreds of MB each, at its first use)
        self.batch_single = dist.is_initialized() and dist.get_backend() != "gloo"
        # NCCL (CUDA): while ``settle_while()`` (the reducer is busy) a grouped transfer is settled on the host
        # before the stream waits for it, and :meth:`quiesce` settles those waited for on the stream only
        self.poll = torch.device(device).type == "cuda"
        self.settle_while: Callable[[], bool] | None = None
        self._unsettled: list = []

    def _peer(self, a: Action) -> int | None:
        """The rank a transfer goes to or comes from: activations flow forward, gradients backward."""
        if self.peer_of is not None:
            return self.peer_of(a)
        return self.prev if a.op in (Op.RECV_ACT, Op.SEND_GRAD) else self.next

    # ------------------------------------------------------------------ the segment
    def units(self, actions: Sequence[Action]) -> Iterator[Sequence[Action]]:
        """The segment's actions in the units the executor runs one after the other.

        Grouped: each run of transfers with one peer is one unit, every other action its own.
        Prefetch: one action per unit; the segment's receives are planned, and before a unit is
        handed out every receive up to the next action is posted.
        """
        if self.grouped:
            groups, i = comm_groups(actions, self.group_key), 0
            while i < len(actions):
                end = groups.get(i, i + 1)
                yield actions[i:end]
                i = end
            return
        recvs = [i for i, a in enumerate(actions) if a.op in RECV_OPS]
        self.plan([actions[i] for i in recvs])
        ahead = 0  # receives posted so far: the next receive of the list is always posted
        for i, a in enumerate(actions):
            while ahead < len(recvs) and recvs[ahead] <= i + 1:
                self.post_recv(actions[recvs[ahead]])
                ahead += 1
            yield (a,)

    def run(self, unit: Sequence[Action], outgoing: Mapping[Action, torch.Tensor]
            ) -> list[tuple[Action, torch.Tensor | Incoming]]:
        """Perform a unit of transfers; ``outgoing`` holds the tensor of each send. Returns ``(receive, tensor)``,
        in prefetch mode ``(receive, Incoming)``: the consumer waits (see the module docstring)."""
        if self.grouped:
            return self.exchange(unit, outgoing)
        got = []
        for a in unit:
            if a.op in SEND_OPS:
                self.send(a, outgoing[a])
            else:
                got.append((a, self.recv_later(a)))
        return got

    # ------------------------------------------------------------------ receives
    def plan(self, recvs: Sequence[Action]) -> None:
        """The ordered receives this stage will consume next (a segment's).

        Keeps up to ``ahead`` of each kind posted from now on. Receives already posted are kept;
        the plan must list the remaining ones in consumption order. Ignored unless on gloo.
        """
        if not self.can_plan:
            return
        for a in recvs:
            if (a.op, a.chunk, a.mb) not in self._recvs:
                self._plan[a.op].append((a.chunk, a.mb))
        self._fill()

    def rewind(self, again: Sequence[Action]) -> None:
        """The receives ``again`` (already consumed) come again before every receive now posted or planned:
        the peer re-sends them (a failed post-validation re-runs a warm-up). Receives of one kind are matched in
        posting order, so each posted buffer now belongs to the receive that many places earlier in the new
        order, and those pushed past the posted ones go back to the front of the plan. Nothing is posted ahead
        in grouped mode: nothing to do there."""
        if self.grouped:
            return
        for kind in (Op.RECV_ACT, Op.RECV_GRAD):
            redo = [(a.chunk, a.mb) for a in again if a.op is kind]
            if not redo:
                continue
            posted = [key for key in self._recvs if key[0] is kind]
            order = redo + [key[1:] for key in posted]
            works = [self._recvs.pop(key) for key in posted]
            for key, work in zip(order, works):
                self._recvs[(kind, *key)] = work
            self._plan[kind].extendleft(reversed(order[len(works):]))
            self._fill()

    def forget_plan(self) -> None:
        """Drop the planned receives not yet posted (a segment cut short plans its own); posted ones stay."""
        for planned in self._plan.values():
            planned.clear()

    def _fill(self) -> None:
        for kind, planned in self._plan.items():
            while planned and self._posted[kind] < self.ahead:
                self._post(kind, planned.popleft())

    def _post(self, kind: Op, key: tuple[int, int]) -> None:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        src = self._peer(Action(kind, key[1], chunk=key[0]))
        self._recvs[(kind, *key)] = (buf, self._single(dist.irecv, buf, src, _TAG[kind]))
        self._posted[kind] += 1

    def post_recv(self, a: Action) -> None:
        """Post receive ``a`` now. Idempotent; with a plan, every planned receive of its kind before it is
        posted first, so the posting order always equals the sending order."""
        key = (a.chunk, a.mb)
        if (a.op, *key) in self._recvs:
            return
        planned = self._plan[a.op]
        if key in planned:
            while planned:
                nxt = planned.popleft()
                self._post(a.op, nxt)
                if nxt == key:
                    return
        self._post(a.op, key)

    def recv(self, a: Action) -> torch.Tensor:
        """Wait for receive ``a`` (``RECV_ACT`` or ``RECV_GRAD``), posting it first if needed."""
        return self.recv_later(a).wait()

    def recv_later(self, a: Action) -> Incoming:
        """Receive ``a``, posted (first if needed) but not waited for: the consumer calls ``wait()``."""
        self.post_recv(a)
        buf, work = self._recvs.pop((a.op, a.chunk, a.mb))
        self._posted[a.op] -= 1
        self._fill()  # the next planned receive goes up before anyone blocks on this one
        return Incoming(buf, work)

    # ------------------------------------------------------------------ sends
    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Start send ``a`` (``SEND_ACT`` or ``SEND_GRAD``) without waiting; :meth:`drain` waits."""
        tensor = _outgoing(tensor)
        kind = _KIND[a.op]
        self._isend(tensor, self._peer(a), _TAG[kind])
        self.reap()

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if self.send_thread:
            if self._sender is None:
                self._sender = _SendThread()
            self._sender.send(tensor, dst, tag)
        else:
            self._sends.append((tensor, self._single(dist.isend, tensor, dst, tag)))

    def _single(self, fn: Callable, tensor: torch.Tensor, peer: int, tag: int):
        """One transfer, started; on NCCL as a one-op ``batch_isend_irecv`` (see ``batch_single``)."""
        if not self.batch_single:
            return fn(tensor, peer, tag=tag)
        return _Batch(dist.batch_isend_irecv([dist.P2POp(fn, tensor, peer, tag=tag)]))

    def reap(self) -> None:
        """Release sends that have completed (keeps their buffers alive until then)."""
        if self._sender is not None:
            self._sender.reap()
        while self._sends and self._sends[0][1].is_completed():
            self._sends.popleft()

    # ------------------------------------------------------------------ grouped
    def exchange(self, unit: Sequence[Action],
                 outgoing: Mapping[Action, torch.Tensor]) -> list[tuple[Action, torch.Tensor]]:
        """Issue the unit's sends, then its receives, as one ``batch_isend_irecv`` group and wait for all of it.

        Transfers of one kind keep their order in ``unit``, which is the order the peer issues the
        counterparts in.
        """
        ops, got = [], []
        for a in unit:
            if a.op in SEND_OPS:
                ops.append(dist.P2POp(dist.isend, _outgoing(outgoing[a]), self._peer(a), tag=_TAG[_KIND[a.op]]))
        for a in unit:
            if a.op in RECV_OPS:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                got.append((a, buf))
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(a), tag=_TAG[a.op]))
        works = dist.batch_isend_irecv(ops)
        if self.poll:
            if self.settle_while is not None and self.settle_while():
                for work in works:
                    settle(work, poll=True)
            else:
                self._unsettled = [w for w in self._unsettled if not w.is_completed()] + list(works)
        for work in works:
            work.wait()
        return got

    def quiesce(self) -> None:
        """Settle on the host every grouped transfer the stream waits for that has not completed yet: called
        before the reducer queues a job, whose links must not sit behind such a wait (``GradReducer.busy``)."""
        works, self._unsettled = self._unsettled, []
        for work in works:
            settle(work, poll=True)

    # ------------------------------------------------------------------ end of a segment
    def drain(self) -> None:
        """Wait for every send; every receive posted must have been consumed (a plan ends with its segment)."""
        if self._sender is not None:
            self._sender.drain()
        for _, work in self._sends:
            work.wait()
        self._sends.clear()
        if self._recvs or any(self._plan.values()):
            left = [str(Action(k, mb, chunk=c)) for k, c, mb in sorted(self._recvs, key=lambda x: (x[0].value, x[1:]))]
            left += [str(Action(k, mb, chunk=c)) for k, q in self._plan.items() for c, mb in q]
            raise RuntimeError(f"pipeline segment ended with receives still posted or planned: {left[:4]}")
