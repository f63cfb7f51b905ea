"""A stage's update path: loss scale, unscale, inf/NaN skip, clipping, optimizer, fp32 master copy.

The executor calls :meth:`Updater.apply` at APPLY_UPDATE(t) with the global squared gradient
norm its reductions produced; the profiler calls :meth:`Updater.step_alone` to time this same
path on one process. The update is written out of place: W(t+1) goes into buffer
``slot(t + 1)``, which in 2BW held W(t-1) and is free by then, so no in-flight microbatch sees
its weights change. With one version buffer ``slot`` is always 0 and the update is in place.

An overflow (non-finite norm) skips the update on every rank, since every rank sees the same
global norm; the loss scaler then lowers the scale. Each step uses one loss scale on every
stage: the scale current when the step's first backward ran (:meth:`loss_scale`).

With a stale-gradient compensation (:mod:`.compensation`): ``dc`` corrects the unscaled, clipped
gradient with the two versions before the optimizer sees it; ``predict`` keeps the newest weights
in the fp32 master (created in fp32 too) and writes P(W(t+1)) into ``slot(t + 1)`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import OptimizerConfig
from ..optimizer.flat import build_optimizer
from ..optimizer.loss_scaler import build_scaler
from .compensation import check_compensation, dc_correct, predict
from .grad_reducer import grad_sumsq
from .weights import StageWeights


@dataclass(frozen=True)
class Update:
    """What APPLY_UPDATE(t) did."""

    norm: float  # global, unscaled, before clipping (inf on overflow)
    skipped: bool  # overflow: the update was skipped
    loss_scale: float  # the scale step t's gradients carried


class Updater:
    """Owns the optimizer, the loss scaler and the fp32 master copy of a :class:`StageWeights`."""

    def __init__(self, weights: StageWeights, opt: OptimizerConfig, compensation: str = "none",
                 dc_lambda: float = 0.0) -> None:
        self.weights, self.opt = weights, opt
        self.optimizer = build_optimizer(opt, weights.numel, weights.n_decay, weights.device)
        check_compensation(compensation, self.optimizer)
        self.compensation, self.dc_lambda = compensation, dc_lambda
        self.scaler = build_scaler(opt)
        # fp32 master copy of the newest weights when they are kept in lower precision, or when the
        # version buffers hold predicted weights
        keep = weights.dtype != torch.float32 or compensation == "predict"
        self.master = weights.flat[0].float().clone() if keep else None
        self._scales: dict[int, float] = {}  # the loss scale of each step whose backward has begun

    def loss_scale(self, step: int) -> float:
        """The loss scale of ``step``: fixed at the first call for that step, until it is applied."""
        return self._scales.setdefault(step, self.scaler.scale)

    def apply(self, step: int, sumsq: float, lr: float, next_lr: float | None = None) -> Update:
        """Write W(step+1) from W(step) and step ``step``'s (scaled) gradient, then zero that gradient.

        ``sumsq`` is the global squared norm of the scaled gradient (non-finite: overflow).
        ``next_lr``: the learning rate of update step+1, which ``predict`` extrapolates with.
        """
        w = self.weights
        scale = self._scales.pop(step, None)
        scale = self.scaler.scale if scale is None else scale
        overflow = not math.isfinite(sumsq)
        norm = math.sqrt(sumsq) / scale if not overflow else float("inf")
        grad = w.grad_flat[w.grad_buffer(step)]
        src, dst = w.slot(step), w.slot(step + 1)
        if overflow:
            if src != dst and self.compensation != "predict":  # W(t+1) = W(t)
                w.flat[dst].copy_(w.flat[src])
        else:
            self._step(grad, src, dst, self._multiplier(scale, norm), lr)
        if self.compensation == "predict":
            self.write_prediction(dst, lr if next_lr is None else next_lr)
        self.scaler.update(overflow)
        grad.zero_()
        return Update(norm, overflow, scale)

    def _multiplier(self, scale: float, norm: float) -> float:
        """Unscale, and clip by the global norm."""
        mult = 1.0 / scale
        if self.opt.clip_grad > 0 and norm > self.opt.clip_grad:
            mult *= self.opt.clip_grad / (norm + 1e-6)
        return mult

    def _step(self, grad: torch.Tensor, src: int, dst: int, mult: float, lr: float) -> None:
        w = self.weights
        g32 = grad.float() if grad.dtype != torch.float32 else grad
        g32.mul_(mult)
        if self.compensation == "dc" and src != dst:  # flat[dst] still holds W(t-1)
            dc_correct(g32, w.flat[src], w.flat[dst], self.dc_lambda)
        if self.master is not None:
            self.optimizer.update(self.master, self.master, g32, lr)
            if self.compensation != "predict":
                w.flat[dst].copy_(self.master)
        else:
            self.optimizer.update(w.flat[src], w.flat[dst], g32, lr)

    def write_prediction(self, slot: int, lr: float) -> None:
        """Buffer ``slot`` = P(newest weights), the optimizer's predicted next step (:mod:`.compensation`)."""
        predict(self.optimizer, self.master, self.weights.flat[slot], lr)

    def write_newest(self, slot: int) -> None:
        """Buffer ``slot`` = the newest weights (the master's), for evaluation and checkpoints."""
        if self.master is not None:
            self.weights.flat[slot].copy_(self.master)

    def step_alone(self, step: int, lr: float) -> Update:
        """The whole update of one process without reductions: this stage's gradient norm, then :meth:`apply`."""
        w = self.weights
        views = w.norm_views[w.grad_buffer(step)]
        return self.apply(step, float(grad_sumsq(views, w.device).item()), lr)

    # ------------------------------------------------------------------ state
    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state (the master copy not included)."""
        sd = self.optimizer.state_dict()
        return sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))

    @property
    def master_bytes(self) -> int:
        return self.master.numel() * self.master.element_size() if self.master is not None else 0

    def state_dict(self) -> dict:
        """Copies of the master, optimizer and scaler state (keys ``master``, ``optimizer``, ``scaler``)."""
        return {
            "master": self.master.clone() if self.master is not None else None,
            "optimizer": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.optimizer.state_dict().items()},
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if self.master is not None and sd["master"] is not None:
            self.master.copy_(sd["master"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scaler.load_state_dict(sd["scaler"])
