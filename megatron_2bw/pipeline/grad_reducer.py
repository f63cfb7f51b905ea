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

The executor starts the chain at REDUCE_GRADS(t) and waits for it only at APPLY_UPDATE(t) (in
2BW a microbatch slot or more later, which hides the reductions). The whole chain is issued at
the start, never by polling from the training loop: another stage's update may be waiting for
this rank's part of the chain while this rank's loop is blocked in a transfer that the other
stage only serves after its update. Polling from the loop deadlocks there; so

- on CUDA the links are launched at once on a side stream, ordered by stream waits;
- on CPU (gloo, whose waits block the host) a daemon worker thread runs the links in order.

Chains run in step order on one stream or one thread, so every group sees its collectives in
the same order on every rank. This is the model the schedule checker proves deadlock-free:
APPLY_UPDATE(t) waits until every stage has run REDUCE_GRADS(t). The distributed optimizer's
all-gather of updated shards (:meth:`GradReducer.gather`) goes through the same stream or thread,
since two issuers on the data-parallel group would race; it is waited for only by the first
reader of the weights it writes (:meth:`wait_slot`, :meth:`wait_all`).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from .zero import ShardLayout, _all_gather as _all_gather_into, all_gather, reduce_scatter


def grad_sumsq(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's part of the squared global gradient norm, shape [1], in fp32."""
    norms = torch._foreach_norm(views) if views else []
    return (torch.stack(norms).float().square().sum() if norms else torch.zeros((), device=device)).reshape(1)


class _Job:
    """One piece of work on the ordered channel: done when ``event`` is set (``error`` if it failed)."""

    def __init__(self, step: int, run: Callable[[], torch.Tensor | None], keep: tuple = ()) -> None:
        self.step, self.run, self.keep = step, run, keep  # ``keep``: tensors the work reads (CUDA lifetimes)
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.cuda_event: torch.cuda.Event | None = None


class GradReducer:
    def __init__(self, *, dp_group, embedding_group, model_group, w: int, shared_range: tuple[int, int] | None,
                 bucket_numel: int, has_embedding_group: bool, device: torch.device | None = None,
                 shard: ShardLayout | None = None) -> None:
        self.dp_group, self.embedding_group, self.model_group = dp_group, embedding_group, model_group
        self.w, self.shared_range, self.bucket_numel = w, shared_range, max(int(bucket_numel), 1)
        self.use_emb = has_embedding_group and shared_range is not None
        self.shard = shard if shard is not None and w > 1 else None  # the distributed optimizer's layout
        self.cuda = device is not None and device.type == "cuda"
        self._pending: deque[_Job] = deque()
        self._gathers: dict[int, _Job] = {}  # by weight buffer: its pending all-gather
        self._scratch: torch.Tensor | None = None  # the reduce-scatter's output (chains run one at a time)
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the chain
    def _chain(self, grad: torch.Tensor, norm_views: list[torch.Tensor]) -> torch.Tensor:
        """Issue the links; each waits for the previous (a host wait on CPU, a stream wait on CUDA)."""
        if self.use_emb:
            lo, hi = self.shared_range
            dist.all_reduce(grad[lo:hi], group=self.embedding_group, async_op=True).wait()
        if self.shard is not None:
            if self._scratch is None:
                self._scratch = grad.new_empty(self.shard.size)
            reduce_scatter(grad, self.shard, self.dp_group, self._scratch)
            sumsq = grad_sumsq(self.shard.counted_views(grad, norm_views), grad.device)
            dist.all_reduce(sumsq, group=self.dp_group, async_op=True).wait()
        else:
            if self.w > 1:
                self._dp_all_reduce(grad)
            sumsq = grad_sumsq(norm_views, grad.device)
        if self.model_group is not None:
            dist.all_reduce(sumsq, group=self.model_group, async_op=True).wait()
        return sumsq

    def _dp_all_reduce(self, grad: torch.Tensor) -> None:
        works = [dist.all_reduce(grad[i:i + self.bucket_numel], group=self.dp_group, async_op=True)
                 for i in range(0, grad.numel(), self.bucket_numel)]
        for work in works:
            work.wait()

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = job.run()
            except BaseException as exc:  # handed to the waiter on the training thread
                job.error = exc
            job.event.set()

    def _issue(self, job: _Job, ref: torch.Tensor) -> None:
        """Run ``job`` after every job issued before it: on the side stream (CUDA) or the worker (CPU)."""
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(ref.device))
            with torch.cuda.stream(self._stream):
                job.result = job.run()
                job.cuda_event = torch.cuda.Event()
                job.cuda_event.record(self._stream)
            return
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            # a daemon, so that a rank failing elsewhere never hangs at exit joining it
            self._thread = threading.Thread(target=self._worker, name="grad-reducer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _wait(self, job: _Job) -> torch.Tensor | None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(job.cuda_event)
        else:
            job.event.wait()
            if job.error is not None:
                raise job.error
        return job.result

    # ------------------------------------------------------------------ API
    def start(self, step: int, grad: torch.Tensor, norm_views: list[torch.Tensor]) -> None:
        """Issue step ``step``'s whole chain now; it runs while the training loop goes on. ``grad``: the
        step's whole (padded) gradient storage, ``StageWeights.padded_grad``."""
        job = _Job(step, lambda: self._chain(grad, norm_views))
        self._pending.append(job)
        self._issue(job, grad)

    def finish(self, step: int) -> torch.Tensor:
        """Wait for step ``step``'s chain (the oldest); return the global squared gradient norm, shape [1]."""
        if not self._pending or self._pending[0].step != step:
            oldest = self._pending[0].step if self._pending else None
            raise RuntimeError(f"update of step {step} reached before its reductions (oldest pending: {oldest})")
        return self._wait(self._pending.popleft())

    def gather(self, slot: int, padded: torch.Tensor) -> None:
        """Start filling every other rank's range of weight buffer ``slot`` (``padded``, the whole padded
        storage) from its own range, which must already hold this rank's shard; waited for by :meth:`wait_slot`."""
        self.wait_slot(slot)  # never two writers of one buffer
        job = _Job(-1, lambda: all_gather(padded, self.shard, self.dp_group), keep=(padded,))
        self._gathers[slot] = job
        self._issue(job, padded)

    def gather_shards(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's ``shard`` (its range of a padded buffer), concatenated: an all-gather over the
        data-parallel group issued on the ordered channel and waited for (``--optimizer muon``)."""
        out = shard.new_empty(self.shard.w * shard.numel())
        job = _Job(-1, lambda: _all_gather_into(out, shard, self.dp_group), keep=(out, shard))
        self._issue(job, shard)
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
