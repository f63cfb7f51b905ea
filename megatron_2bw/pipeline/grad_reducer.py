"""The reductions between a step's last backward and its update, run as an asynchronous chain.

For step t the chain is: (1) all-reduce the gradient across data-parallel replicas, in buckets;
(2) all-reduce the tied word-embedding gradient between the first and last stage; (3) all-reduce
the squared gradient norm over the model group (all stages and tensor ranks of one replica).
A non-finite total means overflow: every rank sees the same total, so every rank skips the same
step. The executor launches the chain at REDUCE_GRADS(t) and calls ``progress()`` between
actions, so each link starts as soon as the previous one is done, while compute goes on; it
waits only at APPLY_UPDATE(t). In 2BW that is a microbatch slot or more later, which hides the
reductions. Chains of consecutive steps advance in step order, so every group sees its
collectives in the same order on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_PHASES = ("dp", "emb", "norm", "done")
_DONE = len(_PHASES) - 1


class _Chain:
    def __init__(self, step: int, grad: torch.Tensor, norm_views: list[torch.Tensor]):
        self.step, self.grad, self.norm_views = step, grad, norm_views
        self.phase = -1
        self.works: list = []
        self.sumsq: torch.Tensor | None = None


class GradReducer:
    def __init__(self, *, dp_group, embedding_group, model_group, w: int, shared_range: tuple[int, int] | None,
                 bucket_numel: int, has_embedding_group: bool) -> None:
        self.dp_group, self.embedding_group, self.model_group = dp_group, embedding_group, model_group
        self.w, self.shared_range, self.bucket_numel = w, shared_range, max(int(bucket_numel), 1)
        self.use_emb = has_embedding_group and shared_range is not None
        self.chains: list[_Chain] = []

    def start(self, step: int, grad: torch.Tensor, norm_views: list[torch.Tensor]) -> None:
        self.chains.append(_Chain(step, grad, norm_views))
        self.progress()

    def _launch(self, c: _Chain) -> None:
        name = _PHASES[c.phase]
        if name == "dp" and self.w > 1:
            n = c.grad.numel()
            c.works = [
                dist.all_reduce(c.grad[i:i + self.bucket_numel], group=self.dp_group, async_op=True)
                for i in range(0, n, self.bucket_numel)
            ]
        elif name == "emb" and self.use_emb:
            lo, hi = self.shared_range
            c.works = [dist.all_reduce(c.grad[lo:hi], group=self.embedding_group, async_op=True)]
        elif name == "norm":
            norms = torch._foreach_norm(c.norm_views) if c.norm_views else []
            c.sumsq = (torch.stack(norms).float().square().sum() if norms else torch.zeros((), device=c.grad.device)).reshape(1)
            c.works = [dist.all_reduce(c.sumsq, group=self.model_group, async_op=True)] if self.model_group is not None else []
        else:
            c.works = []

    def _advance(self, c: _Chain, limit: int, block: bool) -> None:
        while c.phase < limit:
            if c.works:
                if not block and not all(w.is_completed() for w in c.works):
                    return
                for w in c.works:
                    w.wait()
                c.works = []
            c.phase += 1
            if c.phase < _DONE:
                self._launch(c)

    def progress(self) -> None:
        """Advance every chain as far as finished work allows; a later chain never passes an earlier one."""
        limit = _DONE
        for c in self.chains:
            self._advance(c, limit, block=False)
            limit = c.phase

    def finish(self, step: int) -> torch.Tensor:
        """Wait for step ``step``'s chain (the oldest); return the global squared gradient norm, shape [1]."""
        c = self.chains[0]
        if c.step != step:
            raise RuntimeError(f"update of step {step} reached before its reductions (oldest pending: {c.step})")
        self._advance(c, _DONE, block=True)
        self.chains.pop(0)
        return c.sumsq
