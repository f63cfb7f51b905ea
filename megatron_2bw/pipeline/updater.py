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
gradient with the two versions before the optimizer sees it, ``extrapolate`` with the previous step's;
``predict`` keeps the newest weights in the fp32 master (created in fp32 too) and writes P(W(t+1))
into ``slot(t + 1)`` instead; ``ef`` keeps the optimizer's iterate y in the master (created in fp32
too), steps it out of place into a scratch buffer and writes the corrected x(t+1) into ``slot(t + 1)``.

With the distributed optimizer (a reducer with a :class:`~.zero.ShardLayout`, data-parallel
width > 1) the master and the optimizer state cover this rank's shard only: the update reads the
shard's reduced gradient, writes the shard of W(t+1) into ``slot(t + 1)`` and starts the
all-gather of the other shards into that buffer without waiting for it (2BW first reads W(t+1) a
step later; the executor waits before the first forward on it). ``state_dict`` gathers the shards
into the unsharded format (a collective over the data-parallel group); ``load_state_dict`` takes
this rank's shard of an unsharded state, so checkpoints load at any width, sharded or not.
``predict`` is refused with it: its prediction buffers would need an all-gather at every drain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import OptimizerConfig
from ..errors import ConfigError
from ..optimizer.build import build_optimizer
from ..optimizer.loss_scaler import build_scaler
from ..optimizer.muon import MuonMatrix
from ..optimizer.state import Span, load_whole, whole
from .compensation import check_compensation, dc_correct, ef_apply, extrapolate_correct, predict
from .grad_reducer import GradReducer, grad_sumsq
from .weights import RankWeights
from .zero import gather_full


OPT = "optimizer."  # checkpoint names of the optimizer's state: optimizer.exp_avg, ...
EXTRAPOLATE, EXTRAPOLATE_HAS = "extrapolate_prev_grad", "extrapolate_has_prev"  # --2bw-compensation extrapolate's


def host(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``t`` in host memory without a device-side copy: copied straight to the CPU, or (``copy`` False)
    ``t`` itself when it is there already."""
    return t.to("cpu", copy=copy)


@dataclass(frozen=True)
class Update:
    """What APPLY_UPDATE(t) did."""

    norm: float  # global, unscaled, before clipping (inf on overflow)
    skipped: bool  # overflow: the update was skipped
    loss_scale: float  # the scale step t's gradients carried


class Updater:
    """Owns the optimizer, the loss scaler and the fp32 master copy of a :class:`RankWeights`."""

    def __init__(self, weights: RankWeights, opt: OptimizerConfig, compensation: str = "none",
                 dc_lambda: float = 0.0, reducer: GradReducer | None = None,
                 tp: tuple[object, int, int] = (None, 0, 1), ef_scale: float = 1.0) -> None:
        self.weights, self.opt = weights, opt
        # the distributed optimizer: the reducer's shard layout and ordered channel (None: unsharded)
        self.reducer = reducer if reducer is not None and reducer.shard is not None else None
        self.shard = self.reducer.shard if self.reducer is not None else None
        if self.shard is not None and compensation == "predict":
            raise ConfigError("--2bw-compensation predict cannot be combined with --use-distributed-optimizer")
        numel, n_decay = (self.shard.size, self.shard.decay_prefix(weights.n_decay)) if self.shard is not None \
            else (weights.numel, weights.n_decay)
        self.optimizer = build_optimizer(opt, numel, n_decay, weights.device,
                                         muon=self._muon_layout(tp) if opt.optimizer == "muon" else None)
        check_compensation(compensation, self.optimizer)
        self.compensation, self.dc_lambda, self.ef_scale = compensation, dc_lambda, ef_scale
        # extrapolate: the previous applied step's unscaled, clipped gradient (this rank's shard), fp32
        self.ef_prev = torch.zeros(numel, dtype=torch.float32, device=weights.device) \
            if compensation == "extrapolate" else None
        self.ef_has_prev = False
        self.scaler = build_scaler(opt)
        # fp32 master copy of the newest weights (of this rank's shard) when they are kept in lower
        # precision, or when the version buffers hold predicted (predict) or corrected (ef) weights
        keep = weights.dtype != torch.float32 or compensation in ("predict", "ef")
        self.master = self._weights(0).to(torch.float32, copy=True) if keep else None
        # ef: the scratch y(t+1) is written into before the correction (fp32 uses the free version buffer)
        self.ef_next = torch.empty(numel, dtype=torch.float32, device=weights.device) \
            if compensation == "ef" and weights.dtype != torch.float32 else None
        self._scales: dict[int, float] = {}  # the loss scale of each step whose backward has begun
        self._backup: tuple[int, torch.Tensor, dict] | None = None  # a speculative update's (step, weights, state)

    def _muon_layout(self, tp: tuple[object, int, int]) -> dict:
        """What :class:`~..optimizer.muon.FlatMuon` needs to know about the stage: its matrices (in
        stage coordinates), the tensor-parallel group, and this rank's shard and its gather."""
        w = self.weights
        matrices = [MuonMatrix(o, tuple(shape), dim if split and tp[2] > 1 else None)
                    for o, shape, dim, split in zip(w.offsets, w.shapes, w.partition_dims, w.tp_split)
                    if dim is not None]
        kw = {"matrices": matrices, "total": w.numel, "tp": tp, "n_decay": w.n_decay}
        if self.shard is not None:
            kw.update(lo=self.shard.lo, gather=self.reducer.gather_shards,
                      bounds=[self.shard.bounds(r) for r in range(self.shard.w)])
        return kw

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
        buf, src, dst = w.grad_buffer(step), w.slot(step), w.slot(step + 1)
        grad, w_src, w_dst = self._grad(buf), self._weights(src), self._weights(dst)
        if overflow:
            if src != dst and self.compensation != "predict":  # W(t+1) = W(t)
                w_dst.copy_(w_src)
        else:
            self._step(grad, w_src, w_dst, src != dst, self._multiplier(scale, norm), lr)
        if self.shard is not None and (src != dst or not overflow):  # the other ranks' shards of W(t+1)
            self.reducer.gather(dst, w.padded_flat[dst])
        if self.compensation == "predict":
            self.write_prediction(dst, lr if next_lr is None else next_lr)
        self.scaler.update(overflow)
        w.grad_flat[buf].zero_()
        return Update(norm, overflow, scale)

    # ------------------------------------------------------------------ post-validation
    def speculate(self, step: int, lr: float) -> None:
        """Apply step ``step``'s update as :meth:`apply` would if the global norm neither overflows nor clips,
        before that norm is known (optimizer post-validation), keeping a copy of what it overwrites: the
        newest weights (the fp32 master where there is one) and the optimizer state, this rank's shard of
        each with the distributed optimizer. The gradient stays in its buffer and the loss scaler unchanged
        until :meth:`validate` settles the step. One weight version: the update is in place."""
        w = self.weights
        src, dst = w.slot(step), w.slot(step + 1)
        if src != dst:
            raise RuntimeError("a speculative update needs a one-version schedule")
        kept = self.master if self.master is not None else self._weights(src)
        # the copies are kept in buffers reused from one speculated step to the next (12 B/parameter each step
        # would otherwise be allocated anew): the first speculation allocates them, later ones copy into them
        held, spans = getattr(self, "_held", None), self.optimizer.state_spans()
        if held is None or held[0].shape != kept.shape or {k: [t.shape for _, t in s] for k, s in spans.items()} \
                != {k: [t.shape for t in s] for k, s in held[1]["spans"].items()}:
            held = self._held = (kept.clone(), self.optimizer.snapshot())
        else:
            held[0].copy_(kept)
            for k, s in spans.items():  # restore_snapshot's inverse
                for (_, t), into in zip(s, held[1]["spans"][k]):
                    into.copy_(t)
            held[1]["scalars"] = dict(self.optimizer.state_scalars())
        self._backup = (step, *held)
        scale = self._scales.get(step, self.scaler.scale)
        grad = self._grad(w.grad_buffer(step))
        if scale != 1.0 and grad.dtype == torch.float32:  # _step unscales in place: keep the gradient as it was
            grad = grad.clone()
        self._step(grad, self._weights(src), self._weights(dst), False, 1.0 / scale, lr)
        if self.shard is not None:
            self.reducer.gather(dst, w.padded_flat[dst])

    @property
    def speculating(self) -> int | None:
        """The step whose update :meth:`speculate` applied and :meth:`validate` has not settled, or None."""
        return self._backup[0] if self._backup is not None else None

    def validate(self, step: int, sumsq: float, lr: float) -> tuple[Update, bool]:
        """Settle the speculative update of ``step`` with the global squared norm ``sumsq``: kept where the norm
        neither overflowed nor clipped (what :meth:`apply` would have written, bitwise: the same multiplier),
        else rolled back and applied exactly. Returns what the update did and whether it was rolled back."""
        if self.speculating != step:
            raise RuntimeError(f"validating step {step} but the speculative update is of step {self.speculating}")
        _, kept, state = self._backup
        self._backup = None
        scale = self._scales.get(step, self.scaler.scale)
        overflow = not math.isfinite(sumsq)
        norm = math.sqrt(sumsq) / scale if not overflow else float("inf")
        if not overflow and not self.clips(norm):
            self._scales.pop(step, None)
            self.scaler.update(False)
            self.weights.grad_flat[self.weights.grad_buffer(step)].zero_()
            return Update(norm, False, scale), False
        src = self.weights.slot(step)
        if self.master is not None:  # the model-dtype weights are the master's rounding (the invariant apply keeps)
            self.master.copy_(kept)
            self._weights(src).copy_(self.master)
        else:
            self._weights(src).copy_(kept)
        self.optimizer.restore_snapshot(state)
        if self.shard is not None and overflow:  # apply re-gathers after a step it takes; a skipped one restores
            self.reducer.gather(src, self.weights.padded_flat[src])
        return self.apply(step, sumsq, lr), True

    def clips(self, norm: float) -> bool:
        """Whether an unscaled global norm ``norm`` is clipped (``--clip-grad``)."""
        return self.opt.clip_grad > 0 and norm > self.opt.clip_grad

    def _multiplier(self, scale: float, norm: float) -> float:
        """Unscale, and clip by the global norm."""
        mult = 1.0 / scale
        if self.clips(norm):
            mult *= self.opt.clip_grad / (norm + 1e-6)
        return mult

    def _step(self, grad: torch.Tensor, w_src: torch.Tensor, w_dst: torch.Tensor, two_versions: bool, mult: float,
              lr: float) -> None:
        """``w_dst`` = the optimizer's update of ``w_src`` with ``grad`` (this rank's range of each with the
        distributed optimizer, the whole buffers otherwise; ``w_dst`` may be ``w_src``)."""
        g32 = grad.float() if grad.dtype != torch.float32 else grad
        g32.mul_(mult)
        if self.compensation == "dc" and two_versions:  # w_dst still holds W(t-1)
            dc_correct(g32, w_src, w_dst, self.dc_lambda)
        if self.ef_prev is not None:
            extrapolate_correct(g32, self.ef_prev, self.ef_has_prev, self.ef_scale)
            self.ef_has_prev = True
        if self.compensation == "ef":  # y(t+1) into the scratch, then x(t+1) and the master from it
            new = self.ef_next if self.ef_next is not None else w_dst
            first = self.optimizer.steps == 0  # the first update is applied uncorrected
            self.optimizer.update(self.master, new, g32, lr)
            ef_apply(self.master, new, w_dst, self.ef_scale, first)
        elif self.master is not None:
            self.optimizer.update(self.master, self.master, g32, lr)
            if self.compensation != "predict":
                w_dst.copy_(self.master)
        else:
            self.optimizer.update(w_src, w_dst, g32, lr)

    def _weights(self, slot: int) -> torch.Tensor:
        """Weight buffer ``slot``: this rank's range of it with the distributed optimizer (a view)."""
        w = self.weights
        return w.flat[slot] if self.shard is None else self.shard.own(w.padded_flat[slot])

    def _grad(self, buf: int) -> torch.Tensor:
        """Gradient buffer ``buf``: this rank's (reduce-scattered) range of it with the distributed optimizer."""
        w = self.weights
        return w.grad_flat[buf] if self.shard is None else self.shard.own(w.padded_grad[buf])

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
    def state_spans(self) -> dict[str, list[Span]]:
        """Every per-parameter state this rank checkpoints, by its checkpoint name, as live spans in the
        optimizer's coordinates (this rank's shard with the distributed optimizer): ``master`` (the fp32
        master: the newest weights, or ``ef``'s iterate y), ``optimizer.KEY`` (the optimizer's own
        :meth:`~..optimizer.state.FlatState.state_spans`) and ``optimizer.extrapolate_prev_grad``. The one
        description both checkpoint formats (and :attr:`state_bytes`) read."""
        out = {"master": [(0, self.master)]} if self.master is not None else {}
        out.update({f"{OPT}{k}": s for k, s in self.optimizer.state_spans().items()})
        if self.ef_prev is not None:  # extrapolate's previous gradient: per parameter, kept by name too
            out[f"{OPT}{EXTRAPOLATE}"] = [(0, self.ef_prev)]
        return out

    def state_scalars(self) -> dict:
        """The optimizer's scalars (``steps``) and whether ``extrapolate`` holds a previous gradient."""
        out = dict(self.optimizer.state_scalars())
        if self.ef_prev is not None:
            out[EXTRAPOLATE_HAS] = bool(self.ef_has_prev)
        return out

    def load_scalars(self, sd: dict) -> None:
        self.optimizer.load_scalars(sd)
        if self.ef_prev is not None:  # a state without it (another compensation's) starts afresh
            self.ef_has_prev = bool(sd.get(EXTRAPOLATE_HAS, False))

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state (the master copy not included), with ``extrapolate``'s previous gradient
        and ``ef``'s scratch buffer (in fp32 ``ef``'s extra buffer is the master: :attr:`master_bytes`)."""
        ef = self.ef_next.numel() * 4 if self.ef_next is not None else 0
        return ef + sum(t.numel() * t.element_size() for k, s in self.state_spans().items() if k != "master" for _, t in s)

    @property
    def master_bytes(self) -> int:
        """Bytes of the fp32 master copy (this rank's shard with the distributed optimizer)."""
        return self.master.numel() * self.master.element_size() if self.master is not None else 0

    def _full(self, t: torch.Tensor, everywhere: bool, copy: bool) -> torch.Tensor | None:
        """The whole-buffer ``t`` in host memory: gathered from every rank's shard (a collective) when
        sharded; otherwise a host copy, or (``copy`` False) ``t`` itself when it is on the CPU already."""
        return host(t, copy) if self.shard is None else gather_full(t, self.shard, self.reducer.dp_group, everywhere)

    def state_dict(self, everywhere: bool = True, copy: bool = True) -> dict:
        """The master, optimizer and scaler state (keys ``master``, ``optimizer``, ``scaler``) on the CPU, in
        the unsharded layout; with the distributed optimizer every data-parallel rank must call it, and
        with ``everywhere`` False only data-parallel rank 0 receives the gathered tensors (None elsewhere).

        ``copy`` True: a snapshot. ``copy`` False (a save that writes before training goes on): the live
        tensors where they are on the CPU already. Never a copy on the device (gpu-review C4)."""
        if self.reducer is not None:
            self.reducer.wait_all()  # no all-gather may be left running beside the state's gather
        n, spans = self.optimizer.numel, self.state_spans()
        full = {k: self._full(whole(s, n), everywhere, copy) for k, s in spans.items()}
        return {
            "master": full.get("master"),
            "optimizer": {**{k[len(OPT):]: v for k, v in full.items() if k.startswith(OPT)}, **self.state_scalars()},
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Load an unsharded state (this rank's shard of it when sharded); a None ``optimizer`` or ``scaler``
        keeps the current (fresh) one."""
        take = (lambda t: t) if self.shard is None else (lambda t: self.shard.take(t, torch.float32))
        spans = self.state_spans()
        if self.master is not None and sd.get("master") is not None:
            load_whole(spans["master"], take(sd["master"]))
        if sd.get("optimizer") is not None:
            state = sd["optimizer"]
            for name, s in spans.items():
                key = name[len(OPT):]
                if name.startswith(OPT) and not (key == EXTRAPOLATE and state.get(key) is None):
                    load_whole(s, take(state[key]))
            self.load_scalars(state)
            if self.ef_prev is not None and state.get(EXTRAPOLATE) is None:
                self.ef_has_prev = False
        if sd.get("scaler") is not None:
            self.scaler.load_state_dict(sd["scaler"])

    def master_from(self, slot: int) -> None:
        """Set the master (if any) from weight buffer ``slot`` (this rank's range of it when sharded)."""
        if self.master is not None:
            self.master.copy_(self._weights(slot))
