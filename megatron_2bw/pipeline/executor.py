"""Runs one pipeline stage's schedule: forward/backward, transfers, reductions and updates.

The executor is a loop over the stage's action list (``schedules.program`` of its resolved spec); all ordering
decisions live in the schedule, which the checker verifies. It is model-agnostic: it runs any
ordered list of layers with the signature ``layer(x, batch) -> y`` plus a loss function. Who
talks to whom and how is the :class:`~.transport.Transport`'s business; the update rule is the
:class:`~.updater.Updater`'s.

Semantics per schedule:
- flush / gpipe: one weight version, updated in place after every step: W(t+1) = W(t) - lr*g(W(t)).
- 2bw: two versions. Step t runs on W(max(t-1, 0)); APPLY_UPDATE(t) writes
  W(t+1) = W(t) - lr * g_t(W(t-1)) out of place into the buffer that held W(t-1) (free by then),
  so no microbatch ever sees its weights change and no weights are copied. With
  ``--2bw-compensation`` (see :mod:`.compensation`) the buffer of version v holds the prediction
  P(W(v)) during training (``predict``) or the gradient is corrected (``dc``).
Every schedule unscales, checks for inf/NaN and clips by the global norm; an overflow skips the
update on every rank (all ranks see the same global norm).

Optimizer post-validation (``--enable-optimizer-post-validation``; a program with VALIDATE actions) is
:mod:`.speculation`. The rank's collaborators are built by :func:`.build.build_stage` and handed in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..config import OptimizerConfig, PipelineConfig
from ..parallel_state import ParallelState
from ..schedule.actions import Action, Op
from ..schedule.evaluation import evaluation_program
from ..schedule.schedules import cut_program, program
from ..tensor_parallel.random import RNGTracker
from ..tensor_parallel.recompute import RNGSnapshot, replaying_forward
from .accounting import SavedBytes, clock_units
from .losses import _HostCopy, _loss_row, loss_parts  # noqa: F401 - loss_parts re-exported
from .parts import RankParts
from .saved_release import BoxedSaves, release_unread
from .speculation import PostValidation
from .split_backward import DeferredWeightGrad, accumulator, backward_input, backward_weight, take_groups
from .transport import SEND_OPS, Incoming
from .updater import host

if TYPE_CHECKING:
    from ..faults import Faults


@dataclass
class StepResult:
    step: int
    loss: float | None  # mean loss of this replica's m microbatches (last stage only)
    grad_norm: float  # global, unscaled, before clipping
    skipped: bool  # overflow: the update was skipped on every rank
    loss_scale: float
    lr: float
    # named parts of the loss (BERT: lm_loss, sop_loss), mean over the m microbatches; None if the loss has none
    components: dict[str, float] | None = None


@dataclass
class StashEntry:
    """What a microbatch's forward leaves for its backward."""

    input: torch.Tensor | None  # the activation received (None on the first stage)
    output: torch.Tensor | None  # the loss (last stage) or the output; None when recomputing
    batch: dict
    rng: RNGSnapshot | None  # the RNG state before the forward, for recomputation
    nbytes: int  # activation bytes held for the backward
    version: int  # the weight version W(v) the forward ran on
    chunk: int = 0  # the rank's model chunk the forward ran (interleaved schedules)
    deferred: DeferredWeightGrad | None = None  # a split backward between its I and its W
    boxes: list | None = None  # the saved tensors of its graph, droppable at I (saved_release)


@dataclass
class _Segment:
    """One call of :meth:`PipelineRank.train`: its program, how far it ran, and what it reports."""

    first: int
    end: int
    get_batch: Callable[[int], dict]
    lr_fn: Callable[[int], float]
    on_update: Callable[[StepResult], int | None] | None
    predicting: bool
    actions: list = field(default_factory=list)
    units: object = None
    done: int = 0
    results: list = field(default_factory=list)


def _run(layers: nn.ModuleList, batch: dict, x):
    for layer in layers:
        x = layer(x, batch)
    return x


class PipelineRank(PostValidation):
    """One rank of the pipeline: runs the programs of its model chunks (virtual stages) on the collaborators
    it is handed (:class:`~.build.RankParts`)."""

    def __init__(self, parts: RankParts, loss_fn: Callable, state: ParallelState, pipe: PipelineConfig,
                 opt: OptimizerConfig, *, rng_tracker: RNGTracker | None = None,
                 faults: Faults | None = None) -> None:
        self.state, self.pipe, self.opt, self.loss_fn, self.rng = state, pipe, opt, loss_fn, rng_tracker
        self.weights, self.transport, self.reducer = parts.weights, parts.transport, parts.reducer
        self.updater, self.stats, self.faults = parts.updater, parts.stats, faults
        # called with a chunk's layers and its action before each forward (MoE: the balancing losses' gradient
        # scale, the expert-bias update at a step's first forward); None: nothing
        self.before_forward: Callable[[nn.ModuleList, Action], None] | None = None
        # Several model chunks per rank (interleaved, V): the weights are one flat buffer over all of them and
        # each chunk's layers run on their own. Chunk c's virtual stage says whether it holds the embedding or
        # the loss; where a neighbouring virtual stage is on this rank (a V's turn), the chunk hands over by
        # itself: the producer's output (SEND_ACT / SEND_GRAD mail) is the consumer's input, with no transfer.
        place = self.placement = parts.placement
        self.chunks, r = place.chunks, state.pp_rank
        self._first = [place.is_first(r, c) for c in range(self.chunks)]
        self._last = [place.is_last(r, c) for c in range(self.chunks)]
        mine = {place.stage(r, c): c for c in range(self.chunks)}
        self._local_in = [None if self._first[c] else mine.get(place.stage(r, c) - 1) for c in range(self.chunks)]
        self._local_out = [None if self._last[c] else mine.get(place.stage(r, c) + 1) for c in range(self.chunks)]
        pairs = list(zip(parts.bounds, parts.bounds[1:]))  # each chunk's [lo, hi) in the rank's layer list
        self._chunk_layers = [[slot] if self.chunks == 1 else [nn.ModuleList(list(slot)[lo:hi]) for lo, hi in pairs]
                              for slot in self.weights.slots]  # per weight buffer, per chunk: views of one list
        self.saved = SavedBytes(self.weights.storages)
        # a split backward frees at I what W does not read (saved_release), unless torch checkpoint regions
        # (layer-level recomputation) hold those tensors; the boxes also count the stash's bytes
        self._boxed = BoxedSaves(self.weights.storages) if pipe.spec.split_backward and \
            pipe.recompute_granularity is None else None
        self.step = 0  # updates applied so far: the newest version is W(step)
        self._stash: dict[tuple[int, int], StashEntry] = {}  # by (chunk, microbatch), from its forward to its backward
        # tensors between compute and transfer, by (transfer op, chunk, microbatch): received and not yet
        # consumed (RECV_ACT, RECV_GRAD), or produced and not yet sent (SEND_ACT, SEND_GRAD)
        self._mail: dict[tuple[Op, int, int], torch.Tensor | Incoming] = {}
        # by step: the sum of its microbatch losses, then of each loss component (last stage); on CUDA
        # copied to the host once the step's last forward added its row, read at the update
        self._losses: dict[int, torch.Tensor | _HostCopy] = {}
        self._loss_keys: tuple[str, ...] = ()  # the loss components' names, in ``_losses`` order
        self._acc_nodes: dict[int, dict] = {}  # by weight slot: AccumulateGrad node -> parameter index
        self._clock = (time.perf_counter(), 0.0)  # (perf_counter at the segment's start, train_s then)
        self._init_post_validation()
        # the tied word embedding's parameter indices (the last stage's head weight: its gradient is taken at I
        # where the program reduces the embedding early)
        self._tied = [i for i, p in enumerate(self.weights.params[0]) if getattr(p, "shared_embedding", False)]

    @property
    def newest_layers(self) -> nn.ModuleList:
        """The newest weights W(step): what evaluation and checkpoints see."""
        return self.weights.layers(self.step)

    # ------------------------------------------------------------------ training
    def train(self, num_steps: int, get_batch: Callable[[int], dict], lr_fn: Callable[[int], float],
              on_update: Callable[[StepResult], int | None] | None = None) -> list[StepResult]:
        """Run steps ``self.step .. self.step + num_steps - 1`` and drain; returns their results.

        ``on_update(result)`` runs right after each update. It may return a step count ``S`` below the
        segment's end, at least ``STOP_LAG`` past the update's step (the same ``S`` on every rank): the
        stage then runs the rest of the segment that ends at ``S`` (:func:`cut_program`) and drains there.
        """
        s, m = self.state, self.pipe.num_microbatches
        seg = _Segment(self.step, self.step + num_steps, get_batch, lr_fn, on_update,
                       predicting=self.pipe.compensation == "predict")
        seg.actions = program(self.pipe.spec, s.d, s.pp_rank, m, seg.first, num_steps)
        self._steps_of(seg.actions)
        for layer_list in self.weights.slots:
            layer_list.train()
        if seg.predicting:  # the drain left W(step) in its buffer; step+1's microbatches run on P(W(step))
            self.updater.write_prediction(self.weights.slot(self.step), lr_fn(self.step))
        seg.units = self.transport.units(seg.actions)
        handlers = self._handlers(seg)
        self._clock = (time.perf_counter(), self.stats.train_s)  # the stage's clocks (StageStats)
        while (unit := next(seg.units, None)) is not None:
            seg.done += len(unit)
            t0, waited = self._tick(), self.stats.recv_wait_s
            handlers.get(unit[0].op, self._transfer)(unit)
            # a compute's wait for its received input (:meth:`_received`) is booked as a receive's wait already
            clock_units(self.stats, unit, time.perf_counter() - t0 - (self.stats.recv_wait_s - waited))
        self.transport.drain()
        self._tick()
        self.reducer.wait_all()  # drained: no all-gather left running beside the caller's collectives
        if seg.predicting:  # evaluation and checkpoints see the newest weights
            self.updater.write_newest(self.weights.slot(self.step))
        if self.state.device.type == "cuda":
            self.stats.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.state.device)
        return seg.results

    def _handlers(self, seg: "_Segment") -> dict[Op, Callable[[Sequence[Action]], None]]:
        """What each op of a training program does (transfers: :meth:`_transfer`, the default)."""
        return {
            Op.FORWARD: lambda u: self._forward(u[0], seg.get_batch),
            Op.BACKWARD: lambda u: self._backward(u[0]),
            Op.BACKWARD_INPUT: lambda u: self._backward_input(u[0]),
            Op.BACKWARD_WEIGHT: lambda u: self._backward_weight(u[0]),
            Op.REDUCE_GRADS: lambda u: self._reduce(u[0].step),
            Op.APPLY_UPDATE: lambda u: self._report(seg, self._apply(
                u[0].step, seg.lr_fn(u[0].step), seg.lr_fn(u[0].step + 1) if seg.predicting else None, seg.done)),
            Op.VALIDATE: lambda u: self._report(seg, self._validate(u[0].step, seg.actions, seg.done, seg.get_batch)),
            Op.REDUCE_EMBEDDING: lambda u: self.reducer.start_embedding(
                u[0].step, self.weights.padded_grad[self.weights.grad_buffer(u[0].step)]),
        }

    def _report(self, seg: "_Segment", result: StepResult | None) -> None:
        """A settled update's result (a speculative one reports at its VALIDATE): to the caller, who may end
        the segment early (:func:`cut_program`)."""
        if result is None:
            return
        seg.results.append(result)
        stop = seg.on_update(result) if seg.on_update is not None else None
        if stop is not None and stop < seg.end:
            s, done = self.state, seg.actions[:seg.done]
            rest = cut_program(self.pipe.spec, s.d, s.pp_rank, self.pipe.num_microbatches, seg.first, done, stop)
            seg.actions, seg.end = done + rest, stop
            self._steps_of(seg.actions)
            self.transport.forget_plan()  # the rest plans its own receives
            seg.units = self.transport.units(rest)

    def _tick(self) -> float:
        """Bring ``stats.train_s`` (time inside ``train``) up to now; returns now."""
        now = time.perf_counter()
        self.stats.train_s = self._clock[1] + (now - self._clock[0])
        return now

    def _transfer(self, unit: Sequence[Action]) -> None:
        outgoing = {a: self._mail.pop((a.op, a.chunk, a.mb)) for a in unit if a.op in SEND_OPS}
        for a, tensor in self.transport.run(unit, outgoing):
            self._mail[(a.op, a.chunk, a.mb)] = tensor

    def _received(self, key: tuple[Op, int, int], default=...) -> torch.Tensor | None:
        """Take a received tensor from the mail, waiting for it here, at its consumer (the transport hands on
        an :class:`~.transport.Incoming`); the wait is booked as a receive's wait, not as compute."""
        x = self._mail.pop(key) if default is ... else self._mail.pop(key, default)
        if not isinstance(x, Incoming):
            return x
        t0 = time.perf_counter()
        x.wait()
        self.stats.recv_wait_s += time.perf_counter() - t0
        return x.buf

    def _forward(self, a: Action, get_batch: Callable[[int], dict]) -> None:
        if self.faults is not None:
            self.faults.before_forward(self.state.rank, a.step)
        self.reducer.wait_slot(self.weights.slot(a.version))  # the distributed optimizer's all-gather of W(v)
        layers = self._chunk_layers[self.weights.slot(a.version)][a.chunk]
        if self.before_forward is not None:
            self.before_forward(layers, a)
        batch = get_batch(a.mb)
        src = self._local_in[a.chunk]
        x = self._received((Op.RECV_ACT, a.chunk, a.mb), None) if src is None else \
            self._mail.pop((Op.SEND_ACT, src, a.mb)).detach()
        recompute, last = self.pipe.recompute, self._last[a.chunk]
        if x is not None and not recompute:
            x.requires_grad_(True)
        snap = RNGSnapshot.capture(self.state.device, self.rng) if recompute else None
        saver = self._boxed if self._boxed is not None and not self._first[a.chunk] else \
            self.saved if self.pipe.track_memory else None
        measure = saver.measure() if saver is not None and not recompute else contextlib.nullcontext()
        with measure, (torch.no_grad() if recompute else contextlib.nullcontext()):
            out = _run(layers, batch, x)
            loss, comps = loss_parts(self.loss_fn, out, batch) if last else (None, {})
        nbytes = saver.bytes if saver is not None and not recompute else 0
        boxes = saver.boxes if isinstance(saver, BoxedSaves) and not recompute else None
        if recompute and x is not None:
            nbytes = x.numel() * x.element_size()
        if last:
            acc, row = self._losses.get(a.step), _loss_row(loss, comps)
            self._losses[a.step] = row if acc is None else acc + row
            self._loss_keys = tuple(comps)
            if self.state.device.type == "cuda" and a.mb % self.pipe.num_microbatches == self.pipe.num_microbatches - 1:
                self._losses[a.step] = _HostCopy(self._losses[a.step])  # the step's sum is complete
        else:
            self._mail[(Op.SEND_ACT, a.chunk, a.mb)] = out
        self._stash[(a.chunk, a.mb)] = StashEntry(x, None if recompute else (loss if last else out), batch, snap,
                                                  nbytes, a.version, a.chunk, boxes=boxes)
        self._account()

    def _account(self) -> None:
        st = self.stats
        st.max_inflight = max(st.max_inflight, len(self._stash))
        st.stashed_bytes = sum(e.nbytes for e in self._stash.values())
        st.peak_stashed_bytes = max(st.peak_stashed_bytes, st.stashed_bytes)
        live = {e.version for e in self._stash.values()} | {self.step}
        st.max_live_versions = max(st.max_live_versions, len(live))

    def _recompute(self, entry: StashEntry, split: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Replay the stashed forward with its dropout masks; returns (input, output or loss)."""
        now = RNGSnapshot.capture(self.state.device, self.rng)
        entry.rng.restore(self.state.device, self.rng)
        x = entry.input.detach().requires_grad_(True) if entry.input is not None else None
        # an I re-runs its forward into boxes, so that it can free what its W will not read
        saver = self._boxed if self._boxed is not None and split else self.saved if self.pipe.track_memory else None
        with saver.measure() if saver is not None else contextlib.nullcontext(), replaying_forward("stash"):
            out = _run(self._chunk_layers[self.weights.slot(entry.version)][entry.chunk], entry.batch, x)
            if self._last[entry.chunk]:
                out = loss_parts(self.loss_fn, out, entry.batch)[0]
        if saver is not None:
            st = self.stats
            st.peak_stashed_bytes = max(st.peak_stashed_bytes, st.stashed_bytes + saver.bytes)
            if isinstance(saver, BoxedSaves):
                entry.boxes = saver.boxes
        now.restore(self.state.device, self.rng)
        return x, out

    def _backward(self, a: Action, entry: StashEntry | None = None) -> None:
        entry = self._stash.pop((a.chunk, a.mb)) if entry is None else entry
        w = self.weights
        w.point_grads(w.slot(entry.version), w.grad_buffer(a.step))
        factor = self._loss_factor(a.step)  # fixes the step's loss scale on every stage (the update unscales by it)
        x, out = self._recompute(entry) if entry.rng is not None else (entry.input, entry.output)
        if self._last[a.chunk]:
            (out * factor).backward()
        else:
            torch.autograd.backward(out, self._output_grad(a))
        if not self._first[a.chunk]:
            self._mail[(Op.SEND_GRAD, a.chunk, a.mb)] = x.grad
        self._account()

    def _output_grad(self, a: Action) -> torch.Tensor:
        """The gradient of chunk ``a.chunk``'s output: received, or handed over by the next chunk on this rank."""
        dst = self._local_out[a.chunk]
        return (self._received((Op.RECV_GRAD, a.chunk, a.mb)) if dst is None
                else self._mail.pop((Op.SEND_GRAD, dst, a.mb)))

    def _loss_factor(self, step: int) -> float:
        """What the last stage's loss is scaled by for backward: the step's loss scale (one for the whole
        step, on every stage) over the microbatches that average it."""
        return self.updater.loss_scale(step) / (self.pipe.num_microbatches * self.state.data_width)

    def _backward_input(self, a: Action) -> None:
        """The input-gradient half of a split backward (:mod:`.split_backward`): recompute if the stage
        recomputes, send the input's gradient on, keep the graph and the first-use gradients for W. The
        first stage (chunk 0 of rank 0) sends nothing: its W runs the whole backward."""
        factor = self._loss_factor(a.step)  # fixes the step's loss scale on every stage, as a whole backward does
        if self._first[a.chunk]:
            return
        entry = self._stash[(a.chunk, a.mb)]
        x, out = self._recompute(entry, split=True) if entry.rng is not None else (entry.input, entry.output)
        if self._last[a.chunk]:
            out, grad = out * factor, None
        else:
            grad = self._output_grad(a)
        accs = self._accumulators(entry.version)
        dx, entry.deferred = backward_input(out, grad, x, accs)
        if a.step in self._emb_early and self._tied:  # the head's weight gradient now: REDUCE_EMBEDDING follows
            self._weight_grads(take_groups(entry.deferred, self._tied, accs), entry.version, a.step)
        self._mail[(Op.SEND_GRAD, a.chunk, a.mb)] = dx
        # W holds what its nodes read and the caught gradients: with boxes the rest is freed here, otherwise
        # the whole graph stays (every saved activation, recomputed ones included)
        if entry.boxes is not None:
            held = release_unread(entry.boxes, entry.deferred, self.weights.storages) + entry.deferred.nbytes
            entry.boxes = None
        else:
            held = entry.nbytes + entry.deferred.nbytes
            if entry.rng is not None and self.pipe.track_memory:
                held += self.saved.bytes
        del out
        entry.input = entry.output = entry.rng = None
        entry.nbytes = held
        self._account()

    def _backward_weight(self, a: Action) -> None:
        """The weight-gradient half: into the step's gradient buffer, as a whole backward would add them."""
        entry = self._stash.pop((a.chunk, a.mb))
        if entry.deferred is None:  # the first stage: the whole backward
            self._backward(a, entry)
            return
        self._weight_grads(entry.deferred, entry.version, a.step)
        self._account()

    def _weight_grads(self, deferred: DeferredWeightGrad, version: int, step: int) -> None:
        """Run ``deferred`` weight gradients into step ``step``'s gradient buffer."""
        w = self.weights
        slot = w.slot(version)
        w.point_grads(slot, w.grad_buffer(step))
        backward_weight(deferred, w.params[slot], self._accumulators(version), w.main_grads)

    def _accumulators(self, version: int) -> dict:
        """The AccumulateGrad node of each parameter of W(version) -> its index (kept alive here, so every
        microbatch's graph reaches the same nodes)."""
        slot = self.weights.slot(version)
        accs = self._acc_nodes.get(slot)
        if accs is None:
            accs = self._acc_nodes[slot] = {accumulator(p): i for i, p in enumerate(self.weights.params[slot])}
        return accs

    def _reduce(self, t: int) -> None:
        buf = self.weights.grad_buffer(t)
        if self.faults is not None:
            self.faults.poison(self.state.rank, t, self.weights.grad_flat[buf])
        # a step validated later issues its norm's link at its update (after a speculative update's all-gather)
        self.reducer.start(t, self.weights.padded_grad[buf], self.weights.norm_views[buf],
                           norm=t not in self._validated)

    def _apply(self, t: int, lr: float, next_lr: float | None = None, at: int = 0) -> StepResult | None:
        """APPLY_UPDATE(t): exact, or speculative where the program validates t later and the step before
        neither clipped nor overflowed (None then: :meth:`_validate` reports the step). ``at``: the index of
        the action after it in the segment's actions (where a speculative update's warm-up starts)."""
        t0 = time.perf_counter()
        if self._speculate(t, lr, at, t0):
            self._tick()
            self.step = t + 1
            return None
        sumsq = self.reducer.finish(t)  # a float the reducer's worker read: no sync of this stream
        self.stats.update_wait_s += time.perf_counter() - t0  # the host's wait for the reductions alone
        update = self.updater.apply(t, sumsq, lr, next_lr)
        self._tick()  # the statistics taken after the update see its wait and its time alike
        self.step = t + 1
        return self._settled(t, update, lr)

    def _settled(self, t: int, update, lr: float) -> StepResult:
        """Step ``t``'s result, once its update is final; whether the next step may speculate."""
        self._clean = not update.skipped and not self.updater.clips(update.norm)
        acc = self._losses.pop(t, None)
        means = self._means(acc, self.pipe.num_microbatches)
        comps = {k: v for k, v in means.items() if k != "loss"} if means is not None else None
        return StepResult(t, means["loss"] if means is not None else None, update.norm, update.skipped,
                          update.loss_scale, lr, comps or None)

    def _means(self, acc: torch.Tensor | _HostCopy | None, n: int) -> dict[str, float] | None:
        """``{"loss": total / n, <component>: value / n, ...}`` from a summed loss row (one host sync)."""
        if acc is None:
            return None
        vals = acc.result() if isinstance(acc, _HostCopy) else acc.tolist()
        return dict(zip(("loss", *self._loss_keys), (v / n for v in vals)))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, num_microbatches: int, get_batch: Callable[[int], dict]) -> float | None:
        """Forward-only pass on the newest weights; the mean loss on the last stage (None elsewhere)."""
        means = self.evaluate_components(num_microbatches, get_batch)
        return means["loss"] if means is not None else None

    @torch.no_grad()
    def evaluate_components(self, num_microbatches: int, get_batch: Callable[[int], dict]) -> dict[str, float] | None:
        """Forward-only pass on the newest weights; on the last stage ``{"loss": mean total, <component>:
        mean, ...}`` (BERT: ``lm_loss``, ``sop_loss``), None elsewhere. It runs the generated forward-only
        program (:func:`~megatron_2bw.schedule.evaluation.evaluation_program`) through the training loop's
        transfers, so its sends and receives are grouped and ordered as a training step's are."""
        self.reducer.wait_all()
        layers = self.newest_layers
        layers.eval()
        total: list[torch.Tensor | None] = [None]
        chunks = self._chunk_layers[self.weights.slot(self.step)]

        def forward(unit: Sequence[Action]) -> None:
            a = unit[0]
            batch, src = get_batch(a.mb), self._local_in[a.chunk]
            x = None if self._first[a.chunk] else self._received((Op.RECV_ACT, a.chunk, a.mb)) if src is None else \
                self._mail.pop((Op.SEND_ACT, src, a.mb))
            out = _run(chunks[a.chunk], batch, x)
            if self._last[a.chunk]:
                loss, comps = loss_parts(self.loss_fn, out, batch)
                row = _loss_row(loss, comps)
                total[0] = row if total[0] is None else total[0] + row
                self._loss_keys = tuple(comps)
            else:
                self._mail[(Op.SEND_ACT, a.chunk, a.mb)] = out

        program = evaluation_program(self.placement, self.state.pp_rank, num_microbatches)
        for unit in self.transport.units(program):
            (forward if unit[0].op is Op.FORWARD else self._transfer)(unit)
        self.transport.drain()
        layers.train()
        return self._means(total[0], num_microbatches)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, everywhere: bool = True, copy: bool = True, skip: frozenset[int] = frozenset()) -> dict:
        """Both weight versions (2BW), the fp32 master, optimizer and scaler state, and the step, in the
        unsharded layout, on the CPU (with the distributed optimizer a collective of the data-parallel
        group, whose gathered tensors reach only data-parallel rank 0 when ``everywhere`` is False).

        ``copy`` True: a snapshot; False (a save, written before training goes on): CPU buffers themselves,
        device buffers copied straight to the host, never cloned on the device. ``skip``: the updater's."""
        w = self.weights
        self.reducer.wait_all()
        return {"step": self.step, "schedule": self.pipe.schedule, "names": w.names,
                "versions": [host(f, copy) for f in w.flat], **self.updater.state_dict(everywhere, copy, skip)}

    def load_state_dict(self, sd: dict) -> None:
        w = self.weights
        if sd["names"] != w.names or len(sd["versions"]) != len(w.flat):
            raise ValueError("checkpoint does not match this stage's parameters or schedule")
        self.reducer.wait_all()  # no all-gather may still write the buffers
        for f, saved in zip(w.flat, sd["versions"]):
            f.copy_(saved)
        self.updater.load_state_dict(sd)
        self.step = int(sd["step"])
        if self.updater.master is not None and sd.get("master") is None:  # e.g. fp32 predict from a plain checkpoint
            self.updater.master_from(w.slot(self.step))

    def newest_state(self, sd: dict | None = None) -> dict[str, torch.Tensor]:
        """Global parameter name -> newest weights W(step): views of the saved versions of ``sd`` (a
        :meth:`state_dict`), or of the live buffers when ``sd`` is None."""
        if sd is None:
            self.reducer.wait_all()
        versions = self.weights.flat if sd is None else sd["versions"]
        return self.weights.state_views(versions[self.weights.slot(self.step)])
