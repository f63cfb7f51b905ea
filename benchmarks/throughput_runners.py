"""What runs one segment of each system inside a benchmark process (``throughput_worker.py``): the plain
loop, our engine, torch.distributed.pipelining over the same stages, and the stage timings (block times,
the balanced split, each stage's compute)."""

from __future__ import annotations

import math
import time

import common
from throughput_systems import LR, TORCH, WD

from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.schedule.schedules import SCHEDULES, parse_schedule_id


class _Ctx:
    """What every runner of one worker shares: the model spec, the loss, the data, the groups."""

    def __init__(self, conf: dict):
        import torch
        import torch.distributed as dist

        from megatron_2bw.config import ModelConfig
        from megatron_2bw.models.spec import ModelSpec
        from megatron_2bw.parallel_state import Axes, build_state

        self.conf = conf
        self.d = dist.get_world_size()
        self.rank = dist.get_rank()
        self.state = build_state(Axes(pipeline=self.d), torch.device("cpu"))
        self.cfg = ModelConfig(**conf["model"])
        self.b = conf["micro_batch"]
        torch.manual_seed(1234)
        self.spec = ModelSpec(self.cfg, ModelGroups(), 1234)
        self.loss_fn = self.spec.loss_fn()
        tokens = common.token_pool(self.cfg, conf["pool"], self.b)
        self.batches = [self.spec.make_batch(t) for t in tokens]  # microbatch i = batches[i % pool]
        self.act_shape = (self.b, self.cfg.seq_length, self.cfg.hidden_size)


class Runner:
    """One system at one m: ``run(K)`` trains a segment of K steps.

    Returns this rank's K step-start times (the first forward of each step) and the end time; the
    pipelines also leave ``clocks``: at each step start, (this rank's compute seconds so far, its idle
    seconds so far or None), so the stage's bubble over the steady window is measured per rank."""

    clocks: list[tuple[float, float | None]] = []

    def run(self, k: int) -> list[float]:  # pragma: no cover - interface
        raise NotImplementedError


class SingleRunner(Runner):
    """The plain single-process loop (rank 0 only)."""

    def __init__(self, ctx: _Ctx, m: int):
        import torch
        from torch import nn

        self.ctx, self.m = ctx, m
        L = ctx.cfg.num_layers
        self.layers = nn.ModuleList(ctx.spec.build(0, L + 2))
        self.params = list(self.layers.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, fused=True)
        self.next_mb = 0

    def run(self, k: int) -> list[float]:
        import time as _t

        import torch

        from megatron_2bw.models.spec import run_layers

        ctx, m, marks = self.ctx, self.m, []
        for _ in range(k):
            marks.append(_t.perf_counter())
            for _ in range(m):
                batch = ctx.batches[self.next_mb % len(ctx.batches)]
                self.next_mb += 1
                loss = ctx.loss_fn(run_layers(self.layers, batch), batch) / m
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, ctx.conf["clip"], foreach=True)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        marks.append(_t.perf_counter())
        return marks


class EngineRunner(Runner):
    """Our ``PipelineRank`` (depth d of the world, or d = 1 on rank 0 alone).

    A schedule with several model chunks per rank (``ScheduleSpec.chunks``) gets the chunks its
    placement gives this rank, the model cut evenly into its virtual stages, as ``pretrain_gpt.py``
    builds them (``ModelSpec.build_chunks`` of ``stages.chunk_ranges``)."""

    def __init__(self, ctx: _Ctx, schedule: str, m: int, single: bool = False, spec=None):
        from megatron_2bw.config import OptimizerConfig, PipelineConfig
        from megatron_2bw.parallel_state import ParallelState
        from megatron_2bw.pipeline.build import build_stage

        self.ctx, self.m = ctx, m
        state = ParallelState.single() if single else ctx.state
        d, r = state.d, state.pp_rank
        schedule, pv = parse_schedule_id(schedule)
        chunks = getattr(SCHEDULES[schedule], "chunks", 1) if not single else 1
        extra = {"virtual_stages": chunks} if chunks > 1 else {}
        pipe = PipelineConfig(schedule, ctx.b, m, recompute=False, track_memory=ctx.conf["track_memory"],
                              p2p_mode=ctx.conf["p2p_mode"], post_validation=pv and not single, **extra)
        opt = OptimizerConfig("adam", lr=LR, weight_decay=WD, clip_grad=ctx.conf["clip"], dtype="fp32")
        spec = spec or ctx.spec
        if chunks > 1:
            from megatron_2bw.schedule.stages import chunk_ranges

            place = SCHEDULES[schedule].placement(d)
            ranges = chunk_ranges(ctx.cfg.num_layers, place.stages_of(r), place.num_stages)
            build = lambda: ctx.spec.build_chunks(ranges)  # noqa: E731
        else:
            build = lambda: spec.build_stage(d, r)  # noqa: E731
        self.stage = build_stage(build, ctx.loss_fn, state, pipe, opt, ctx.act_shape)
        if ctx.conf.get("sync_sends"):  # the engine before its send thread: sends issued by the training thread
            self.stage.transport.send_thread = False

    def run(self, k: int) -> list[float]:
        import time as _t

        ctx, m, marks = self.ctx, self.m, {}
        batches, n = ctx.batches, len(ctx.batches)

        st, clocks = self.stage.stats, {}

        def get_batch(mb: int) -> dict:
            if mb % m == 0 and mb // m not in marks:  # every stage fetches every microbatch at its forward
                marks[mb // m] = _t.perf_counter()
                clocks[mb // m] = (st.compute_s, st.idle_s)  # the executor's clocks (StageStats)
            return batches[mb % n]

        self.stage.train(k, get_batch, lambda step: LR)
        self.clocks = [clocks[t] for t in sorted(clocks)]
        return [marks[t] for t in sorted(marks)] + [_t.perf_counter()]


class _TorchStageModule:
    """Built lazily (torch import): an nn.Module running one stage's layer list on plain tensors."""

    @staticmethod
    def make(layers, first: bool):
        from torch import nn

        class StageModule(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(layers)
                self.first = first

            def forward(self, x):
                if self.first:  # the first stage's input is the token ids
                    batch, x = {"tokens": x}, None
                else:
                    batch = {}
                for layer in self.layers:
                    x = layer(x, batch)
                return x

        return StageModule()


class TorchRunner(Runner):
    """A ``torch.distributed.pipelining`` schedule over the same layers: one stage per rank, or (interleaved
    and V schedules) ``v`` model chunks per rank, the model cut into ``d * v`` virtual stages of equal layer
    counts, placed as torch's ``generate_stage_to_rank_mapping`` places them (loop or V).

    Compute is timed by wrapping each torch stage's ``forward_one_chunk``, ``backward_one_chunk``,
    ``backward_weight_one_chunk`` and the loss (host wall clock: exact on CPU), so its bubble per rank
    is measured the way ours is."""

    def __init__(self, ctx: _Ctx, which: str, m: int):
        import torch
        from torch import nn
        from torch.distributed import pipelining as pp
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        from megatron_2bw.models.spec import ModelSpec

        self.ctx, self.m = ctx, m
        st = ctx.state
        d, r = st.d, st.pp_rank
        cls_name, _, v, style = TORCH[which]
        n_stages, L = d * v, ctx.cfg.num_layers
        if L % n_stages:
            raise ValueError(f"{L} layers do not cut into {n_stages} equal virtual stages")
        placement = generate_stage_to_rank_mapping(d, n_stages, style=style) if v > 1 else {i: i for i in range(d)}
        mine = [i for i in range(n_stages) if placement[i] == r]
        spec = ctx.spec if v == 1 else ModelSpec(ctx.cfg, ModelGroups(), 1234)  # even split of L over d*v stages
        self.compute_s = 0.0
        self.modules = [_TorchStageModule.make(spec.build_stage(n_stages, i), first=i == 0) for i in mine]
        self.stages = [pp.PipelineStage(mod, i, n_stages, torch.device("cpu"))
                       for mod, i in zip(self.modules, mine, strict=False)]
        for stage in self.stages:
            self._time(stage, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"))
        self.has_first, self.has_last = 0 in mine, n_stages - 1 in mine
        ones = torch.ones(ctx.b, ctx.cfg.seq_length)
        gpt_loss = ctx.loss_fn

        def loss_fn(out, target):  # the same masked-mean LM loss as the engine's
            t0 = time.perf_counter()
            loss = gpt_loss(out, {"labels": target, "loss_mask": ones})
            self.compute_s += time.perf_counter() - t0
            return loss

        cls = getattr(pp, cls_name)
        # scale_grads=True: mean over microbatches
        self.schedule = cls(self.stages[0] if v == 1 else self.stages, m, loss_fn=loss_fn)
        self.params = [p for mod in self.modules for p in mod.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WD, fused=True)
        # the tied word embedding: the first and the last virtual stage hold a copy; all-reduce its
        # gradient between their ranks, or add the two copies' gradients where one rank holds both (V)
        shared = [p for mod in self.modules for p in mod.parameters() if getattr(p, "shared_embedding", False)]
        self.local_tied = shared if len(shared) == 2 else []
        self.shared = shared if len(shared) == 1 and placement[0] != placement[n_stages - 1] else []
        # each parameter counted once in the global norm (the tied copy only where the first stage is)
        first_mod = self.modules[mine.index(0)] if self.has_first else None
        self.norm_params = [p for mod in self.modules for p in mod.parameters()
                            if mod is first_mod or not getattr(p, "shared_embedding", False)]
        n = len(ctx.batches)
        self.inputs, self.targets = [], []
        for s_ in range(max(1, n // m)):  # whole-batch inputs: m microbatches concatenated
            mbs = [ctx.batches[(s_ * m + i) % n] for i in range(m)]
            self.inputs.append(torch.cat([b["tokens"] for b in mbs]))
            self.targets.append(torch.cat([b["labels"] for b in mbs]))
        self.next_step = 0
        del nn

    def _time(self, stage, names) -> None:
        """Wrap the stage's compute methods with a host clock (``self.compute_s``)."""
        for name in names:
            fn = getattr(stage, name, None)
            if fn is None:
                continue

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.compute_s += time.perf_counter() - t0

            setattr(stage, name, timed)

    def run(self, k: int) -> list[float]:
        import time as _t

        import torch
        import torch.distributed as dist

        st, marks, self.clocks = self.ctx.state, [], []
        for _ in range(k):
            marks.append(_t.perf_counter())
            self.clocks.append((self.compute_s, None))
            i = self.next_step % len(self.inputs)
            self.next_step += 1
            args = (self.inputs[i],) if self.has_first else ()
            kwargs = dict(target=self.targets[i], return_outputs=False) if self.has_last else {}
            self.schedule.step(*args, **kwargs)
            if self.local_tied:
                a, b = (p.grad for p in self.local_tied)
                a.add_(b)
                b.copy_(a)
            for p in self.shared:
                dist.all_reduce(p.grad, group=st.groups.embedding)
            grads = [p.grad for p in self.norm_params if p.grad is not None]
            sumsq = torch.stack(torch._foreach_norm(grads)).square().sum().reshape(1)
            dist.all_reduce(sumsq, group=st.groups.model)
            coef = self.ctx.conf["clip"] / (math.sqrt(float(sumsq)) + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coef)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        marks.append(_t.perf_counter())
        return marks


def _block_ms(ctx: _Ctx, layers, first: bool, last: bool, reps: int) -> float:
    """Median forward+backward ms of one microbatch through ``layers`` (the loss on the last stage)."""
    import time as _t

    import torch

    ts = []
    for i in range(reps + 1):
        batch = ctx.batches[i % len(ctx.batches)]
        x = None if first else torch.randn(ctx.act_shape, requires_grad=True)
        t0 = _t.perf_counter()
        y = x
        for layer in layers:
            y = layer(y, batch)
        if last:
            ctx.loss_fn(y, batch).backward()
        else:
            y.backward(torch.ones_like(y))
        if i:
            ts.append((_t.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def balanced_split(ctx: _Ctx, reps: int) -> tuple[int, ...]:
    """The planner's minimum-bottleneck split of the block times measured on rank 0 (every rank gets it)."""
    import torch.distributed as dist
    from torch import nn

    from megatron_2bw.planner.split import min_bottleneck_split

    d, L = ctx.d, ctx.cfg.num_layers
    out = [None]
    if ctx.rank == 0:
        emb = _block_ms(ctx, nn.ModuleList(ctx.spec.build(0, 1)), True, False, reps)
        layer = _block_ms(ctx, nn.ModuleList(ctx.spec.build(1, 2)), False, False, reps)
        head = _block_ms(ctx, nn.ModuleList(ctx.spec.build(L + 1, L + 2)), False, True, reps)
        base = [0.0] * d
        base[0] += emb
        base[-1] += head
        out[0] = min_bottleneck_split(L, base, [layer] * d)
    dist.broadcast_object_list(out, src=0)
    return tuple(out[0])


def _stage_compute_ms(ctx: _Ctx, reps: int, spec=None) -> list[float]:
    """Forward+backward ms of one microbatch through each stage alone (one stage at a time).

    The pipelines' ceiling is sum(stage times) / max(stage time): stages are cut by layers, and
    the first stage (embedding) is lighter than the last (head and cross-entropy).
    """
    import time as _t

    import torch
    import torch.distributed as dist
    from torch import nn

    st = ctx.state
    layers = nn.ModuleList((spec or ctx.spec).build_stage(st.d, st.pp_rank))
    out = []
    for r in range(st.d):
        dist.barrier()
        if r == st.pp_rank:
            ts = []
            for i in range(reps + 1):
                batch = ctx.batches[i % len(ctx.batches)]
                x = None if st.is_first_stage else torch.randn(ctx.act_shape, requires_grad=True)
                t0 = _t.perf_counter()
                y = x
                for layer in layers:
                    y = layer(y, batch)
                if st.is_last_stage:
                    ctx.loss_fn(y, batch).backward()
                else:
                    y.backward(torch.ones_like(y))
                if i:
                    ts.append((_t.perf_counter() - t0) * 1e3)
            t = torch.tensor([sorted(ts)[len(ts) // 2]], dtype=torch.float64)
        else:
            t = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(t)  # only rank r contributed
        out.append(float(t))
    return out
