"""One process of ``moe_throughput.py``: the MoE GPT and the dense GPT of the same active size, each as one
process, PipeDream-2BW and PipeDream-Flush, in alternating rounds (``throughput_worker``'s worker, with
expert parallelism folded inside the data ranks); rank 0 returns the records.

The all-to-all's share is measured, never asked of the library: every call of
``torch.distributed.all_to_all_single`` in this process is timed (the ``alltoall`` token dispatcher's only
collective: the counts and the rows of dispatch and combine, forward and backward; the engine's transfers
are ``isend``/``irecv`` and its reductions ``all_reduce``, so nothing else calls it)."""

from __future__ import annotations

import time

import common
from throughput_runners import EngineRunner, SingleRunner, _stage_compute_ms
from throughput_worker import _Worker

VARIANTS = ("moe", "dense")
SYSTEMS = ("single", "2bw", "flush")


class A2AClock:
    """Seconds this process has spent inside ``all_to_all_single`` (installed once per process)."""

    seconds = 0.0
    calls = 0

    @classmethod
    def install(cls) -> None:
        import torch.distributed as dist

        if getattr(dist.all_to_all_single, "_a2a_clock", False):
            return
        inner = dist.all_to_all_single

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                cls.seconds += time.perf_counter() - t0
                cls.calls += 1

        timed._a2a_clock = True
        dist.all_to_all_single = timed  # looked up at call time by the dispatcher and moe.comm


class _View:
    """What a runner reads of its context (``throughput_runners._Ctx``'s fields) for one model variant."""

    def __init__(self, conf: dict, state, cfg, spec, batches: list, b: int) -> None:
        self.conf, self.state, self.cfg, self.spec, self.batches, self.b = conf, state, cfg, spec, batches, b
        self.rank, self.d = state.rank, state.d
        self.loss_fn = spec.loss_fn()
        self.act_shape = (b, cfg.seq_length, cfg.hidden_size)


class _MoECtx:
    """The layout (t = 1, d stages, w = EP data ranks, expert-parallel size e = w) and each variant's views:
    the pipeline's (this rank's expert group) and the single process's (expert-parallel size 1)."""

    def __init__(self, conf: dict) -> None:
        import torch
        import torch.distributed as dist

        from megatron_2bw.config import ModelConfig
        from megatron_2bw.models.groups import ModelGroups
        from megatron_2bw.models.moe_block import MoEGroups
        from megatron_2bw.models.spec import ModelSpec
        from megatron_2bw.parallel_state import Axes, build_state

        e = conf["ep"]
        world = dist.get_world_size()
        self.state = build_state(Axes(expert=e, data=e, pipeline=world // e), torch.device("cpu"))
        self.rank, self.world, self.b = dist.get_rank(), world, conf["micro_batch"]
        torch.manual_seed(1234)
        self.views, self.single_views = {}, {}
        for v in VARIANTS:
            cfg, single_cfg = (ModelConfig(**conf["models"][v][k]) for k in ("pipeline", "single"))
            groups = MoEGroups.from_state(self.state) if cfg.moe is not None else None
            spec = ModelSpec(cfg, ModelGroups(moe=groups), 1234)
            single = ModelSpec(single_cfg, ModelGroups(moe=MoEGroups() if cfg.moe is not None else None), 1234)
            pool = [spec.make_batch(t) for t in common.token_pool(cfg, conf["pool"], self.b)]
            # each data rank its own microbatches (its own routing), the single process all of them
            shift = self.state.dp_rank * len(pool) // e
            self.views[v] = _View(conf, self.state, cfg, spec, pool[shift:] + pool[:shift], self.b)
            self.single_views[v] = _View(conf, self.state, single_cfg, single, pool, self.b)
        self.cfg = self.views["moe"].cfg
        self.batches, self.act_shape, self.loss_fn = (getattr(self.views["moe"], k)
                                                      for k in ("batches", "act_shape", "loss_fn"))


class _Engine(EngineRunner):
    """Our engine, recording at each step start the all-to-all clock beside the executor's clocks."""

    marks: list[float] = []

    def run(self, k: int) -> list[float]:
        ctx, m, marks, clocks = self.ctx, self.m, {}, {}
        batches, n, st = ctx.batches, len(ctx.batches), self.stage.stats

        def get_batch(mb: int) -> dict:
            if mb % m == 0 and mb // m not in marks:  # every stage fetches every microbatch at its forward
                marks[mb // m] = time.perf_counter()
                clocks[mb // m] = (st.compute_s, st.idle_s, A2AClock.seconds)
            return batches[mb % n]

        self.stage.train(k, get_batch, lambda step: 1e-4)
        self.clocks = [clocks[t] for t in sorted(clocks)]
        self.marks = [marks[t] for t in sorted(marks)] + [time.perf_counter()]
        return self.marks


class MoEWorker(_Worker):
    """``throughput_worker._Worker`` over (system, variant) entries: the variant sits where the benchmark
    keeps a stage split. ``self.d`` is the world (the per-process clocks are indexed by rank)."""

    def __init__(self, conf: dict) -> None:  # the parent's fields over another context (no profiler)
        A2AClock.install()
        self.conf, self.ctx = conf, _MoECtx(conf)
        self.rank, self.d = self.ctx.rank, self.ctx.world
        depth = self.ctx.state.d
        self.splits = {v: (self.ctx.cfg.num_layers // depth,) * depth for v in VARIANTS}
        self.specs = {v: self.ctx.views[v].spec for v in VARIANTS}
        self.entries = [(s, v) for s in conf["systems"] for v in VARIANTS]
        self.runners, self.skipped = {}, {}
        self.prof_system, self.prof = None, None
        self.records, self.idle_cpu, self.balance, self.quiet_wait = [], [], [], []

    def _make(self, s: str, sp: str, m: int):
        from megatron_2bw.moe.layer import set_aux_loss_scale
        from megatron_2bw.schedule.schedules import validate_pipeline
        from megatron_2bw.training.moe_hooks import MoEHooks

        st, w = self.ctx.state, self.ctx.state.replicas
        if s == "single":  # the whole model on rank 0, the same global batch (w x m microbatches)
            if self.rank != 0:
                return None
            runner = SingleRunner(self.ctx.single_views[sp], m * w)
            set_aux_loss_scale(runner.layers, 1.0 / (m * w))
            return runner
        validate_pipeline(s, st.d, m)
        view = self.ctx.views[sp]
        runner = _Engine(view, s, m, spec=view.spec)
        if view.cfg.moe is not None:  # the trainer's MoE hooks: the balancing losses' gradient per microbatch
            runner.stage.before_forward = MoEHooks(runner.stage, st, view.cfg.num_layers, m)
        return runner

    def segment(self, s: str, sp: str, m: int, k: int, rnd: int) -> dict:
        """The parent's segment, plus every process's all-to-all seconds per step and share of its steady
        window (its step 1 .. step k-1 starts)."""
        import torch
        import torch.distributed as dist

        rec = super().segment(s, sp, m, k, rnd)
        if s == "single":
            return rec
        vec = torch.zeros(2 * self.d, dtype=torch.float64)
        r = self.runners[s, sp, m]
        if len(r.clocks) >= k >= 3:
            a2a = r.clocks[k - 1][2] - r.clocks[1][2]
            vec[self.rank] = a2a / (r.marks[k - 1] - r.marks[1])
            vec[self.d + self.rank] = 1e3 * a2a / (k - 2)
        dist.all_reduce(vec)
        if rec:
            rec["a2a_share"], rec["a2a_ms_per_step"] = vec[:self.d].tolist(), vec[self.d:].tolist()
        return rec

    def run(self) -> dict:
        """Warm-up, then the rounds: each round every (system, variant), MoE and dense side by side, the
        order reversed in odd rounds; the stages' compute (the balance ceiling) timed at each round's start."""
        import gc
        import math

        conf = self.conf
        entries_at = self.build()
        for m in conf["ms"]:
            for s, sp in entries_at[m]:
                self.one(s, sp, m, max(2, conf["warmup_steps"]), -1)
        gc.freeze()
        for rnd in range(conf["rounds"]):
            self.balance.append({sp: _stage_compute_ms(self.ctx.views[sp], conf["balance_reps"], self.specs[sp])
                                 for sp in self.splits})
            for m in conf["ms"]:
                k = max(3, conf["steps"] or 2 + math.ceil(conf["window_microbatches"] / m))
                order = entries_at[m] if rnd % 2 == 0 else entries_at[m][::-1]
                for s, sp in order:
                    self.one(s, sp, m, k, rnd)
            if self.rank == 0:
                print(f"[d={self.ctx.state.d} ep={conf['ep']}] round {rnd + 1}/{conf['rounds']} done", flush=True)
        return {"rank": self.rank, "records": self.records, "idle_cpu": self.idle_cpu, "balance_ms": self.balance,
                "splits": {k: list(v) for k, v in self.splits.items()}, "skipped": self.skipped}


def worker(conf: dict) -> dict:
    """Runs inside each of the d x EP processes."""
    return MoEWorker(conf).run()
