"""Runs one pipeline stage's schedule: forward/backward, transfers, reductions and updates.

The executor is a loop over the stage's action list (``schedules.stage_actions``); all ordering
decisions live in the schedule, which the checker verifies. It is model-agnostic: it runs any
ordered list of layers with the signature ``layer(x, batch) -> y`` plus a loss function.

Semantics per schedule:
- flush / gpipe: one weight version, updated in place after every step: W(t+1) = W(t) - lr*g(W(t)).
- 2bw: two versions. Step t runs on W(max(t-1, 0)); APPLY_UPDATE(t) writes
  W(t+1) = W(t) - lr * g_t(W(t-1)) out of place into the buffer that held W(t-1) (free by then),
  so no microbatch ever sees its weights change and no weights are copied.
Every schedule unscales, checks for inf/NaN and clips by the global norm; an overflow skips the
update on every rank (all ranks see the same global norm).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config import OptimizerConfig, PipelineConfig
from ..optimizer.flat import build_optimizer
from ..optimizer.loss_scaler import build_scaler
from ..parallel_state import ParallelState
from ..tensor_parallel.random import RNGTracker
from .accounting import SavedBytes, StageStats
from .actions import Op
from .grad_reducer import GradReducer
from .grouping import comm_groups
from .p2p import P2P
from .recompute import RNGSnapshot
from .schedules import stage_actions
from .weights import StageWeights


@dataclass
class StepResult:
    step: int
    loss: float | None  # mean loss of this replica's m microbatches (last stage only)
    grad_norm: float  # global, unscaled, before clipping
    skipped: bool  # overflow: the update was skipped on every rank
    loss_scale: float
    lr: float


def _run(layers: nn.ModuleList, batch: dict, x):
    for layer in layers:
        x = layer(x, batch)
    return x


class PipelineStage:
    def __init__(
        self, build: Callable[[], list[nn.Module]], loss_fn: Callable, state: ParallelState,
        pipe: PipelineConfig, opt: OptimizerConfig, act_shape: tuple[int, ...], *,
        rng_tracker: RNGTracker | None = None,
    ) -> None:
        pipe.check_depth(state.d)
        self.state, self.pipe, self.opt, self.loss_fn, self.rng = state, pipe, opt, loss_fn, rng_tracker
        self.two_versions = pipe.schedule == "2bw"
        dtype = opt.torch_dtype
        self.weights = StageWeights(
            build, num_versions=2 if self.two_versions else 1, dtype=dtype, device=state.device,
            tp_rank=state.tp_rank, count_shared_in_norm=state.is_first_stage, master_fp32=dtype != torch.float32,
        )
        self.optimizer = build_optimizer(opt, self.weights.numel, self.weights.n_decay, state.device)
        self.scaler = build_scaler(opt)
        self.p2p = P2P(state.prev_rank, state.next_rank, act_shape, dtype, state.device, mode=pipe.p2p_mode)
        bucket = int(opt.dp_bucket_mb * 2**20) // torch.finfo(dtype).bits * 8
        self.reducer = GradReducer(
            dp_group=state.dp_group, embedding_group=state.embedding_group, model_group=state.model_group,
            w=state.w, shared_range=self.weights.shared_range, bucket_numel=bucket,
            has_embedding_group=state.d > 1 and state.embedding_group is not None, device=state.device,
        )
        self.saved = SavedBytes(self.weights.storages)
        self.stats = StageStats(
            stage=state.pp_rank, weight_versions=self.weights.num_versions, weight_bytes=self.weights.weight_bytes,
            grad_bytes=self.weights.grad_bytes,
            optimizer_bytes=sum(t.numel() * t.element_size() for t in self.optimizer.state_dict().values() if isinstance(t, torch.Tensor)),
        )
        self.step = 0  # updates applied so far: the newest version is W(step)
        self.inject_inf_steps: set[int] = set()  # fault injection for tests: poison these steps' gradients
        self._stash: dict[int, tuple] = {}
        self._out: dict[int, torch.Tensor] = {}
        self._in_act: dict[int, torch.Tensor] = {}
        self._in_grad: dict[int, torch.Tensor] = {}
        self._grad_out: dict[int, torch.Tensor] = {}
        self._step_scale: dict[int, float] = {}
        self._loss_sum: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ views
    @property
    def newest_layers(self) -> nn.ModuleList:
        """The newest weights W(step): what evaluation and checkpoints see."""
        return self.weights.slots[self.weights.slot(self.step) if self.two_versions else 0]

    def _slot(self, version: int) -> int:
        return self.weights.slot(version) if self.two_versions else 0

    # ------------------------------------------------------------------ training
    def train(self, num_steps: int, get_batch: Callable[[int], dict], lr_fn: Callable[[int], float]) -> list[StepResult]:
        """Run steps ``self.step .. self.step + num_steps - 1`` and drain; returns their results."""
        s = self.state
        actions = stage_actions(self.pipe.schedule, s.d, s.pp_rank, self.pipe.num_microbatches, self.step, num_steps)
        results: list[StepResult] = []
        for layer_list in self.weights.slots:
            layer_list.train()
        if self.p2p.grouped:
            groups, recv_idx = comm_groups(actions), []
        else:
            groups = {}
            recv_idx = [i for i, a in enumerate(actions) if a.op in (Op.RECV_ACT, Op.RECV_GRAD)]
            # keep the next receives of each kind posted (gloo); the executor's prefetch below is the fallback
            self.p2p.plan([("act" if actions[i].op is Op.RECV_ACT else "grad", actions[i].mb) for i in recv_idx])
        ahead = 0  # receives posted so far (prefetch: the next receive of the list is always posted)
        i, n = 0, len(actions)
        while i < n:
            end = groups.get(i)
            if end is not None:
                self._exchange(actions[i:end])
                i = end
                continue
            a = actions[i]
            while ahead < len(recv_idx) and recv_idx[ahead] <= i + 1:
                b = actions[recv_idx[ahead]]
                self.p2p.post_recv("act" if b.op is Op.RECV_ACT else "grad", b.mb)
                ahead += 1
            op = a.op
            if op is Op.FORWARD:
                self._forward(a, get_batch)
            elif op is Op.BACKWARD:
                self._backward(a)
            elif op is Op.RECV_ACT:
                self._in_act[a.mb] = self.p2p.recv("act", a.mb)
            elif op is Op.SEND_ACT:
                self.p2p.send("act", self._out.pop(a.mb))
            elif op is Op.RECV_GRAD:
                self._in_grad[a.mb] = self.p2p.recv("grad", a.mb)
            elif op is Op.SEND_GRAD:
                self.p2p.send("grad", self._grad_out.pop(a.mb))
            elif op is Op.REDUCE_GRADS:
                self._reduce(a.step)
            elif op is Op.APPLY_UPDATE:
                results.append(self._apply(a.step, lr_fn(a.step)))
            i += 1
        self.p2p.drain()
        if self.state.device.type == "cuda":
            self.stats.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.state.device)
        return results

    def _exchange(self, acts) -> None:
        """One group of transfers with one peer (grouped mode): issued together, waited together."""
        sends = [("act", self._out.pop(a.mb)) if a.op is Op.SEND_ACT else ("grad", self._grad_out.pop(a.mb))
                 for a in acts if a.op is Op.SEND_ACT or a.op is Op.SEND_GRAD]
        recvs = [a for a in acts if a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD]
        got = self.p2p.exchange(sends, [("act" if a.op is Op.RECV_ACT else "grad", a.mb) for a in recvs])
        for a, buf in zip(recvs, got):
            (self._in_act if a.op is Op.RECV_ACT else self._in_grad)[a.mb] = buf

    def _forward(self, a, get_batch) -> None:
        layers = self.weights.slots[self._slot(a.version)]
        batch = get_batch(a.mb)
        x = self._in_act.pop(a.mb, None)
        recompute, last = self.pipe.recompute, self.state.is_last_stage
        if x is not None and not recompute:
            x.requires_grad_(True)
        snap = RNGSnapshot(self.state.device, self.rng) if recompute else None
        measure = self.saved.measure() if self.pipe.track_memory and not recompute else contextlib.nullcontext()
        with measure, (torch.no_grad() if recompute else contextlib.nullcontext()):
            out = _run(layers, batch, x)
            loss = self.loss_fn(out, batch) if last else None
        nbytes = self.saved.bytes if self.pipe.track_memory and not recompute else 0
        if recompute and x is not None:
            nbytes = x.numel() * x.element_size()
        if last:
            acc = self._loss_sum.get(a.step)
            self._loss_sum[a.step] = loss.detach().float() if acc is None else acc + loss.detach().float()
        else:
            self._out[a.mb] = out
        self._stash[a.mb] = (x, None if recompute else (loss if last else out), batch, snap, nbytes, a.version)
        self._account()

    def _account(self) -> None:
        st = self.stats
        st.max_inflight = max(st.max_inflight, len(self._stash))
        st.stashed_bytes = sum(v[4] for v in self._stash.values())
        st.peak_stashed_bytes = max(st.peak_stashed_bytes, st.stashed_bytes)
        live = {v[5] for v in self._stash.values()} | {self.step}
        st.max_live_versions = max(st.max_live_versions, len(live))

    def _backward(self, a) -> None:
        x, out, batch, snap, _, version = self._stash.pop(a.mb)
        slot = self._slot(version)
        self.weights.point_grads(slot, self.weights.grad_buffer(a.step))
        if a.step not in self._step_scale:  # one loss scale for the whole step, on every stage
            self._step_scale[a.step] = self.scaler.scale
        last = self.state.is_last_stage
        if snap is not None:  # recompute this stage's forward, replaying its dropout masks
            now = RNGSnapshot(self.state.device, self.rng)
            snap.restore(self.state.device, self.rng)
            if x is not None:
                x = x.detach().requires_grad_(True)
            measure = self.saved.measure() if self.pipe.track_memory else contextlib.nullcontext()
            with measure:
                out = _run(self.weights.slots[slot], batch, x)
                if last:
                    out = self.loss_fn(out, batch)
            if self.pipe.track_memory:
                st = self.stats
                st.peak_stashed_bytes = max(st.peak_stashed_bytes, st.stashed_bytes + self.saved.bytes)
            now.restore(self.state.device, self.rng)
        if last:
            mult = self._step_scale[a.step] / (self.pipe.num_microbatches * self.state.w)
            (out * mult).backward()
        else:
            torch.autograd.backward(out, self._in_grad.pop(a.mb))
        if not self.state.is_first_stage:
            self._grad_out[a.mb] = x.grad
        self._account()

    def _reduce(self, t: int) -> None:
        buf = self.weights.grad_buffer(t)
        grad = self.weights.grad_flat[buf]
        if t in self.inject_inf_steps:
            grad[0] = float("inf")
        self.reducer.start(t, grad, self.weights.norm_views[buf])

    def _apply(self, t: int, lr: float) -> StepResult:
        w = self.weights
        t0 = time.perf_counter()
        sumsq = float(self.reducer.finish(t).item())
        self.stats.update_wait_s += time.perf_counter() - t0
        scale = self._step_scale.pop(t)
        overflow = not math.isfinite(sumsq)
        norm = math.sqrt(sumsq) / scale if not overflow else float("inf")
        buf = w.grad_buffer(t)
        grad = w.grad_flat[buf]
        src, dst = (w.slot(t), w.slot(t + 1)) if self.two_versions else (0, 0)
        if overflow:
            if src != dst:  # W(t+1) = W(t)
                w.flat[dst].copy_(w.flat[src])
        else:
            mult = 1.0 / scale
            if self.opt.clip_grad > 0 and norm > self.opt.clip_grad:
                mult *= self.opt.clip_grad / (norm + 1e-6)
            g32 = grad.float() if grad.dtype != torch.float32 else grad
            g32.mul_(mult)
            if w.master is not None:
                self.optimizer.update(w.master, w.master, g32, lr)
                w.flat[dst].copy_(w.master)
            else:
                self.optimizer.update(w.flat[src], w.flat[dst], g32, lr)
        self.scaler.update(overflow)
        grad.zero_()
        self.step = t + 1
        loss = self._loss_sum.pop(t, None)
        return StepResult(
            t, float(loss.item()) / self.pipe.num_microbatches if loss is not None else None,
            norm, overflow, scale, lr,
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, num_microbatches: int, get_batch: Callable[[int], dict]) -> float | None:
        """Forward-only pass on the newest weights; the mean loss on the last stage (None elsewhere)."""
        layers = self.newest_layers
        layers.eval()
        total = None
        for i in range(num_microbatches):
            batch = get_batch(i)
            x = None if self.state.is_first_stage else self.p2p.recv("act", i)
            out = _run(layers, batch, x)
            if self.state.is_last_stage:
                loss = self.loss_fn(out, batch).float()
                total = loss if total is None else total + loss
            else:
                self.p2p.send("act", out)
        self.p2p.drain()
        layers.train()
        return float(total.item()) / num_microbatches if total is not None else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Both weight versions (2BW), the fp32 master, optimizer and scaler state, and the step."""
        w = self.weights
        return {
            "step": self.step,
            "schedule": self.pipe.schedule,
            "names": w.names,
            "versions": [f.clone() for f in w.flat],
            "master": w.master.clone() if w.master is not None else None,
            "optimizer": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.optimizer.state_dict().items()},
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        w = self.weights
        if sd["names"] != w.names or len(sd["versions"]) != len(w.flat):
            raise ValueError("checkpoint does not match this stage's parameters or schedule")
        for f, saved in zip(w.flat, sd["versions"]):
            f.copy_(saved)
        if w.master is not None and sd["master"] is not None:
            w.master.copy_(sd["master"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scaler.load_state_dict(sd["scaler"])
        self.step = int(sd["step"])
