"""The reductions between a step's last backward and its update, run as an asynchronous chain.

For step t the chain is: (1) all-reduce the gradient across data-parallel replicas, in buckets;
(2) all-reduce the tied word-embedding gradient between the first and last stage; (3) all-reduce
the squared gradient norm over the model group (all stages and tensor ranks of one replica).
A non-finite total means overflow: every rank sees the same total, so every rank skips the same
step.

The executor starts the chain at REDUCE_GRADS(t) and waits for it only at APPLY_UPDATE(t) (in
2BW a microbatch slot or more later, which hides the reductions). The whole chain is issued at
the start, never by polling from the training loop: another stage's update may be waiting for
this rank's part of the chain while this rank's loop is blocked in a transfer that the other
stage only serves after its update. Polling from the loop deadlocks there; so

- on CUDA the three links are launched at once on a side stream, ordered by stream waits;
- on CPU (gloo, whose waits block the host) a daemon worker thread runs the links in order.

Chains run in step order on one stream or one thread, so every group sees its collectives in
the same order on every rank. This is the model the schedule checker proves deadlock-free:
APPLY_UPDATE(t) waits until every stage has run REDUCE_GRADS(t).
"""

from __future__ import annotations

import queue
import threading
from collections import deque

import torch
import torch.distributed as dist


def grad_sumsq(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's part of the squared global gradient norm, shape [1], in fp32."""
    norms = torch._foreach_norm(views) if views else []
    return (torch.stack(norms).float().square().sum() if norms else torch.zeros((), device=device)).reshape(1)


class _Job:
    """One step's chain on the CPU worker: done when ``event`` is set (``error`` if it failed)."""

    def __init__(self, step: int, grad: torch.Tensor, norm_views: list[torch.Tensor]) -> None:
        self.step, self.grad, self.norm_views = step, grad, norm_views
        self.sumsq: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.event = threading.Event()


class GradReducer:
    def __init__(self, *, dp_group, embedding_group, model_group, w: int, shared_range: tuple[int, int] | None,
                 bucket_numel: int, has_embedding_group: bool, device: torch.device | None = None) -> None:
        self.dp_group, self.embedding_group, self.model_group = dp_group, embedding_group, model_group
        self.w, self.shared_range, self.bucket_numel = w, shared_range, max(int(bucket_numel), 1)
        self.use_emb = has_embedding_group and shared_range is not None
        self.cuda = device is not None and device.type == "cuda"
        self._pending: deque[_Job] = deque()
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._jobs: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the chain
    def _chain(self, job: _Job) -> None:
        """Issue the three links; each waits for the previous (a host wait on CPU, a stream wait on CUDA)."""
        grad = job.grad
        if self.w > 1:
            n = grad.numel()
            works = [dist.all_reduce(grad[i:i + self.bucket_numel], group=self.dp_group, async_op=True)
                     for i in range(0, n, self.bucket_numel)]
            for work in works:
                work.wait()
        if self.use_emb:
            lo, hi = self.shared_range
            dist.all_reduce(grad[lo:hi], group=self.embedding_group, async_op=True).wait()
        sumsq = grad_sumsq(job.norm_views, grad.device)
        if self.model_group is not None:
            dist.all_reduce(sumsq, group=self.model_group, async_op=True).wait()
        job.sumsq = sumsq

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._chain(job)
            except BaseException as exc:  # handed to finish() on the training thread
                job.error = exc
            job.event.set()

    # ------------------------------------------------------------------ API
    def start(self, step: int, grad: torch.Tensor, norm_views: list[torch.Tensor]) -> None:
        """Issue step ``step``'s whole chain now; it runs while the training loop goes on."""
        job = _Job(step, grad, norm_views)
        self._pending.append(job)
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(self._stream):
                self._chain(job)
            return
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            # a daemon, so that a rank failing elsewhere never hangs at exit joining it
            self._thread = threading.Thread(target=self._worker, name="grad-reducer", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def finish(self, step: int) -> torch.Tensor:
        """Wait for step ``step``'s chain (the oldest); return the global squared gradient norm, shape [1]."""
        if not self._pending or self._pending[0].step != step:
            oldest = self._pending[0].step if self._pending else None
            raise RuntimeError(f"update of step {step} reached before its reductions (oldest pending: {oldest})")
        job = self._pending.popleft()
        if self.cuda:
            torch.cuda.current_stream(job.grad.device).wait_stream(self._stream)
        else:
            job.event.wait()
            if job.error is not None:
                raise job.error
        return job.sumsq
