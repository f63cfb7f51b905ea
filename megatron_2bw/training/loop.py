"""The training loop: segments of pipelined steps, evaluation, checkpoints and reporting.

The engine (``PipelineRank.train``) runs a *segment* of steps and ends drained. A segment runs
from the current step to the next boundary that needs the pipeline drained: an evaluation, a
checkpoint, the exit interval or the end of training, or earlier when the ranks agree to stop (an
exit signal, ``--exit-duration-in-mins``, an unhealthy run). Logging never drains the pipeline,
so ``--log-interval`` does not change how the pipeline runs. The metrics file's ``end``
record counts the segments as ``pipeline_drains`` (1 for a run without evaluations or saves of at
most ``SEGMENT_MICROBATCHES`` microbatches, which bounds the memory of a segment's action list;
for every schedule: Flush and GPipe also empty the pipeline inside every step, by design, which is
not counted).

Each step's loss, exit flags and stage statistics are reduced asynchronously
(``step_stats.py``): every rank issues the reduction of step ``u`` at its update of ``u`` and
takes in step ``u - 2``'s at the same point, so every rank sees the same numbers at the same
step. Rank 0 writes each step's ``train`` record, the progress bar and, every ``--log-interval``
steps, Megatron's training line when the step's numbers arrive (two steps later, or at the end of
the segment). On every rank, before anything is saved, ``health.py`` judges each step (a diverged
run stops with one line, exit 3, keeping the last good checkpoint) and an exit signal or
``--exit-duration-in-mins`` seen on any rank (``signals.py``) stops every rank at the same step,
which saves and exits 0. Such a stop decided at the update of step ``u`` ends the segment at step
count ``u + STOP_LAG`` (``schedule/schedules.py``). At a drained boundary one more all-reduce
brings the evaluation loss to all ranks, and ``signals.exit_reason`` catches a signal that came
after the segment's last update. The watchdog (``watchdog.py``) hears of progress at every
microbatch and is paused while a checkpoint is written.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import parallel_state
from ..argv import describe, megatron_args
from ..checkpoint import checkpointing, dist_checkpoint, formats
from ..checkpoint.checkpoint_args import with_tokenizer_fingerprint
from ..checkpoint.names import WORD
from ..config.precision import precision_of
from ..errors import ConfigError
from ..faults import Faults
from ..models.gpt import DocumentMasks
from ..models.groups import ModelGroups
from ..models.spec import ModelSpec
from ..pipeline.build import build_stage
from ..pipeline.weights import GlobalNames
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.schedules import STOP_LAG
from ..tensor_parallel.random import RNGTracker, seed_everything
from . import health, moe_metrics, signals, watchdog
from .data_iter import MicrobatchProvider
from .log_format import iteration_of_step, saved_checkpoint_line
from .lr_schedule import lr_at
from .metrics import Metrics
from .moe_hooks import MoEHooks
from .params_norm import params_sumsq
from .report import StepReport, is_log_step
from .step_stats import WAIT_LAG, StepReducer, StepStats, pack, stage_dicts, stage_row
from .wandb_writer import wandb_settings

log = logging.getLogger("megatron_2bw")


# A segment's action list is built whole (about 150 bytes and 6 actions per microbatch), so an
# uninterrupted run drains once per this many microbatches: about 80 MB of actions, and one fill and
# drain per 2**17 microbatch slots, which costs nothing measurable.
SEGMENT_MICROBATCHES = 1 << 17


def next_boundary(step: int, train_iters: int, intervals: list[int | None]) -> int:
    """The first step count after ``step`` that is a multiple of an interval, or ``train_iters``."""
    end = train_iters
    for k in intervals:
        if k:
            end = min(end, (step // k + 1) * k)
    return end


def _at_interval(count: int, interval: int | None) -> bool:
    """Whether ``count`` completed steps end an ``interval`` (``None`` or 0: the interval is off)."""
    return bool(interval) and count % interval == 0


class BoundaryStats(NamedTuple):
    """What one boundary all-reduce returns, identical on every rank."""

    extra: list[float]  # last-stage values (the evaluation loss, then its components), mean over replicas
    stages: list[dict]  # every pipeline stage's statistics (step_stats.STAT_KEYS), one dict per stage


class Trainer:
    """One rank's training run: the engine, its data, and the boundaries where ranks meet."""

    def __init__(self, prep, state: parallel_state.ParallelState, faults: Faults | None = None,
                 wd: watchdog.Watchdog | None = None) -> None:
        self.prep, self.cfg, self.state, self.wd = prep, prep.cfg, state, wd
        cfg, tc, oc = self.cfg, self.cfg.training, self.cfg.optimizer
        # Megatron: one seed per pipeline stage (independent dropout), the same across tensor/data ranks.
        stage_seed = tc.seed + 100 * state.pp_rank
        seed_everything(stage_seed, state.device)
        self.tracker = RNGTracker(stage_seed, state.tp_rank, state.device)
        groups = ModelGroups.of(state, cfg.parallel.cp_comm_type, moe=cfg.model.moe is not None)
        spec = ModelSpec(cfg.model, groups, tc.seed, rng=self.tracker, kernels=prep.kernels,
                         split=cfg.pipeline.layer_split, recompute=RecomputePolicy.from_pipeline(cfg.pipeline),
                         masks=DocumentMasks.from_config(cfg.data, getattr(prep.tokenizer, "eod", None)),
                         precision=precision_of(oc.dtype))
        self.spec = spec
        b = cfg.pipeline.micro_batch_size
        place = cfg.pipeline.spec.placement(state.d)
        build, ranges = spec.rank_build(state.d, state.pp_rank, place)  # several chunks: interleaved, V
        self.stage = build_stage(
            build, spec.loss_fn(), state, cfg.pipeline, cfg.optimizer,
            cfg.model.stage_activation_shape(b, state.t, state.c), rng_tracker=self.tracker, faults=faults,
            names=(GlobalNames(ranges[0][0], tied=WORD) if len(ranges) == 1
                   else GlobalNames.of_chunks(ranges, tied=WORD)),
            cpu_init=cfg.system.use_cpu_initialization,  # off: each rank draws its own shards on its device
        )
        if prep.checkpoint is not None:
            self._restore(prep, state)
        self.moe_names = moe_metrics.slots(cfg.model.moe, cfg.model.num_layers) if cfg.model.moe else []
        if cfg.model.moe is not None:  # aux-loss scale, expert-bias update, MoE log (moe_hooks.py)
            self.stage.before_forward = MoEHooks(self.stage, state, cfg.model.num_layers,
                                                 cfg.pipeline.num_microbatches, tc.log_interval)
        self.loss_keys: tuple[str, ...] = tuple(getattr(self.stage.loss_fn, "components", ()))
        self.m = cfg.pipeline.num_microbatches
        self.B = tc.global_batch_size
        self.provider = MicrobatchProvider(
            prep.train_ds, spec.make_batch, global_batch=self.B, micro_batch=b, m=self.m, w=state.data_width,
            dp_rank=state.data_rank, device=state.device, start_step=self.stage.step, start_sample=prep.start_sample,
            vocab_size=cfg.model.vocab_size,
        )
        self.get_batch = self._progressing(self.provider)
        self.health = health.HealthMonitor(health.HealthPolicy.from_config(
            oc.dtype, oc.loss_scale, oc.initial_loss_scale, oc.min_loss_scale, tc.max_skipped_steps))
        self.can_eval = prep.valid_ds is not None and tc.eval_iters > 0
        self.metrics: Metrics | None = None  # rank 0's metrics file and writers, and what writes them:
        self.report: StepReport | None = None
        self.last_saved: int | None = None
        self.async_writer = dist_checkpoint.AsyncWriter() if tc.async_save else None  # --async-save
        self.last_eval: int | None = None
        self.drains = 0  # training segments run: each ends with the pipeline drained
        self.step_stats = StepReducer(state, self.loss_keys)  # every rank, same point: it may create a group
        self.unhealthy: str | None = None  # the health verdict that stops the run (the same on every rank)
        self.exit_wanted = False  # some rank saw an exit signal or the duration pass (agreed through step_stats)
        self._stop_at: int | None = None  # where the running segment ends early, once a stop is agreed
        self._results: dict = {}  # StepResults whose reduced numbers have not arrived yet, by step
        self._times: dict[int, float] = {}  # seconds between this rank's updates, by step
        self._t_last = 0.0

    def _restore(self, prep, state: parallel_state.ParallelState) -> None:
        """Restore the checkpoint read before the groups existed, and say so in Megatron's line."""
        tc = self.cfg.training
        formats.of_file(prep.checkpoint).restore(prep.checkpoint, self.stage, self.tracker, state.device,
                                                 **checkpointing.load_options(tc))
        prep.checkpoint = None  # free the CPU copy
        moe = self.cfg.model.moe
        if moe is not None and moe.moe_router_enable_expert_bias and not getattr(self.stage, "moe_router_state", None):
            raise ConfigError(f"--load {tc.load}: the checkpoint holds no expert bias (router_state), which "
                              "--moe-router-enable-expert-bias routes with (a torch-format or bias-free checkpoint)")
        if state.rank == 0:  # Megatron's line: which checkpoint, and what of it
            what = "weights only (--finetune)" if tc.finetune else \
                "weights and iteration (--no-load-optim)" if tc.no_load_optim else "full state"
            log.info("  successfully loaded checkpoint from %s at iteration %d: %s", tc.load,
                     prep.loaded_iteration, what)

    def _progressing(self, provider: Callable[[int], dict]) -> Callable[[int], dict]:
        """``provider`` that also tells the watchdog this rank makes progress (every stage fetches each microbatch)."""
        wd = self.wd
        if wd is None:
            return provider

        def get(mb: int) -> dict:
            wd.progress()
            return provider(mb)

        return get

    def _paused(self) -> contextlib.AbstractContextManager:
        """Suspend the watchdog's no-progress rule around a legitimate wait (a save)."""
        return self.wd.paused() if self.wd is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ collectives at boundaries
    def _stage_row(self) -> list[float]:
        if self.state.device.type == "cuda":  # the allocator's peak so far (a host counter, no sync)
            self.stage.stats.cuda_peak_bytes = torch.cuda.max_memory_allocated(self.state.device)
        return stage_row(self.stage.stats)

    def allreduce_step_stats(self, extra: list[float | None]) -> BoundaryStats:
        """Collective (every rank calls it): one float64 all-reduce of ``extra`` (last stage, tensor rank 0:
        mean over replicas) and every stage's statistics (data rank 0)."""
        s = self.state
        vec = pack(s, extra, [], self._stage_row())
        if dist.is_initialized():
            dev = s.device if s.device.type == "cuda" else torch.device("cpu")
            buf = vec.to(dev)
            dist.all_reduce(buf)
            vec = buf.cpu()
        vals = vec.tolist()
        return BoundaryStats(vals[:len(extra)], stage_dicts(vals[len(extra):], s.d))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, dataset, round_index: int) -> dict[str, float] | None:
        """Mean loss (``"loss"``) and its components over ``--eval-iters`` global batches of ``dataset``
        on the newest weights (last stage; None elsewhere)."""
        tc, s = self.cfg.training, self.state
        provider = MicrobatchProvider(
            dataset, self.spec.make_batch, global_batch=self.B, micro_batch=self.cfg.pipeline.micro_batch_size,
            m=self.m, w=s.data_width, dp_rank=s.data_rank, device=s.device, start_step=0,
            start_sample=round_index * tc.eval_iters * self.B, vocab_size=self.cfg.model.vocab_size,
        )
        if isinstance(self.stage.before_forward, MoEHooks):  # the expert bias of the newest weights
            self.stage.before_forward.before_evaluation()
        return self.stage.evaluate_components(tc.eval_iters * self.m, self._progressing(provider))

    def evaluate_and_allreduce(self, dataset, round_index: int) -> BoundaryStats:
        """Collective: evaluate on ``dataset`` and reduce its loss; ``extra[0]`` is the evaluation loss,
        ``extra[1:]`` its components in ``self.loss_keys`` order."""
        ev = self.evaluate(dataset, round_index) or {}
        return self.allreduce_step_stats([ev.get(key) for key in ("loss", *self.loss_keys)])

    def _record_eval(self, iteration: int, split: str, extra: list[float], final: bool = False) -> None:
        """Rank 0: the validation line and record of an evaluation after ``iteration`` completed steps."""
        if self.metrics is not None:
            comps = dict(zip(self.loss_keys, extra[1:])) or None
            self.metrics.eval(iteration, split, extra[0], self.cfg.training.eval_iters * self.B, final=final,
                              components=comps)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_args(self) -> dict:
        """The flat arguments a checkpoint stores, with the tokenizer's fingerprint (checkpoint_args.py)."""
        return with_tokenizer_fingerprint(megatron_args(self.cfg), getattr(self.prep, "fingerprints", None))

    def save(self, completed: int) -> None:
        tc, s = self.cfg.training, self.state
        t0 = time.perf_counter()

        def make_payload() -> dict:
            return checkpointing.payload(
                self.stage, iteration=completed, tracker=self.tracker,
                consumed_samples=self.provider.consumed_samples(completed), global_batch=self.B,
                config=describe(self.cfg), args=self._checkpoint_args(),
                fingerprints=getattr(self.prep, "fingerprints", None),
            )

        def common() -> dict:
            return dist_checkpoint.common_state(
                self.stage, iteration=completed, config=describe(self.cfg),
                args=dist_checkpoint.megatron_namespace(self.stage, self.cfg, self._checkpoint_args(), completed),
                consumed_samples=self.provider.consumed_samples(completed), global_batch=self.B)

        if isinstance(self.stage.before_forward, MoEHooks):  # the expert bias's two versions
            self.stage.before_forward.before_save()
        with self._paused():
            path = formats.get_format(tc.ckpt_format).save(formats.SaveRequest(
                tc.save, completed, self.stage, s, self.tracker, make_payload, common, self.async_writer))
        dt = time.perf_counter() - t0
        if self.async_writer is not None:
            self.last_saved = completed
            if self.metrics is not None:
                log.info(" started the asynchronous save of iteration %d to %s (%.2f s to copy the state)",
                         completed, path, dt)
            return
        self.last_saved = completed
        if self.metrics is not None:
            log.info(saved_checkpoint_line(completed, path, dt))
            self.metrics.write({"type": "checkpoint", "iteration": completed - 1, "completed_iterations": completed,
                                "path": path, "seconds": dt, "time": time.time()})

    # ------------------------------------------------------------------ start-up summary
    def allreduce_and_log_start(self) -> None:
        """Collective (every rank calls it): reduce every stage's statistics, then rank 0 logs the
        start-up line and writes the ``start`` record."""
        stages = self.allreduce_step_stats([]).stages
        if self.report is not None:
            self.report.start(stages, self.stage.step, self.prep.kernels, self.prep.resumed_from)

    # ------------------------------------------------------------------ the loop
    def train(self) -> int:
        """Train to ``--train-iters`` (or an exit condition) segment by segment; every rank calls it."""
        tc, stage = self.cfg.training, self.stage
        if self.state.rank == 0:
            wb = wandb_settings(tc.wandb_project, tc.wandb_exp_name, tc.wandb_save_dir, tc.save)
            self.metrics = Metrics(path=tc.metrics_file, tensorboard_dir=tc.tensorboard_dir, train_iters=tc.train_iters,
                                   start_iter=stage.step, wandb=wb, config=describe(self.cfg),
                                   tensorboard_log_interval=tc.tensorboard_log_interval,
                                   log_timers=tc.log_timers_to_tensorboard)
            self.report = StepReport(self.cfg, self.state, self.metrics, self.loss_keys,
                                     self.provider.consumed_samples, stage.step)
        self.allreduce_and_log_start()
        lr_fn = lambda t: lr_at(self.cfg.lr, t)  # noqa: E731
        self.last_eval = None
        self.last_saved = stage.step if self.prep.resumed_from is not None else None
        if self.report is not None:
            self.report.restart_clock(stage.step)
        if tc.skip_train:  # evaluate the loaded weights, save nothing
            self.last_saved = stage.step
            self._finish(stage.step)
            self._close(stage.step, "skip_train")
            return 0
        reason = "train_iters"
        why = self._exit_reason()
        while stage.step < tc.train_iters and why is None:
            end, exiting = self._run_segment(lr_fn)
            if self.unhealthy is not None:
                return self._stop_unhealthy(end)
            if exiting:
                reason = "exit_interval"
                log.info(" exiting at iteration %d (--exit-interval %d)", end, tc.exit_interval)
                break
            why = self._exit_reason() if stage.step < tc.train_iters else None
        done = stage.step
        if why is not None:
            reason = why
            self._exit_early(done, why)
        elif reason == "train_iters":
            self._finish(done)
        self._close(done, reason)
        return 0

    def _async_saved(self) -> None:
        """Rank 0: the line and record of each asynchronous save published since the last look."""
        writer = self.async_writer
        while writer is not None and writer.done:
            it, path, dt = writer.done.pop(0)
            if self.metrics is not None:
                log.info(saved_checkpoint_line(it, path, dt))
                self.metrics.write({"type": "checkpoint", "iteration": it - 1, "completed_iterations": it,
                                    "path": path, "seconds": dt, "time": time.time(), "asynchronous": True})

    def _close(self, done: int, reason: str) -> None:
        """Rank 0: the metrics file's ``end`` record, then close every writer (after an asynchronous save)."""
        if self.async_writer is not None:
            self.async_writer.wait()
            self._async_saved()
        pv = {"speculative_updates": None, "rolled_back_updates": None}
        if self.cfg.pipeline.post_validation:  # the same counts on every rank: the decisions follow the global norm
            pv = {"speculative_updates": self.stage.speculated, "rolled_back_updates": self.stage.rolled_back}
            log.info(f"post-validation: {pv['speculative_updates']} updates applied speculatively, "
                     f"{pv['rolled_back_updates']} of them rolled back and redone (the clipping or overflow that "
                     "rolls one back also makes the next step wait for the norm)")
        if self.report is not None:
            self.report.end(done, reason, self.drains, pv)

    # ------------------------------------------------------------------ stopping early
    def _exit_reason(self) -> str | None:
        """Collective: ``"signal"`` or ``"duration"`` when any rank must stop (all ranks agree), else None."""
        handler, duration = self.prep.exit_handler, self.prep.exit_duration
        if handler is None and (duration is None or duration.minutes is None):
            return None
        return signals.exit_reason(handler, duration)

    def _exit_early(self, done: int, why: str) -> None:
        """Every rank: save the last completed step (with ``--save``) so a relaunch resumes there."""
        tc = self.cfg.training
        if why == "signal":
            got = self.prep.exit_handler.received if self.prep.exit_handler is not None else None
            what = f"{got or 'an exit signal on another rank'}"
        else:
            what = f"--exit-duration-in-mins {tc.exit_duration_in_mins:g}"
        self._flush(done)
        if tc.save and self.last_saved != done and done > 0:
            self.save(done)
        elif not tc.save:
            log.warning(" no --save: the %d completed iterations are not saved", done)
        log.info(" exiting at iteration %d after %s", done, what)

    def _stop_unhealthy(self, done: int) -> int:
        """Every rank (the same verdict everywhere): stop a diverged run without saving; exit status 3."""
        self._flush(done)
        if self.metrics is not None:
            print(f"error: {self.unhealthy}", file=sys.stderr, flush=True)
            self._close(done, "unhealthy")
        return health.EXIT_UNHEALTHY

    def _run_segment(self, lr_fn: Callable[[int], float]) -> tuple[int, bool]:
        """Train to the next boundary (or an agreed stop), then evaluate and save there; (end, exiting)."""
        tc, stage = self.cfg.training, self.stage
        first = stage.step
        end = next_boundary(first, tc.train_iters, [tc.eval_interval if self.can_eval else None,
                                                    tc.save_interval, tc.exit_interval])
        end = min(end, first + max(SEGMENT_MICROBATCHES // self.m, 1))
        self._t_last, self._stop_at = time.perf_counter(), None
        stage.train(end - first, self.get_batch, lr_fn, on_update=self._on_update)
        self.drains += 1
        for st in self.step_stats.drain():
            self._arrived(st)
        end = stage.step  # earlier than planned when the ranks agreed to stop
        if self.unhealthy is not None:
            return end, False
        exiting = _at_interval(end, tc.exit_interval) and end < tc.train_iters
        if exiting:
            self._flush(end)
        if self.can_eval and _at_interval(end, tc.eval_interval):
            self.last_eval = end
            stats = self.evaluate_and_allreduce(self.prep.valid_ds, end // tc.eval_interval - 1)
            self._record_eval(end, "valid", stats.extra)
        if self.async_writer is not None:  # a failed background write stops the run here
            self.async_writer.check()
            self._async_saved()
        if tc.save and (_at_interval(end, tc.save_interval) or exiting):
            self.save(end)
        return end, exiting

    # ------------------------------------------------------------------ per step, while the pipeline runs
    def _on_update(self, r) -> int | None:
        """After this rank's update of step ``r.step``: issue its numbers and take in those of step
        ``r.step - WAIT_LAG``; returns where the segment must end once the ranks agreed to stop."""
        now = time.perf_counter()
        self._times[r.step], self._t_last = now - self._t_last, now
        self._results[r.step] = r
        handler, duration = self.prep.exit_handler, self.prep.exit_duration
        self._between_steps(r.step)
        hooks = self.stage.before_forward if isinstance(self.stage.before_forward, MoEHooks) else None
        moe = hooks.step_vector(r.step, self.moe_names, is_log_step(self.cfg.training, r.step)) if hooks else ()
        self.step_stats.issue(r.step, r.loss, r.components, handler is not None and handler.should_exit(),
                              duration is not None and duration.expired(), self._stage_row(),
                              params_sumsq(self.stage) if self._norm_step(r.step) else 0.0,
                              moe)
        for st in self.step_stats.ready(r.step - WAIT_LAG):
            self._arrived(st)
        if self._stop_at is None and (self.unhealthy is not None or self.exit_wanted):
            self._stop_at = r.step + STOP_LAG
        return self._stop_at

    def _norm_step(self, step: int) -> bool:
        """Whether every rank measures the weights' norm after ``step`` (--log-params-norm: log steps)."""
        tc = self.cfg.training
        return tc.log_params_norm and (_at_interval(step + 1, tc.log_interval) or step + 1 == tc.train_iters)

    def _between_steps(self, step: int) -> None:
        """--empty-unused-memory-level and --profile (CUDA): what Megatron does between iterations."""
        tc, dev = self.cfg.training, self.state.device
        if dev.type != "cuda":
            return
        if tc.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()
        if tc.profile and self.state.rank in (tc.profile_ranks or (0,)):
            if step + 1 == tc.profile_step_start:
                torch.cuda.cudart().cudaProfilerStart()
            elif step + 1 == tc.profile_step_end:
                torch.cuda.cudart().cudaProfilerStop()

    def _arrived(self, st: StepStats) -> None:
        """Every rank, in step order: judge a step's reduced numbers; rank 0 also records and logs it."""
        r, dt = self._results.pop(st.step), self._times.pop(st.step)
        if self.unhealthy is None:  # the first verdict is the one reported
            self.unhealthy = self.health.check(iteration_of_step(st.step), st.loss, r.grad_norm, r.skipped)
        self.exit_wanted = self.exit_wanted or st.signal or st.duration
        if self.report is not None:
            self.report.step(r, st, dt, self._norm_step(st.step), moe_metrics.named(self.moe_names, st.tail))

    def _finish(self, done: int) -> None:
        """At ``--train-iters``: the last checkpoint, the final validation and the test evaluation."""
        tc = self.cfg.training
        if tc.save and self.last_saved != done and done > 0:
            self.save(done)
        final = []
        if self.can_eval and self.last_eval != done:  # the final evaluation has its own slot of the valid set
            final.append(("valid", self.prep.valid_ds, tc.train_iters // tc.eval_interval))
        if self.prep.test_ds is not None and tc.eval_iters > 0:
            final.append(("test", self.prep.test_ds, 0))
        for split, dataset, round_index in final:
            self._record_eval(done, split, self.evaluate_and_allreduce(dataset, round_index).extra, final=True)

    def _flush(self, completed: int) -> None:
        """Rank 0: the training line of the steps not logged yet (before a stop or the end)."""
        if self.report is not None:
            self.report.flush_window(completed)
