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

Each segment of the stage (:mod:`.segments`, one per reduction domain) has its own optimizer, master and
shard (:class:`~.segment_update.SegmentUpdate`), sharded over its own domain's group; the scale, the skip
and the clip factor are the stage's, one for all. With one segment this is the single-buffer update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import OptimizerConfig
from ..errors import ConfigError
from ..optimizer.loss_scaler import build_scaler
from ..optimizer.state import Span
from .compensation import check_compensation, dc_correct, ef_apply, extrapolate_correct, predict
from .grad_reducer import GradReducer, grad_sumsq
from .segment_update import EXTRAPOLATE, OPT, SegmentUpdate, cut, host, place
from .weights import RankWeights

__all__ = ["EXTRAPOLATE", "EXTRAPOLATE_HAS", "OPT", "Update", "Updater", "host"]
EXTRAPOLATE_HAS = "extrapolate_has_prev"  # --2bw-compensation extrapolate's flag


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
        # one part per segment (:mod:`.segment_update`), each sharded as the reducer reduces its segment
        reds = reducer.segments if reducer is not None else [None] * len(weights.segments)
        if len(reds) != len(weights.segments):
            raise ValueError(f"the reducer reduces {len(reds)} segments, the weights have {len(weights.segments)}")
        sharded = any(r is not None and r.shard is not None for r in reds)
        # the distributed optimizer: the reducer's ordered channel (None: unsharded)
        self.reducer = reducer if sharded else None
        if sharded and compensation == "predict":
            raise ConfigError("--2bw-compensation predict cannot be combined with --use-distributed-optimizer")
        self.parts = [SegmentUpdate(weights, seg, r, reducer, opt, compensation, tp)
                      for seg, r in zip(weights.segments, reds)]
        check_compensation(compensation, self.optimizer)
        if compensation == "predict" and len(self.parts) > 1:
            raise ConfigError("--2bw-compensation predict needs the stage's parameters in one reduction domain")
        self.compensation, self.dc_lambda, self.ef_scale = compensation, dc_lambda, ef_scale
        self.ef_has_prev = False
        self.scaler = build_scaler(opt)
        self._scales: dict[int, float] = {}  # the loss scale of each step whose backward has begun
        self._backup: tuple | None = None  # a speculative update's (step, kept, state): see :meth:`speculate`

    # the first (default domain's) segment's state: the whole stage's when there is one segment
    optimizer = property(lambda self: self.parts[0].optimizer)
    master = property(lambda self: self.parts[0].master)
    shard = property(lambda self: self.parts[0].shard)
    ef_prev = property(lambda self: self.parts[0].ef_prev)
    ef_next = property(lambda self: self.parts[0].ef_next)

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
        if overflow:
            if src != dst and self.compensation != "predict":  # W(t+1) = W(t)
                for p in self.parts:
                    p.weights_of(dst).copy_(p.weights_of(src))
        else:
            self._step(buf, src, dst, self._multiplier(scale, norm), lr)
        if self.reducer is not None and (src != dst or not overflow):  # the other ranks' shards of W(t+1)
            self.reducer.gather(dst, w.padded_flat[dst])
        if self.compensation == "predict":
            self.write_prediction(dst, lr if next_lr is None else next_lr)
        self.scaler.update(overflow)
        w.grad_flat[buf].zero_()
        return Update(norm, overflow, scale)

    # ------------------------------------------------------------------ post-validation
    def _hold(self, slot: int) -> list:
        """Copies of what a speculative update overwrites, per part (the master or the weights, and the
        optimizer state), in buffers reused from one speculated step to the next (12 B/parameter each step
        would otherwise be allocated anew): the first speculation allocates them, later ones copy into them."""
        held = getattr(self, "_held", None)

        def fits(kept: torch.Tensor, st: dict, p) -> bool:
            shapes = {n: [t.shape for _, t in sp] for n, sp in p.optimizer.state_spans().items()}
            held_shapes = {n: [t.shape for t in sp] for n, sp in st["spans"].items()}
            return kept.shape == p.kept(slot).shape and shapes == held_shapes

        if held is not None and all(fits(k, st, p) for (k, st), p in zip(held, self.parts)):
            for (k, st), p in zip(held, self.parts):
                k.copy_(p.kept(slot))
                for n, sp in p.optimizer.state_spans().items():  # restore_snapshot's inverse
                    for (_, t), into in zip(sp, st["spans"][n]):
                        into.copy_(t)
                st["scalars"] = dict(p.optimizer.state_scalars())
            return held
        held = self._held = [(p.kept(slot).clone(), p.optimizer.snapshot()) for p in self.parts]
        return held

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
        held = self._hold(src)
        # (step, kept, state): one segment's copies, or with several a list of each
        self._backup = (step, *held[0]) if len(held) == 1 else (step, [k for k, _ in held], [st for _, st in held])
        scale = self._scales.get(step, self.scaler.scale)
        self._step(w.grad_buffer(step), src, dst, 1.0 / scale, lr, keep_grad=scale != 1.0)
        if self.reducer is not None:
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
        held = [(kept, state)] if len(self.parts) == 1 else list(zip(kept, state))
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
        for p, (kept, state) in zip(self.parts, held):
            if p.master is not None:  # the model-dtype weights are the master's rounding (the invariant apply keeps)
                p.master.copy_(kept)
                p.weights_of(src).copy_(p.master)
            else:
                p.weights_of(src).copy_(kept)
            p.optimizer.restore_snapshot(state)
        if self.reducer is not None and overflow:  # apply re-gathers after a step it takes; a skipped one restores
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

    def _step(self, buf: int, src: int, dst: int, mult: float, lr: float, keep_grad: bool = False) -> None:
        """Every segment's weights in buffer ``dst`` = the optimizer's update of buffer ``src``'s with gradient
        buffer ``buf`` times ``mult`` (this rank's range of each with the distributed optimizer; ``dst`` may be
        ``src``). ``keep_grad``: an fp32 gradient is not unscaled in place (a speculative update's)."""
        has_prev = self.ef_has_prev
        for p in self.parts:
            grad = p.grad_of(buf)
            if keep_grad and grad.dtype == torch.float32:
                grad = grad.clone()
            self._step_part(p, grad, p.weights_of(src), p.weights_of(dst), src != dst, mult, lr, has_prev)
        if self.ef_prev is not None:
            self.ef_has_prev = True

    def _step_part(self, p, grad: torch.Tensor, w_src: torch.Tensor, w_dst: torch.Tensor, two_versions: bool,
                   mult: float, lr: float, has_prev: bool) -> None:
        """One segment's update (see :meth:`_step`)."""
        g32 = grad.float() if grad.dtype != torch.float32 else grad
        g32.mul_(mult)
        if self.compensation == "dc" and two_versions:  # w_dst still holds W(t-1)
            dc_correct(g32, w_src, w_dst, self.dc_lambda)
        if p.ef_prev is not None:
            extrapolate_correct(g32, p.ef_prev, has_prev, self.ef_scale)
        if self.compensation == "ef":  # y(t+1) into the scratch, then x(t+1) and the master from it
            new = p.ef_next if p.ef_next is not None else w_dst
            first = p.optimizer.steps == 0  # the first update is applied uncorrected
            p.optimizer.update(p.master, new, g32, lr)
            ef_apply(p.master, new, w_dst, self.ef_scale, first)
        elif p.master is not None:
            p.optimizer.update(p.master, p.master, g32, lr)
            if self.compensation != "predict":
                w_dst.copy_(p.master)
        else:
            p.optimizer.update(w_src, w_dst, g32, lr)

    def write_prediction(self, slot: int, lr: float) -> None:
        """Buffer ``slot`` = P(newest weights), the optimizer's predicted next step (:mod:`.compensation`)."""
        p = self.parts[0]  # predict runs on stages of one segment (refused otherwise)
        predict(p.optimizer, p.master, p.weights_of(slot), lr)

    def write_newest(self, slot: int) -> None:
        """Buffer ``slot`` = the newest weights (the master's), for evaluation and checkpoints."""
        for p in self.parts:
            if p.master is not None:
                p.weights_of(slot).copy_(p.master)

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
        :meth:`~..optimizer.state.FlatState.state_spans`) and ``optimizer.extrapolate_prev_grad``; of the
        first segment (:attr:`parts` states each segment's: the one description both checkpoint formats read)."""
        return self.parts[0].state_spans()

    def state_scalars(self) -> dict:
        """The optimizer's scalars (``steps``) and whether ``extrapolate`` holds a previous gradient."""
        out = dict(self.optimizer.state_scalars())
        if self.ef_prev is not None:
            out[EXTRAPOLATE_HAS] = bool(self.ef_has_prev)
        return out

    def load_scalars(self, sd: dict) -> None:
        for p in self.parts:
            p.optimizer.load_scalars(sd)
        if self.ef_prev is not None:  # a state without it (another compensation's) starts afresh
            self.ef_has_prev = bool(sd.get(EXTRAPOLATE_HAS, False))

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state (the master copy not included), with ``extrapolate``'s previous gradient
        and ``ef``'s scratch buffer (in fp32 ``ef``'s extra buffer is the master: :attr:`master_bytes`)."""
        def part(p) -> int:
            ef = p.ef_next.numel() * 4 if p.ef_next is not None else 0
            spans = [t for k, s in p.state_spans().items() if k != "master" for _, t in s]
            return ef + sum(t.numel() * t.element_size() for t in spans)

        return sum(part(p) for p in self.parts)

    @property
    def master_bytes(self) -> int:
        """Bytes of the fp32 master copy (this rank's shard with the distributed optimizer)."""
        return sum(p.master.numel() * p.master.element_size() for p in self.parts if p.master is not None)

    def state_dict(self, everywhere: bool = True, copy: bool = True, skip: frozenset[int] = frozenset()) -> dict:
        """The master, optimizer and scaler state (keys ``master``, ``optimizer``, ``scaler``) on the CPU, in
        the unsharded layout (whole stage tensors, zeros between segments); with the distributed optimizer
        every rank of each segment's domain must call it, and with ``everywhere`` False only data-parallel
        rank 0 receives the gathered tensors (None elsewhere).

        ``copy`` True: a snapshot. ``copy`` False (a save that writes before training goes on): the live
        tensors where they are on the CPU already. Never a copy on the device (gpu-review C4).

        ``skip``: segments (of several) neither gathered nor copied, left zeros: a caller that gathers them
        itself (the torch format's expert stacks at expert-parallel size > 1) would otherwise gather them twice."""
        if self.reducer is not None:
            self.reducer.wait_all()  # no all-gather may be left running beside the state's gather
        skip = skip if len(self.parts) > 1 else frozenset()
        fulls = [None if i in skip else p.full(everywhere, copy) for i, p in enumerate(self.parts)]
        keys = next(f for f in fulls if f is not None)
        full = {k: place(self.parts, [None if f is None else f[k] for f in fulls], self.weights.numel, skip)
                for k in keys}
        return {
            "master": full.get("master"),
            "optimizer": {**{k[len(OPT):]: v for k, v in full.items() if k.startswith(OPT)}, **self.state_scalars()},
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Load an unsharded state (this rank's shard of it when sharded); a None ``optimizer`` or ``scaler``
        keeps the current (fresh) one."""
        if self.master is not None and sd.get("master") is not None:
            for p, piece in zip(self.parts, cut(self.parts, sd["master"])):
                p.load("master", piece)
        if sd.get("optimizer") is not None:
            state = sd["optimizer"]
            for name in self.state_spans():
                key = name[len(OPT):]
                if name.startswith(OPT) and not (key == EXTRAPOLATE and state.get(key) is None):
                    for p, piece in zip(self.parts, cut(self.parts, state[key])):
                        p.load(name, piece)
            self.load_scalars(state)
            if self.ef_prev is not None and state.get(EXTRAPOLATE) is None:
                self.ef_has_prev = False
        if sd.get("scaler") is not None:
            self.scaler.load_state_dict(sd["scaler"])

    def master_from(self, slot: int) -> None:
        """Set the master (if any) from weight buffer ``slot`` (this rank's range of it when sharded)."""
        for p in self.parts:
            if p.master is not None:
                p.master.copy_(p.weights_of(slot))
