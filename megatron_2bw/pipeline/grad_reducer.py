"""The reductions between a step's last backward and its update, run as an asynchronous chain.

For step t the chain is: (1) all-reduce the tied word-embedding gradient between the first and
last stage; (2) all-reduce the gradient across data-parallel replicas, in buckets; (3) all-reduce
the squared gradient norm over the model group (all stages and tensor ranks of one replica).
A non-finite total means overflow: every rank sees the same total, so every rank skips the same
step. With the distributed optimizer (:mod:`.zero`) step (2) becomes a reduce-scatter that leaves
each rank the summed gradient of its own shard, and the norm is of this rank's shard, first
all-reduced over the data-parallel group. The embedding link comes first in both chains: after a
reduce-scatter it could not be done (a shard's embedding range on the first stage and on the last
stage are different ranges of different buffers), and with it first both chains add the same
terms in the same order, so the sharded gradient equals the unsharded one.

After the model-group all-reduce, a data-parallel world broadcasts data-parallel rank 0's total
(one 4-byte message): the replicas' model groups are different communicators whose summation
orders may differ in the last bit, and a clip factor that differs between replicas would let
them drift apart. An all-reduce leaves every member of its group the same bits, so after the
broadcast every rank of the world holds the one total.

The executor starts the chain at REDUCE_GRADS(t) and waits for it only at APPLY_UPDATE(t) (in
2BW a microbatch slot or more later, which hides the reductions). With optimizer post-validation the
chain is issued in two jobs: the gradient's links (1) and (2) at REDUCE_GRADS(t), the norm's (3) at
APPLY_UPDATE(t), which may apply a speculative update as soon as the first job is done
(:meth:`GradReducer.wait_grad`: the distributed optimizer's all-gather of that update then goes ahead
of the norm on the ordered worker); VALIDATE(t) waits for the norm. The last stage may issue the tied
embedding's link on its own earlier (:meth:`GradReducer.start_embedding`, REDUCE_EMBEDDING(t)). The whole chain is
handed at once to a daemon worker thread, never advanced by polling from the training loop: another
stage's update may be waiting for this rank's part of the chain while this rank's loop is
blocked in a transfer that the other stage only serves after its update. Polling from the loop
deadlocks there.

The worker orders the links on the host, on every device: it issues a collective, waits until
its work handle reports completion (:func:`settle`), and only then issues the next. No GPU stream
ever waits on another rank's progress. On NCCL a ``work.wait()`` on an unfinished collective
makes the calling stream wait for it, and a stream wait in a hardware queue shared with the
training loop's work (``CUDA_DEVICE_MAX_CONNECTIONS=1``, a pool stream sharing a connection) or
a host-blocking wait (``TORCH_NCCL_BLOCKING_WAIT=1``) would stall this rank's next transfers
behind a collective that other stages join only after those transfers: 2BW deadlocks at its
first step boundary (``tests/test_h1_reduction_order.py`` replays it). The training thread keeps the
same rule while a job runs (:meth:`GradReducer.busy`): it settles its transfers on the host first, so
none of the worker's links is queued behind a wait on a transfer that another stage serves only after
its update. On CUDA the worker runs
on a side stream that first waits for an event the training thread recorded at the request
(local work only: the backward that produced the gradient), and it reads the total to the host
itself, so the training thread gets a float without synchronizing its own queue.

Chains run in step order on the one worker, so every group sees its collectives in the same
order on every rank. This is the model the schedule checker proves deadlock-free:
APPLY_UPDATE(t) waits until every stage has run REDUCE_GRADS(t). The distributed optimizer's
all-gather of updated shards (:meth:`GradReducer.gather`) goes through the same worker, since two
issuers on the data-parallel group would race; it is waited for only by the first reader of the
weights it writes (:meth:`wait_slot`, :meth:`wait_all`).

A stage's buffers are cut into segments by reduction domain (:mod:`.segments`): link (2) runs per segment
over its domain's group (:class:`SegmentReduction`), in segment order, and the norm counts each parameter
once: a segment whose values differ across another group (an expert's pieces across the expert group) has
its part of the squared norm summed over that group too (with the distributed optimizer every part is a
shard's, summed over its domain's group and that one). One segment over the data group is the chain above.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .zero import ShardLayout, all_gather, reduce_scatter

_POLL_MIN_S, _POLL_MAX_S = 1e-5, 2e-4  # the worker's polling interval while a collective runs


def settle(work, poll: bool) -> None:
    """Wait on the host until a collective's ``work`` has completed; ``wait()`` raises its error, if any.

    ``poll`` (NCCL): ``wait()`` only once ``is_completed()`` says so, since on NCCL ``wait()`` on
    unfinished work is a stream wait on other ranks' progress. Without it (gloo) ``wait()`` itself
    blocks the host, which is what is wanted (gloo's reduce-scatter reports completion only then).
    """
    delay = _POLL_MIN_S
    while poll and not work.is_completed():
        time.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
    work.wait()


def grad_sumsq(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's part of the squared global gradient norm, shape [1], in fp32. The per-tensor norms
    are computed in fp32 too: an fp16 norm rounds every scaled norm above 65504 to inf, which would
    count a finite step as an overflow."""
    if not views:
        return torch.zeros(1, device=device)
    try:
        norms = torch._foreach_norm(views, 2, dtype=torch.float32)
    except TypeError:  # a torch without the dtype argument
        norms = [torch.linalg.vector_norm(v, dtype=torch.float32) for v in views]
    return torch.stack(norms).square().sum().reshape(1)


@dataclass(frozen=True)
class SegmentReduction:
    """How one segment ``[lo, hi)`` of the padded gradient storage is reduced: over ``group`` (``size`` ranks),
    reduce-scattered by ``shard`` (the distributed optimizer's layout of the segment; None: all-reduced),
    and ``copies``: the group across which its values are distinct (None: replicas)."""

    lo: int
    hi: int | None  # None: to the end of the storage
    group: object | None
    size: int
    shard: ShardLayout | None = None
    copies: object | None = None

    def of(self, grad: torch.Tensor) -> torch.Tensor:
        return grad[self.lo:self.hi] if self.lo or self.hi is not None else grad

    def views(self, grad: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``views`` (of ``grad``) inside the segment."""
        if not self.lo and self.hi is None:
            return views
        base, esize, hi = grad.data_ptr(), grad.element_size(), grad.numel() if self.hi is None else self.hi
        return [v for v in views if self.lo <= (v.data_ptr() - base) // esize < hi]

    def norm_groups(self) -> tuple:
        """The groups its part of the squared norm is summed over, so that each value counts once."""
        return tuple(g for g in ((self.group,) if self.shard is not None else ()) + (self.copies,) if g is not None)


class _Job:
    """One piece of work for the worker: done when ``event`` is set (``error`` if it failed)."""

    def __init__(self, step: int, run: Callable[[], float | None], ready: torch.cuda.Event | None) -> None:
        self.step, self.run, self.ready = step, run, ready  # ``ready``: the training stream's work it reads
        self.result: float | None = None
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.cuda_event: torch.cuda.Event | None = None
        # a gradient job's: its part of the squared norm, its norm job once issued (post-validation issues it
        # later), and the tied embedding's link where it was issued on its own ahead of the job
        self.sumsq: list[torch.Tensor] = []
        self.norm: _Job | None = None
        self.early: _Job | None = None


class GradReducer:
    def __init__(self, *, dp_group, embedding_group, model_group, replicas: int, shared_range: tuple[int, int] | None,
                 bucket_numel: int, has_embedding_group: bool, device: torch.device | None = None,
                 shard: ShardLayout | None = None, segments: list[SegmentReduction] | None = None) -> None:
        """``dp_group``/``replicas``: the whole data group (the norm's broadcast); ``segments``: each segment's
        reduction (None: one segment, the whole storage, over ``dp_group`` with the layout ``shard``)."""
        self.dp_group, self.embedding_group, self.model_group = dp_group, embedding_group, model_group
        self.replicas, self.shared_range, self.bucket_numel = replicas, shared_range, max(int(bucket_numel), 1)
        self.use_emb = has_embedding_group and shared_range is not None
        if segments is None:
            segments = [SegmentReduction(0, None, dp_group, replicas, shard)]
        self.segments = [SegmentReduction(r.lo, r.hi, r.group, r.size, r.shard if r.size > 1 else None, r.copies)
                         for r in segments]
        self.shard = self.segments[0].shard  # the first (default domain's) segment's layout, None: unsharded
        self.cuda = device is not None and device.type == "cuda"
        if self.cuda and device.index is None:  # the worker thread must know which device (its own default is 0)
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self.poll = self.cuda  # NCCL: settle a collective by polling its completion (see :func:`settle`)
        # replica 0's rank in the data-parallel group: the source of the norm's broadcast (also without a model
        # group where a segment's part was summed over a group of copies: those groups differ between replicas)
        self._broadcast = replicas > 1 and (model_group is not None or any(r.copies is not None for r in self.segments))
        self._dp_root = dist.get_global_rank(dp_group, 0) if self._broadcast else None
        self._pending: deque[_Job] = deque()  # gradient jobs (with their norm jobs), in step order
        self._emb_early: dict[int, _Job] = {}  # by step: the tied embedding's link, issued ahead of its chain
        self._gathers: dict[int, _Job] = {}  # by weight buffer: its pending all-gather
        self._scratch: dict[int, torch.Tensor] = {}  # by segment: the reduce-scatter's output (one chain at a time)
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        self._last: _Job | None = None  # the job issued last: the worker is busy until it is done
        # called on the training thread before a job is queued: the executor settles the transport's
        # unfinished transfers there (see :meth:`busy`)
        self.before_issue: Callable[[], None] | None = None

    # ------------------------------------------------------------------ the chain
    def _embedding(self, grad: torch.Tensor) -> None:
        """Link (1): the tied word embedding's gradient summed between the first and the last stage."""
        lo, hi = self.shared_range
        self._settle(dist.all_reduce(grad[lo:hi], group=self.embedding_group, async_op=True))

    def _gradient(self, grad: torch.Tensor, norm_views: list[torch.Tensor], embedding: bool
                  ) -> list[tuple[tuple, torch.Tensor]]:
        """Links (1) and (2), each settled before the next; this rank's parts of the squared norm, each with
        the groups it is summed over (a segment's part is its shard's with the distributed optimizer)."""
        if embedding and self.use_emb:
            self._embedding(grad)
        parts: dict[tuple, torch.Tensor] = {}
        for k, r in enumerate(self.segments):
            piece, views = r.of(grad), r.views(grad, norm_views)
            if r.shard is not None:
                if k not in self._scratch:
                    self._scratch[k] = grad.new_empty(r.shard.size)
                reduce_scatter(piece, r.shard, r.group, self._scratch[k], self._settle)
                views = r.shard.counted_views(piece, views)
            else:
                # every bucket issued back to back (one group, the same order on every rank, so NCCL pipelines
                # them), then each settled in order: no link of another group starts before all have completed
                works = [dist.all_reduce(piece[i:i + self.bucket_numel], group=r.group, async_op=True)
                         for i in (range(0, piece.numel(), self.bucket_numel) if r.size > 1 else ())]
                for work in works:
                    self._settle(work)
            s = grad_sumsq(views, grad.device)
            key = r.norm_groups()
            parts[key] = s if key not in parts else parts[key] + s
        return list(parts.items())

    def _norm(self, parts: list[tuple[tuple, torch.Tensor]]) -> float:
        """Link (3): the global squared norm from this rank's parts."""
        sumsq = None
        for groups, s in parts:
            for g in groups:
                self._settle(dist.all_reduce(s, group=g, async_op=True))
            sumsq = s if sumsq is None else sumsq + s
        if self.model_group is not None:
            self._settle(dist.all_reduce(sumsq, group=self.model_group, async_op=True))
        if self._broadcast:  # every replica takes replica 0's bits (see the module docstring)
            self._settle(dist.broadcast(sumsq, src=self._dp_root, group=self.dp_group, async_op=True))
        return float(sumsq.item())  # on CUDA: synchronizes the side stream only

    def _settle(self, work) -> None:
        settle(work, self.poll)

    def _worker(self) -> None:
        device = torch.cuda.device(self._device) if self.cuda else contextlib.nullcontext()
        stream = torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext()
        with device, stream:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    if job.ready is not None:
                        self._stream.wait_event(job.ready)  # local work: what the job reads was written
                    job.result = job.run()
                    if self.cuda:
                        job.cuda_event = torch.cuda.Event()
                        job.cuda_event.record(self._stream)
                except BaseException as exc:  # handed to the waiter on the training thread
                    job.error = exc
                job.event.set()

    def busy(self) -> bool:
        """Whether a job issued is still running: the training thread must then settle each transfer on the host.

        With one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, or two streams sharing a connection) a
        stream wait on an unmatched transfer blocks every stream behind it, the worker's links included, and
        in 2BW the transfer's counterpart may come only after the peer's update, which needs those links.
        So before a job is queued the training thread settles its unfinished pipeline transfers (``before_issue``),
        and while one runs it enqueues no stream wait on a pipeline transfer that has not completed.

        Exempt: the collectives inside a stage (tensor-parallel all-reduces and all-gathers, sequence-parallel
        all-gathers and reduce-scatters, the context group's ring hops, all-gathers and all-to-alls, the
        context-parallel loss all-reduce) are still stream waits while a job runs. Their peers are the same
        stage's other tensor and context ranks, which run the same program in lockstep: a peer misses such a
        collective only while it is host-blocked earlier in that program, and its chain(t), which the worker
        waits for, is coupled to this rank's through the model and data groups, not through a transfer that
        another stage serves after its update. Inferred (review 3 G7), not replayed: ``SingleQueue``
        (``tests/test_h1_reduction_order.py``) models one rank per stage.
        """
        return self._last is not None and not self._last.event.is_set()

    def _issue(self, job: _Job) -> None:
        """Queue ``job`` for the worker, after every job queued before it."""
        if self.before_issue is not None:
            self.before_issue()
        self._last = job
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            # a daemon, so that a rank failing elsewhere never hangs at exit joining it
            self._thread = threading.Thread(target=self._worker, name="grad-reducer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _ready(self) -> torch.cuda.Event | None:
        """An event after the training stream's work so far (CUDA): what the next job reads is written."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _wait(self, job: _Job) -> float | None:
        """Block the host until ``job`` is done; on CUDA the training stream then orders after it (its
        collectives are complete by then, so this stream wait is on finished local work)."""
        job.event.wait()
        if job.error is not None:
            raise job.error
        if job.cuda_event is not None:
            torch.cuda.current_stream(self._device).wait_event(job.cuda_event)
        return job.result

    # ------------------------------------------------------------------ API
    def start(self, step: int, grad: torch.Tensor, norm_views: list[torch.Tensor], norm: bool = True) -> None:
        """Issue step ``step``'s chain now; it runs while the training loop goes on. ``grad``: the step's whole
        (padded) gradient storage, ``RankWeights.padded_grad``. ``norm`` False: only the gradient's links;
        :meth:`start_norm` issues the norm's later (post-validation)."""
        early = self._emb_early.pop(step, None)
        sumsq: list[torch.Tensor] = []
        job = _Job(step, lambda: sumsq.append(self._gradient(grad, norm_views, early is None)), self._ready())
        job.sumsq, job.early = sumsq, early
        self._pending.append(job)
        self._issue(job)
        if norm:
            self.start_norm(step)

    def start_embedding(self, step: int, grad: torch.Tensor) -> None:
        """Issue the tied embedding's link of step ``step`` now, ahead of the rest of its chain (a no-op where
        this rank has no embedding partner): the last stage once its head's weight gradient is complete."""
        if self.use_emb:
            job = _Job(step, lambda: self._embedding(grad), self._ready())
            self._emb_early[step] = job
            self._issue(job)

    def _job(self, step: int) -> _Job:
        if not self._pending or self._pending[0].step != step:
            oldest = self._pending[0].step if self._pending else None
            raise RuntimeError(f"update of step {step} reached before its reductions (oldest pending: {oldest})")
        return self._pending[0]

    def start_norm(self, step: int) -> None:
        """Issue the global norm's link of step ``step``, whose gradient links :meth:`start` issued."""
        job = self._job(step)
        if job.norm is None:
            job.norm = _Job(step, lambda: self._norm(job.sumsq[0]), None)  # after ``job`` on the worker
            self._issue(job.norm)

    def wait_grad(self, step: int) -> None:
        """Wait until step ``step``'s gradient is final on this rank (its embedding and data-parallel links)."""
        job = self._job(step)
        if job.early is not None:
            self._wait(job.early)
        self._wait(job)

    def finish(self, step: int) -> float:
        """Wait for step ``step``'s chain (the oldest); return the global squared gradient norm."""
        job = self._job(step)
        if job.norm is None:
            raise RuntimeError(f"the norm of step {step} was never issued (GradReducer.start_norm)")
        self._pending.popleft()
        if job.early is not None:
            self._wait(job.early)
        self._wait(job)
        return self._wait(job.norm)

    def _gather_segments(self, padded: torch.Tensor) -> None:
        for r in self.segments:
            if r.shard is not None:
                all_gather(r.of(padded), r.shard, r.group, self._settle)

    def gather(self, slot: int, padded: torch.Tensor) -> None:
        """Start filling every other rank's range of weight buffer ``slot`` (``padded``, the whole padded
        storage) from its own range, which must already hold this rank's shard; waited for by :meth:`wait_slot`."""
        self.wait_slot(slot)  # never two writers of one buffer
        job = _Job(-1, lambda: self._gather_segments(padded), self._ready())
        self._gathers[slot] = job
        self._issue(job)

    def gather_shards(self, pieces: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
        """``--optimizer muon``: the ``sum(recv)`` elements the ranks of ``group`` (a segment's domain; None:
        the data-parallel group) send this one (``recv[r]`` from rank r, in rank order) for its ``pieces``
        (``send[r]`` elements for rank r, concatenated): one all-to-all issued on the ordered channel and waited for."""
        out = pieces.new_empty(sum(recv))
        group = self.dp_group if group is None else group
        job = _Job(-1, lambda: self._settle(dist.all_to_all_single(out, pieces, recv, send, group=group,
                                                                   async_op=True)), self._ready())
        self._issue(job)
        self._wait(job)
        return out

    def wait_slot(self, slot: int) -> None:
        """Wait until weight buffer ``slot`` holds every shard (no-op without a pending gather)."""
        job = self._gathers.pop(slot, None)
        if job is not None:
            self._wait(job)

    def wait_all(self) -> None:
        """Wait for every pending all-gather: the weight buffers are whole after this."""
        for slot in list(self._gathers):
            self.wait_slot(slot)
