"""Pipeline throughput on CPU: our 2BW / Flush / GPipe against one process and torch.distributed.pipelining.

Every system trains the same GPT layers (``ModelSpec``), split into the same stages
(``stage_range``), on the same microbatches, with the same update work (AdamW with weight
decay, global-norm clipping at 1.0, tied word-embedding gradient all-reduced between the first
and last stage), one torch thread per process and no core pinning:

- ``single``: one process, the whole model, a plain loop: m forward/backward passes
  accumulating gradients, ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` (the fastest
  torch CPU optimizer; a strong baseline).
- ``engine_d1``: our engine with d = 1 (PipeDream-Flush) on the same model: executor overhead.
- ``2bw``, ``flush``, ``gpipe``: our engine at depth d.
- ``torch_1f1b``, ``torch_gpipe``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` and
  ``ScheduleGPipe`` over ``PipelineRank``s wrapping the very same stage layer lists, plus an
  AdamW(fused) step after the same tied-embedding and clipping all-reduces.

Fairness: the d processes are spawned once and every round of every system runs inside that
process group. ``single`` and ``engine_d1`` run on rank 0 while the other ranks wait in a gloo
barrier (blocking, not spinning: the waiting ranks' CPU time is measured and reported), so the
one-process baseline has a whole core, exactly like one stage of the pipelines.

Stage splits: our schedules run each model twice, with the ``uniform`` split (L/d layers per
stage, Megatron's) and the ``balanced`` one (``planner/split.py``'s minimum-bottleneck split of
the per-block forward+backward times measured here on rank 0: embedding, one layer, head and loss).
Each result names its ``model`` (``gpt-4x256``: 4 layers, hidden 256; ``head-heavy``: 8 layers,
hidden 256, vocabulary 32k, where the head outweighs several layers), its ``split`` and
``layers_per_stage``, and ``ideal_speedup`` = sum of the stages' times / the slowest stage's (the
split's ceiling over one process, measured per round).

Measurement: the machine's speed drifts (other jobs, turbo), so systems run in alternating
rounds (round k: single, engine_d1, 2bw, flush, torch_1f1b, gpipe, torch_gpipe, ..., each a segment
of K steps, each of our schedules next to torch's counterpart, before it in even rounds and after it in
odd ones: ``paired_order``, ``round_order``); every ratio
is taken inside one round and the medians over rounds are reported.
Throughput is steady state: on stage 0 the time from the first forward of step 1 to the first
forward of step K-1 of a segment, so it covers K-2 whole steps (bubbles, reductions and updates
included) and excludes only the fill before and the drain after the segment, which a long 2BW
run pays once. The wall-clock throughput of the whole segment is reported next to it. Python's garbage
collector runs before each segment and is off inside it (as Megatron-LM's ``--manual-gc``), for every
system alike: one full collection of these processes takes about a tenth of a steady window.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import os
import sys
import time

import common

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package beside benchmarks/
from megatron_2bw.schedule.schedules import (  # noqa: E402  (pure data: no torch.distributed)
    PLANNED_SCHEDULES, SCHEDULES, parse_schedule_id, spec_of)

# every schedule of our registry, and the ids the planner prices (``zb-h2+pv``: with post-validation): a new
# entry is measured with no change here
OURS = PLANNED_SCHEDULES
# torch's systems: (torch.distributed.pipelining class, our registry's counterpart, model chunks per rank,
# stage-to-rank style); adding one is one line here
TORCH: dict[str, tuple[str, str, int, str]] = {
    "torch_1f1b": ("Schedule1F1B", "flush", 1, "loop"),
    "torch_gpipe": ("ScheduleGPipe", "gpipe", 1, "loop"),
    "torch_interleaved_1f1b": ("ScheduleInterleaved1F1B", "interleaved-1f1b", 2, "loop"),
    "torch_interleaved_zb": ("ScheduleInterleavedZeroBubble", "zb-h1", 2, "loop"),
    "torch_zbv": ("ScheduleZBVZeroBubble", "zb-v", 2, "v"),
    "torch_dualpipe_v": ("ScheduleDualPipeV", "dualpipe-v", 2, "v"),
}
COUNTERPART = {ours: t for t, (_, ours, _, _) in TORCH.items()}  # our schedule -> torch's
SYSTEMS = ("single", "engine_d1", *OURS, *TORCH)
SPLITS = ("uniform", "balanced")
# Named models (ModelConfig fields); ``custom`` is the --layers/--hidden/... flags.
MODELS = {
    "gpt-4x256": dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1000),
    "head-heavy": dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=32000),
}
LR = 1e-4
CLIP = 1.0  # the default of --clip, Megatron's
WD = 0.01


def _fallback_bubble(system: str, d: int, m: int) -> float:
    """Ideal bubble of a torch schedule whose counterpart is not in our registry (yet): equal-cost
    stages, free transfers, forward = input-gradient = weight-gradient time, v = 2 chunks per rank.
    Interleaved 1F1B (Narayanan et al. 2021): a fill and drain of (d - 1) chunk slots, (d-1)/(v m + d-1);
    interleaved ZB-H1 (Qi et al. 2024): each of those slots keeps only F + I - W = 1/3 of it idle;
    ZB-V and DualPipe-V: none at these costs (DualPipe-V's (d/2 - 1) overlapped slots vanish at d = 2)."""
    v = TORCH[system][2]
    if system == "torch_interleaved_1f1b":
        return (d - 1) / (v * m + d - 1)
    if system == "torch_interleaved_zb":
        return (d - 1) / (3 * v * m + d - 1)
    if system in ("torch_zbv", "torch_dualpipe_v"):
        return 0.0 if system == "torch_zbv" or d <= 2 else (d / 2 - 1) * 2 / (3 * v * m + (d / 2 - 1) * 2)
    return (d - 1) / (m + d - 1)


def ideal_bubble(system: str, d: int, m: int) -> float:
    """The schedule's idle fraction per step with balanced stages and free transfers: our registry's
    ``ScheduleSpec.bubble`` (torch's systems: their counterpart's, when it is registered with as many
    chunks per rank; torch's interleaved zero bubble has two, our zb-h1 one)."""
    if system in ("single", "engine_d1"):
        return 0.0
    if system in OURS:
        return spec_of(system).bubble(d, m)
    twin = SCHEDULES.get(TORCH[system][1])
    if twin is not None and getattr(twin, "chunks", 1) == TORCH[system][2]:  # the same layout as ours
        return twin.bubble(d, m)
    return _fallback_bubble(system, d, m)


def ideal_vs_single(system: str, d: int, m: int) -> float:
    """Bubble-limited speedup over one process: d stages busy a (1 - bubble) share of the time."""
    return 1.0 if system in ("single", "engine_d1") else d * (1.0 - ideal_bubble(system, d, m))


def _splits_of(system: str, splits) -> list[str]:
    """The stage splits a system runs: ours with one chunk per rank every split, the rest the uniform one."""
    return list(splits) if system in OURS and spec_of(system).chunks == 1 else ["uniform"]


def paired_order(systems) -> list[str]:
    """The order a round runs ``systems`` in: each of our schedules straight before torch's counterpart, so a
    pair's ratio is taken over the same few seconds of the machine's drifting speed; the rest keep theirs."""
    out: list[str] = []
    for s in systems:
        twin = COUNTERPART.get(s)
        if s in out:
            continue
        out.append(s)
        if twin in systems and twin not in out:
            out.append(twin)
    return out


def round_order(entries, rnd: int) -> list:
    """Round ``rnd``'s (system, split) order: in odd rounds each pair of :func:`paired_order` swapped (torch's
    first), so a drift within a round favours neither side."""
    out = list(entries)
    if rnd % 2:
        i = 0
        while i + 1 < len(out):
            if COUNTERPART.get(out[i][0]) == out[i + 1][0]:
                out[i], out[i + 1] = out[i + 1], out[i]
                i += 2
            else:
                i += 1
    return out


# ============================================================================ runners (inside a worker)
class _Ctx:
    """What every runner of one worker shares: the model spec, the loss, the data, the groups."""

    def __init__(self, conf: dict):
        import torch
        import torch.distributed as dist

        from megatron_2bw.config import ModelConfig
        from megatron_2bw.models.spec import ModelSpec
        from megatron_2bw.parallel_state import build_state
        from megatron_2bw.tensor_parallel.group import TPGroup

        self.conf = conf
        self.d = dist.get_world_size()
        self.rank = dist.get_rank()
        self.state = build_state(1, self.d, 1, torch.device("cpu"))
        self.cfg = ModelConfig(**conf["model"])
        self.b = conf["micro_batch"]
        torch.manual_seed(1234)
        self.spec = ModelSpec(self.cfg, TPGroup(), 1234)
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
        from megatron_2bw.tensor_parallel.group import TPGroup

        self.ctx, self.m = ctx, m
        st = ctx.state
        d, r = st.d, st.pp_rank
        cls_name, _, v, style = TORCH[which]
        n_stages, L = d * v, ctx.cfg.num_layers
        if L % n_stages:
            raise ValueError(f"{L} layers do not cut into {n_stages} equal virtual stages")
        placement = generate_stage_to_rank_mapping(d, n_stages, style=style) if v > 1 else {i: i for i in range(d)}
        mine = [i for i in range(n_stages) if placement[i] == r]
        spec = ctx.spec if v == 1 else ModelSpec(ctx.cfg, TPGroup(), 1234)  # even split of L over d*v stages
        self.compute_s = 0.0
        self.modules = [_TorchStageModule.make(spec.build_stage(n_stages, i), first=i == 0) for i in mine]
        self.stages = [pp.PipelineStage(mod, i, n_stages, torch.device("cpu")) for mod, i in zip(self.modules, mine)]
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
                dist.all_reduce(p.grad, group=st.embedding_group)
            grads = [p.grad for p in self.norm_params if p.grad is not None]
            sumsq = torch.stack(torch._foreach_norm(grads)).square().sum().reshape(1)
            dist.all_reduce(sumsq, group=st.model_group)
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


def worker(conf: dict) -> dict:
    """Runs inside each of the d processes: build every system, then the rounds."""
    import time as _t

    import torch
    import torch.distributed as dist

    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.tensor_parallel.group import TPGroup

    ctx = _Ctx(conf)
    rank, d = ctx.rank, ctx.d
    systems = conf["systems"]
    L = ctx.cfg.num_layers
    splits: dict[str, tuple[int, ...]] = {}
    if "uniform" in conf["splits"] and L % d == 0:
        splits["uniform"] = (L // d,) * d
    if "balanced" in conf["splits"] and d > 1:
        bal = balanced_split(ctx, max(5, conf["balance_reps"]))
        if bal != splits.get("uniform"):
            splits["balanced"] = bal
    specs = {name: ModelSpec(ctx.cfg, TPGroup(), 1234, split=split) for name, split in splits.items()}
    # (system, split): our schedules under every split; the others use the uniform split
    entries = [(s, sp) for s in paired_order(systems) for sp in _splits_of(s, splits)]
    runners: dict[tuple[str, str, int], Runner] = {}
    skipped: dict[str, str] = {}  # "system m=M": why it cannot run here (every rank agrees)

    def make(s: str, sp: str, m: int) -> Runner | None:
        if s in ("single", "engine_d1"):
            if rank != 0:
                return None
            return SingleRunner(ctx, m) if s == "single" else EngineRunner(ctx, "flush", m, single=True)
        if s in OURS:
            from megatron_2bw.schedule.schedules import validate_pipeline

            name, pv = parse_schedule_id(s)
            validate_pipeline(name, d, m, post_validation=pv)  # one line naming what the schedule needs (e.g. m >= d)
            chunks = spec_of(s).chunks
            if L % (d * chunks):
                raise ValueError(f"{L} layers do not cut into d * chunks = {d * chunks} virtual stages")
            return EngineRunner(ctx, s, m, spec=specs[sp])
        return TorchRunner(ctx, s, m)

    for m in conf["ms"]:
        for s, sp in entries:
            try:
                runner, why = make(s, sp, m), None
            except Exception as e:  # noqa: BLE001 - a system that cannot run here is reported, not fatal
                runner, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            flag = torch.tensor([0.0 if why is None else 1.0])
            dist.all_reduce(flag)  # skipped on every rank if any rank cannot build it
            if float(flag):
                skipped[f"{s} m={m}"] = why or "failed on another rank"
            elif runner is not None:
                runners[s, sp, m] = runner
    entries_at = {m: [(s, sp) for s, sp in entries if f"{s} m={m}" not in skipped] for m in conf["ms"]}

    prof_system = conf.get("profile_system")
    prof = cProfile.Profile() if prof_system else None
    records = []  # (round, system, m, steady_s, steady_steps, wall_s, steps)
    idle_cpu = []  # CPU seconds the waiting ranks used per wall second while rank 0 ran alone
    balance = []

    def segment(s: str, sp: str, m: int, k: int, rnd: int) -> dict:
        """One segment of system ``s``; rank 0 gets its record (others get {})."""
        alone = s in ("single", "engine_d1")
        if conf["wait_quiet_s"] > 0 and rnd >= 0:
            if rank == 0:
                quiet_wait.append(common.wait_for_quiet(conf["quiet_cpus"], conf["wait_quiet_s"]))
        # Python's collector off inside a segment, run before it instead (Megatron's --manual-gc): a full
        # collection of these processes (~290k objects after importing torch) takes ~130 ms, a tenth of a
        # steady window, and lands on whichever system happens to allocate past the threshold; the same
        # rule for every system
        gc.collect()
        gc.disable()
        dist.barrier()
        busy0 = common.cpu_busy_seconds() if rank == 0 else 0.0
        w0, c0 = _t.perf_counter(), _t.process_time()
        marks = None
        if rank == 0 or not alone:
            use_prof = prof is not None and s == prof_system and rnd >= 0
            if use_prof:
                prof.enable()
            marks = runners[s, sp, m].run(k - 1 if alone else k)
            if use_prof:
                prof.disable()
        dist.barrier()
        gc.enable()
        wall = _t.perf_counter() - w0
        cpu = _t.process_time() - c0
        busy = common.cpu_busy_seconds() - busy0 if rank == 0 else 0.0
        if alone and rank != 0 and rnd >= 0:
            idle_cpu.append(cpu / wall)
        # per rank over its own steady window (its step 1 .. step k-1 starts): 1 - compute / wall, and
        # (ours) the executor's idle clock (receive and update waits) / wall; NaN where not measured
        n = 3  # per rank: bubble, idle waits, compute ms per microbatch
        vec, miss = torch.zeros(1 + n * d, dtype=torch.float64), torch.zeros(1 + n * d, dtype=torch.float64)
        vec[0] = cpu
        clocks = runners[s, sp, m].clocks if not alone else []
        vals = [None] * n
        if len(clocks) >= k >= 3:
            win, comp = marks[k - 1] - marks[1], clocks[k - 1][0] - clocks[1][0]
            vals[0], vals[2] = 1.0 - comp / win, 1e3 * comp / ((k - 2) * m)
            if clocks[1][1] is not None:
                vals[1] = (clocks[k - 1][1] - clocks[1][1]) / win
        for j, x in enumerate(vals):
            if x is None:
                miss[1 + n * rank + j] = 1.0
            else:
                vec[1 + n * rank + j] = x
        dist.all_reduce(vec)  # CPU seconds of all our ranks (every thread) during the segment; every rank's clocks
        dist.all_reduce(miss)

        def per_rank(j):
            return [None if miss[1 + n * r + j] else float(vec[1 + n * r + j]) for r in range(d)]
        if rank != 0 or rnd < 0:
            return {}
        # pipelines: step 1 .. step k-2 (no fill, no drain); one process: k-1 steps, 1 .. k-2 the same
        return dict(round=rnd, system=s, split=sp, m=m, steady_s=marks[k - 1] - marks[1], steady_steps=k - 2,
                    wall_s=wall, steps=k - 1 if alone else k, own_cpus=float(vec[0]) / wall,
                    foreign_cpus=max(0.0, busy - float(vec[0])) / wall if busy > 0 else None,
                    **({} if alone else {"bubble": per_rank(0), "idle_wait": per_rank(1),
                                         "compute_ms_per_microbatch": per_rank(2)}))

    def one(s: str, sp: str, m: int, k: int, rnd: int) -> None:
        """A segment; with --retry-noisy, re-run (up to N times) while other jobs loaded the machine."""
        for attempt in range(1 + (conf["retry_noisy"] if rnd >= 0 else 0)):
            rec = segment(s, sp, m, k, rnd)
            noisy = torch.tensor([1.0 if rec and (rec["foreign_cpus"] or 0.0) >= conf["quiet_cpus"] else 0.0])
            dist.all_reduce(noisy)  # rank 0 decides for everyone
            if rec:
                rec["attempts"] = attempt + 1
            if not float(noisy) or attempt == conf["retry_noisy"]:
                break
        if rec:
            records.append(rec)

    quiet_wait: list[float] = []
    # warm-up: every system once (shape inference of torch's stages, allocator, caches)
    for m in conf["ms"]:
        for s, sp in entries_at[m]:
            one(s, sp, m, max(2, conf["warmup_steps"]), -1)
    gc.freeze()  # what setup and warm-up made is never collected: the collection before each segment stays short
    for rnd in range(conf["rounds"]):
        balance.append({sp: _stage_compute_ms(ctx, conf["balance_reps"], specs[sp]) for sp in splits})
        for m in conf["ms"]:
            k = max(3, conf["steps"] or 2 + math.ceil(conf["window_microbatches"] / m))
            for s, sp in round_order(entries_at[m], rnd):
                one(s, sp, m, k, rnd)
        if rank == 0:
            print(f"[d={d}] round {rnd + 1}/{conf['rounds']} done", flush=True)
    if prof is not None and conf.get("profile_dir"):
        os.makedirs(conf["profile_dir"], exist_ok=True)
        prof.dump_stats(os.path.join(conf["profile_dir"], f"{prof_system}_d{d}_rank{rank}.pstats"))
    return {"rank": rank, "records": records, "idle_cpu": idle_cpu, "balance_ms": balance, "quiet_wait_s": quiet_wait,
            "splits": {k: list(v) for k, v in splits.items()}, "skipped": skipped}


# ============================================================================ driver
def ceiling_vs_2bw(mine: list | None, theirs: list | None, ib: float | None) -> float | None:
    """The ratio to 2BW a schedule would reach if it idled only for its ideal bubble ``ib``: 2BW's
    (bubble-free) busiest rank's compute per microbatch (``theirs``, per rank) over this schedule's busiest
    rank's (``mine``), both measured in one round, times ``1 - ib``. None where a compute or the ideal is
    missing."""
    if not mine or not theirs or ib is None or None in mine or None in theirs or max(mine) <= 0:
        return None
    return max(theirs) / max(mine) * (1.0 - ib)


def summarize(d: int, conf: dict, out: dict) -> tuple[list[dict], dict]:
    """Per (system, m): medians over rounds of throughput and of the ratios taken inside each round.

    A (round, m) group is *quiet* when the other jobs' load stayed under ``quiet_cpus`` during
    every segment of it; the ``quiet_*`` fields repeat the medians over quiet groups only.
    """
    recs = out["records"]
    b, quiet_cpus = conf["micro_batch"], conf["quiet_cpus"]
    by = {(r["round"], r["system"], r["split"], r["m"]): r for r in recs}
    splits = out["splits"]
    bal = out["balance_ms"]  # per round: {split: [ms of each stage]}
    stage_ms = {sp: [common.median(r[sp][i] for r in bal) for i in range(d)] for sp in splits} if bal else {}
    ceiling = {sp: sum(ms) / max(ms) for sp, ms in stage_ms.items()}

    def sps(r):
        return r["steady_steps"] * r["m"] * b / r["steady_s"] if r else None

    def ratio(x, y):
        return x / y if x and y else None

    results, quiet_groups = [], {}
    for m in conf["ms"]:
        for rnd in range(conf["rounds"]):
            loads = [r.get("foreign_cpus") for r in recs if r["round"] == rnd and r["m"] == m]
            quiet_groups[rnd, m] = bool(loads) and all(x is not None and x < quiet_cpus for x in loads)
        for s, sp in [(s, sp) for s in conf["systems"] for sp in _splits_of(s, splits)]:
            per_round = []
            for rnd in range(conf["rounds"]):
                r = by.get((rnd, s, sp, m))
                if r is None:
                    continue
                one, t1 = by.get((rnd, "single", "uniform", m)), by.get((rnd, "torch_1f1b", "uniform", m))
                twin = by.get((rnd, COUNTERPART.get(s), "uniform", m))  # torch's counterpart, same round
                two = by.get((rnd, "2bw", sp, m)) if s != "2bw" else None  # PipeDream-2BW, same round and split
                wall = r["steps"] * m * b / r["wall_s"]
                wall_single = one and one["steps"] * m * b / one["wall_s"]
                per_round.append(dict(sps=sps(r), vs_single=ratio(sps(r), sps(one)), vs_t1=ratio(sps(r), sps(t1)),
                                      vs_twin=ratio(sps(r), sps(twin)), vs_2bw=ratio(sps(r), sps(two)),
                                      wall=wall, wall_vs_single=ratio(wall, wall_single),
                                      foreign=r.get("foreign_cpus"), quiet=quiet_groups[rnd, m],
                                      bubble=r.get("bubble"), idle=r.get("idle_wait"),
                                      compute=r.get("compute_ms_per_microbatch"),
                                      two=two.get("compute_ms_per_microbatch") if two else None))
            if not per_round:
                continue
            ideal = ideal_vs_single(s, d, m)
            ib = ideal_bubble(s, d, m)
            ceilings = [ceiling_vs_2bw(p["compute"], p.pop("two"), ib) for p in per_round]
            chunks = TORCH[s][2] if s in TORCH else spec_of(s).chunks if s in OURS else 1

            def per_stage(key):
                rows = [p[key] for p in per_round if p[key] is not None]
                return [common.median(x[i] for x in rows) for i in range(d)] if rows else None

            bubble = per_stage("bubble")
            busy = [1.0 - x for x in bubble] if bubble and None not in bubble else None
            vs = [p["vs_single"] for p in per_round if p["vs_single"] is not None]
            quiet = [p for p in per_round if p["quiet"]]
            alone = s in ("single", "engine_d1")
            row = {
                "system": s, "d": 1 if alone else d, "m": m, "model": conf["model_name"], "split": sp,
                # per (virtual) stage: a rank of a two-chunk schedule holds two of them
                "layers_per_stage": [conf["model"]["num_layers"]] if alone else splits[sp] if chunks == 1
                else [conf["model"]["num_layers"] // (d * chunks)] * (d * chunks),
                "ideal_speedup": 1.0 if alone else ceiling.get(sp),
                # the schedule's bubble-limited ideal scaled by the split's imbalance (2BW: the ceiling itself)
                "ideal_vs_single_with_split": ideal if alone or sp not in ceiling else ideal * ceiling[sp] / d,
                "samples_per_sec": common.median(p["sps"] for p in per_round),
                "speedup_vs_single": common.median(vs),
                "ratio_vs_torch_1f1b": common.median(p["vs_t1"] for p in per_round),
                "ideal_vs_single": ideal,
                "ideal_vs_single_on_cores": min(ideal, conf["cpus"]),  # d processes share the machine's cores
                "ideal_vs_torch_1f1b": ideal / ideal_vs_single("torch_1f1b", d, m),
                "chunks_per_rank": chunks,
                "torch_counterpart": COUNTERPART.get(s) if COUNTERPART.get(s) in conf["systems"] else None,
                "ratio_vs_torch_counterpart": common.median(p["vs_twin"] for p in per_round),
                "ratio_vs_torch_counterpart_per_round": [p["vs_twin"] for p in per_round],
                # against our 2BW of the same round and split: what a synchronous schedule gives up to it
                "ratio_vs_2bw": common.median(p["vs_2bw"] for p in per_round),
                "ratio_vs_2bw_per_round": [p["vs_2bw"] for p in per_round],
                # what the ratio to 2BW would be with no idle beyond the schedule's ideal bubble, from the
                # compute the busiest rank of each measured in the same round: the gap between the two is
                # the executor's; the gap from this to 1 is the ideal bubble's and the compute path's
                "ceiling_vs_2bw": common.median(ceilings),
                "ceiling_vs_2bw_per_round": ceilings,
                # the schedule's ideal idle fraction (balanced stages, free transfers) and each stage's measured
                # one over its steady window: 1 - compute / wall (the same clock for ours and torch's)
                "ideal_bubble": None if alone else ib,
                "bubble_per_stage": None if alone else bubble,
                # the ideal once the stages' measured compute is unequal: a stage with less compute than the
                # busiest idles the difference as well
                "ideal_bubble_with_balance_per_stage": ([1.0 - (1.0 - ib) * c / max(busy) for c in busy]
                                                        if busy and max(busy) > 0 else None),
                # ours: the executor's idle clock (receive waits + update waits) / wall, what the trainer logs
                "idle_wait_per_stage": None if alone else per_stage("idle"),
                # each rank's compute per microbatch in the window (all its chunks): a slower compute path
                # shows here, a schedule or transfer stall in the bubble
                "compute_ms_per_microbatch_per_stage": None if alone else per_stage("compute"),
                "wall_samples_per_sec": common.median(p["wall"] for p in per_round),
                "wall_speedup_vs_single": common.median(p["wall_vs_single"] for p in per_round),
                "speedup_vs_single_min": min(vs) if vs else None,
                "speedup_vs_single_max": max(vs) if vs else None,
                "speedup_vs_single_per_round": [p["vs_single"] for p in per_round],
                "ratio_vs_torch_1f1b_per_round": [p["vs_t1"] for p in per_round],
                "rounds": len(per_round),
                "foreign_load_cpus": common.median(p["foreign"] for p in per_round),
                "quiet_rounds": len(quiet),
                "quiet_speedup_vs_single": common.median(p["vs_single"] for p in quiet),
                "quiet_ratio_vs_torch_1f1b": common.median(p["vs_t1"] for p in quiet),
                "compared_in_world_d": d,
            }
            if s == "engine_d1":
                row["overhead_vs_single_pct"] = _overhead(row["speedup_vs_single"])
                row["quiet_overhead_vs_single_pct"] = _overhead(row["quiet_speedup_vs_single"])
            results.append(row)
    rounds_load = []
    for rnd in range(conf["rounds"]):
        xs = [r["foreign_cpus"] for r in recs if r["round"] == rnd and r.get("foreign_cpus") is not None]
        rounds_load.append(sum(xs) / len(xs) if xs else None)
    extra = {
        "stage_compute_ms_per_microbatch": stage_ms.get("uniform", []),
        "balance_ceiling_vs_single": ceiling.get("uniform"),
        "splits": splits,
        "stage_compute_ms_per_microbatch_by_split": stage_ms,
        "ideal_speedup_by_split": ceiling,
        "foreign_load_cpus_per_round": rounds_load,
        "skipped": out.get("skipped", {}),
        "quiet_wait_s_per_segment": out.get("quiet_wait_s"),
        "records": recs,
    }
    return results, extra


def _overhead(speedup: float | None) -> float | None:
    """Step-time overhead in % of a system whose throughput is ``speedup`` x the plain loop's."""
    return 100.0 * (1.0 / speedup - 1.0) if speedup else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--d", type=int, nargs="+", default=[2], help="pipeline depths (one process each; d=4 on 2 cores oversubscribes)")
    p.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="microbatches per step")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians of per-round ratios)")
    p.add_argument("--steps", type=int, default=0, help="steps K per segment of a pipeline, >= 3 (default: 2 + enough steps for --window-microbatches); one process runs K-1")
    p.add_argument("--window-microbatches", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--quiet-cpus", type=float, default=0.3,
                   help="a round of one m is 'quiet' when other jobs used less than this many CPUs in each of its segments")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each segment, wait up to S seconds (<= 240) for the other jobs' load to drop under --quiet-cpus")
    p.add_argument("--retry-noisy", type=int, default=0, metavar="N",
                   help="re-run a segment up to N times while other jobs' load exceeded --quiet-cpus during it "
                        "(the same rule for every system; the last attempt is kept)")
    p.add_argument("--p2p-mode", choices=("prefetch", "grouped"), default="prefetch",
                   help="engine transfers: receives posted ahead (gloo's default) or batch_isend_irecv groups (NCCL's)")
    p.add_argument("--sync-sends", action="store_true",
                   help="engine: issue sends from the training thread (as before the transport's send thread), for A/B runs")
    p.add_argument("--clip", type=float, default=CLIP,
                   help="global-norm clipping of every system (Megatron's 1.0; clips every step on these random "
                        "tokens, whose norms run 1.3-2.6; a larger value is the stable-training regime where it never "
                        "does, which post-validation (zb-h2+pv) assumes)")
    p.add_argument("--track-memory", action="store_true", help="engine: count stashed bytes with saved-tensor hooks (off: pure speed)")
    p.add_argument("--models", nargs="+", choices=(*MODELS, "custom"), default=list(MODELS),
                   help="named models (custom: the --layers/--hidden/... flags)")
    p.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS),
                   help="stage splits for our schedules (balanced: chosen from block times measured on rank 0)")
    p.add_argument("--quick", action="store_true", help="tiny model, m=4, one round: a smoke run (< 30 s)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile-system", choices=SYSTEMS, help="cProfile this system on every rank")
    p.add_argument("--profile-dir", default="benchmarks/results/profile")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 4, 64, 4, 32, 2, 256
        args.m, args.rounds, args.steps, args.warmup_steps = [4], 1, 3, 2
        args.models = ["custom"]
    models = {name: MODELS.get(name) or common.model_dict(args) for name in args.models}
    for name, fields in models.items():
        models[name] = {"kind": "gpt", "max_position_embeddings": fields["seq_length"], **fields}
    conf = dict(model=None, model_name=None, splits=list(args.splits), micro_batch=args.micro_batch, ms=args.m, rounds=args.rounds,
                steps=args.steps, window_microbatches=args.window_microbatches, warmup_steps=args.warmup_steps,
                systems=list(args.systems), track_memory=args.track_memory, pool=64, sync_sends=args.sync_sends,
                cpus=common.machine_info()["cpus_usable"], p2p_mode=args.p2p_mode, quiet_cpus=args.quiet_cpus,
                retry_noisy=max(args.retry_noisy, 0), wait_quiet_s=min(args.wait_quiet, 240.0),
                balance_reps=1 if args.quick else 3, profile_system=args.profile_system, profile_dir=args.profile_dir,
                clip=args.clip)
    for d in args.d:
        for name, fields in models.items():
            if fields["num_layers"] % d:
                p.error(f"model {name}: {fields['num_layers']} layers are not divisible by d={d}")
        if d > min(args.m) and "2bw" in args.systems:
            p.error(f"2BW needs m >= d: m={min(args.m)} < d={d}")
    machine = common.machine_info()
    t0 = time.time()
    all_results, per_model = [], {}
    for name, fields in models.items():
        mconf = {**conf, "model": fields, "model_name": name}
        per_model[name] = {}
        for d in args.d:
            outs = common.spawn(worker, d, mconf, timeout=3600)
            results, extra = summarize(d, mconf, outs[0])
            idle = [x for o in outs[1:] for x in o["idle_cpu"]]
            extra["waiting_ranks_cpu_share"] = common.median(idle)
            per_model[name][str(d)] = extra
            all_results += results
    first = next(iter(models))
    per_d = per_model[first]
    machine["elapsed_s"] = round(time.time() - t0, 1)
    overhead = {str(r["m"]): r.get("overhead_vs_single_pct") for r in all_results
                if r["system"] == "engine_d1" and r["compared_in_world_d"] == args.d[0] and r["model"] == first}

    cols = [("system", "system", ""), ("split", "split", ""), ("layers_text", "layers", ""), ("d", "d", ""), ("m", "m", ""),
            ("samples_per_sec", "samples/s", ".2f"), ("speedup_vs_single", "x single", ".3f"),
            ("ideal_speedup", "split ideal", ".3f"), ("ideal_vs_single_with_split", "ideal w/ split", ".3f"),
            ("ideal_vs_single", "ideal", ".3f"),
            ("ratio_vs_torch_1f1b", "x torch1F1B", ".3f"), ("ideal_vs_torch_1f1b", "ideal", ".3f"),
            ("wall_speedup_vs_single", "wall x single", ".3f"),
            ("speedup_vs_single_min", "min", ".3f"), ("speedup_vs_single_max", "max", ".3f"),
            ("ratio_vs_torch_counterpart", "x torch twin", ".3f"), ("ratio_vs_2bw", "x 2bw", ".3f"),
            ("ceiling_vs_2bw", "ceiling x 2bw", ".3f"),
            ("ideal_bubble", "ideal bubble", ".3f"), ("bubble_text", "bubble per stage", ""),
            ("idle_text", "waits per stage", ""), ("compute_text", "compute ms/mb", ""),
            ("foreign_load_cpus", "other load", ".2f"), ("quiet_rounds", "quiet", ""),
            ("quiet_speedup_vs_single", "q x single", ".3f"), ("quiet_ratio_vs_torch_1f1b", "q x t1F1B", ".3f")]
    def stages_text(xs):
        return " ".join(f"{x:.3f}" if x is not None else "-" for x in xs) if xs else ""

    for r in all_results:
        r_text = ",".join(map(str, r["layers_per_stage"]))
        r["layers_text"] = r_text
        r["bubble_text"], r["idle_text"] = stages_text(r.get("bubble_per_stage")), stages_text(r.get("idle_wait_per_stage"))
        r["compute_text"] = " ".join(f"{x:.1f}" for x in r.get("compute_ms_per_microbatch_per_stage") or [] if x is not None)
    for name, fields in models.items():
        print()
        print(f"{name}: GPT {fields['num_layers']} layers, hidden {fields['hidden_size']}, seq {fields['seq_length']}, "
              f"b {args.micro_batch}, vocab {fields['vocab_size']}; medians of {args.rounds} rounds; "
              f"{machine['cpus_usable']} CPUs, 1 thread/process")
        for d in args.d:
            e = per_model[name][str(d)]
            ms = {sp: [round(x, 1) for x in v] for sp, v in e["stage_compute_ms_per_microbatch_by_split"].items()}
            print(f"\nd = {d}: splits {e['splits']}; stage fwd+bwd ms/microbatch {ms}; ideal (sum/max) "
                  f"{ {sp: round(v, 3) for sp, v in e['ideal_speedup_by_split'].items()} }; "
                  f"waiting ranks' CPU share {common.fmt(e['waiting_ranks_cpu_share'], '.3f')}; "
                  f"other jobs' load per round (CPUs) {[common.fmt(x, '.2f') for x in e['foreign_load_cpus_per_round']]}")
            print(common.table([r for r in all_results if r["compared_in_world_d"] == d and r["model"] == name], cols))
    for r in all_results:
        del r["layers_text"], r["bubble_text"], r["idle_text"], r["compute_text"]
    skipped = {f"{name} d={d}": e["skipped"] for name, pm in per_model.items() for d, e in pm.items() if e["skipped"]}
    for where, what in skipped.items():
        print(f"\nskipped ({where}): " + "; ".join(f"{k}: {v}" for k, v in what.items()))
    print("\nexecutor overhead at d=1 (engine flush vs plain loop), % step time: "
          + ", ".join(f"m={m}: {common.fmt(v, '+.1f')}" for m, v in overhead.items()))
    common.write_json(args.json, {
        "results": all_results, "machine": machine, "per_model": per_model,
        "config": dict(model=models[first], models=models, splits=list(args.splits), micro_batch=args.micro_batch, d=args.d, m=args.m, rounds=args.rounds,
                       steps=args.steps or "auto", window_microbatches=args.window_microbatches,
                       warmup_steps=args.warmup_steps, optimizer=f"adamw lr 1e-4 wd 0.01, clip {args.clip:g}, fp32",
                       clip=args.clip,
                       track_memory=args.track_memory, quick=args.quick, p2p_mode=args.p2p_mode, sync_sends=args.sync_sends,
                       quiet_cpus=args.quiet_cpus, wait_quiet_s=args.wait_quiet, retry_noisy=args.retry_noisy,
                       throughput="steady state: stage 0, first forward of step 1 to first forward of step K-1",
                       gc="collected before each segment, disabled inside it (every system alike)"),
        "per_d": per_d, "executor_overhead_d1_pct": overhead, "skipped": skipped,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
