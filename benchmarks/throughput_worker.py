"""One benchmark process (``pipeline_throughput.py`` starts d of them): every system built, then the
alternating rounds of timed segments; rank 0 returns the records."""

from __future__ import annotations

import cProfile
import gc
import math
import os

import common
from throughput_runners import EngineRunner, Runner, SingleRunner, TorchRunner, _Ctx, _stage_compute_ms, balanced_split
from throughput_systems import OURS, paired_order, round_order, splits_of

from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.schedule.schedules import parse_schedule_id, spec_of

ALONE = ("single", "engine_d1")  # run on rank 0 while the other ranks wait at a barrier


class _Worker:
    """One process's share: the systems it built, and what its segments recorded."""

    def __init__(self, conf: dict) -> None:
        from megatron_2bw.models.spec import ModelSpec

        self.conf, self.ctx = conf, _Ctx(conf)
        self.rank, self.d = self.ctx.rank, self.ctx.d
        self.splits = self._splits()
        self.specs = {name: ModelSpec(self.ctx.cfg, ModelGroups(), 1234, split=split)
                      for name, split in self.splits.items()}
        # (system, split): our schedules under every split; the others use the uniform split
        self.entries = [(s, sp) for s in paired_order(conf["systems"]) for sp in splits_of(s, self.splits)]
        self.runners: dict[tuple[str, str, int], Runner] = {}
        self.skipped: dict[str, str] = {}  # "system m=M": why it cannot run here (every rank agrees)
        self.prof_system = conf.get("profile_system")
        self.prof = cProfile.Profile() if self.prof_system else None
        self.records: list[dict] = []  # (round, system, m, steady_s, steady_steps, wall_s, steps)
        self.idle_cpu: list[float] = []  # CPU seconds the waiting ranks used per wall second while rank 0 ran alone
        self.balance: list[dict] = []
        self.quiet_wait: list[float] = []

    def _splits(self) -> dict[str, tuple[int, ...]]:
        """The uniform split (when the layers divide) and the balanced one (when it differs)."""
        conf, d, L = self.conf, self.d, self.ctx.cfg.num_layers
        splits: dict[str, tuple[int, ...]] = {}
        if "uniform" in conf["splits"] and L % d == 0:
            splits["uniform"] = (L // d,) * d
        if "balanced" in conf["splits"] and d > 1:
            bal = balanced_split(self.ctx, max(5, conf["balance_reps"]))
            if bal != splits.get("uniform"):
                splits["balanced"] = bal
        return splits

    def _make(self, s: str, sp: str, m: int) -> Runner | None:
        ctx, d = self.ctx, self.d
        if s in ALONE:
            if self.rank != 0:
                return None
            return SingleRunner(ctx, m) if s == "single" else EngineRunner(ctx, "flush", m, single=True)
        if s in OURS:
            from megatron_2bw.schedule.schedules import validate_pipeline

            name, pv = parse_schedule_id(s)
            validate_pipeline(name, d, m, post_validation=pv)  # one line naming what the schedule needs (e.g. m >= d)
            chunks, L = spec_of(s).chunks, ctx.cfg.num_layers
            if L % (d * chunks):
                raise ValueError(f"{L} layers do not cut into d * chunks = {d * chunks} virtual stages")
            return EngineRunner(ctx, s, m, spec=self.specs[sp])
        return TorchRunner(ctx, s, m)

    def build(self) -> dict[int, list[tuple[str, str]]]:
        """Every runner; a system any rank cannot build is skipped on all. Returns the entries run at each m."""
        import torch
        import torch.distributed as dist

        for m in self.conf["ms"]:
            for s, sp in self.entries:
                try:
                    runner, why = self._make(s, sp, m), None
                except Exception as e:  # noqa: BLE001 - a system that cannot run here is reported, not fatal
                    runner, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                flag = torch.tensor([0.0 if why is None else 1.0])
                dist.all_reduce(flag)  # skipped on every rank if any rank cannot build it
                if float(flag):
                    self.skipped[f"{s} m={m}"] = why or "failed on another rank"
                elif runner is not None:
                    self.runners[s, sp, m] = runner
        return {m: [(s, sp) for s, sp in self.entries if f"{s} m={m}" not in self.skipped] for m in self.conf["ms"]}

    def _timed(self, s: str, sp: str, m: int, k: int, rnd: int) -> tuple[list | None, float, float, float]:
        """Run one segment between two barriers: (stage 0's step marks, wall s, this process's CPU s, the
        machine's busy CPU s on rank 0)."""
        import time as _t

        import torch.distributed as dist

        alone, rank, conf = s in ALONE, self.rank, self.conf
        if conf["wait_quiet_s"] > 0 and rnd >= 0:
            if rank == 0:
                self.quiet_wait.append(common.wait_for_quiet(conf["quiet_cpus"], conf["wait_quiet_s"]))
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
            use_prof = self.prof is not None and s == self.prof_system and rnd >= 0
            if use_prof:
                self.prof.enable()
            marks = self.runners[s, sp, m].run(k - 1 if alone else k)
            if use_prof:
                self.prof.disable()
        dist.barrier()
        gc.enable()
        wall = _t.perf_counter() - w0
        cpu = _t.process_time() - c0
        busy = common.cpu_busy_seconds() - busy0 if rank == 0 else 0.0
        return marks, wall, cpu, busy

    def _clocks(self, s: str, sp: str, m: int, k: int, marks, cpu: float):
        """Every rank's bubble, idle waits and compute per microbatch over its steady window (NaN where not
        measured: ``miss``), summed over the ranks with our CPU seconds in element 0."""
        import torch
        import torch.distributed as dist

        d, rank = self.d, self.rank
        # per rank over its own steady window (its step 1 .. step k-1 starts): 1 - compute / wall, and
        # (ours) the executor's idle clock (receive and update waits) / wall; NaN where not measured
        n = 3  # per rank: bubble, idle waits, compute ms per microbatch
        vec, miss = torch.zeros(1 + n * d, dtype=torch.float64), torch.zeros(1 + n * d, dtype=torch.float64)
        vec[0] = cpu
        clocks = self.runners[s, sp, m].clocks if s not in ALONE else []
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
        return vec, miss, n

    def segment(self, s: str, sp: str, m: int, k: int, rnd: int) -> dict:
        """One segment of system ``s``; rank 0 gets its record (others get {})."""
        alone, d = s in ALONE, self.d
        marks, wall, cpu, busy = self._timed(s, sp, m, k, rnd)
        if alone and self.rank != 0 and rnd >= 0:
            self.idle_cpu.append(cpu / wall)
        vec, miss, n = self._clocks(s, sp, m, k, marks, cpu)

        def per_rank(j):
            return [None if miss[1 + n * r + j] else float(vec[1 + n * r + j]) for r in range(d)]
        if self.rank != 0 or rnd < 0:
            return {}
        # pipelines: step 1 .. step k-2 (no fill, no drain); one process: k-1 steps, 1 .. k-2 the same
        return dict(round=rnd, system=s, split=sp, m=m, steady_s=marks[k - 1] - marks[1], steady_steps=k - 2,
                    wall_s=wall, steps=k - 1 if alone else k, own_cpus=float(vec[0]) / wall,
                    foreign_cpus=max(0.0, busy - float(vec[0])) / wall if busy > 0 else None,
                    **({} if alone else {"bubble": per_rank(0), "idle_wait": per_rank(1),
                                         "compute_ms_per_microbatch": per_rank(2)}))

    def one(self, s: str, sp: str, m: int, k: int, rnd: int) -> None:
        """A segment; with --retry-noisy, re-run (up to N times) while other jobs loaded the machine."""
        import torch
        import torch.distributed as dist

        conf = self.conf
        for attempt in range(1 + (conf["retry_noisy"] if rnd >= 0 else 0)):
            rec = self.segment(s, sp, m, k, rnd)
            noisy = torch.tensor([1.0 if rec and (rec["foreign_cpus"] or 0.0) >= conf["quiet_cpus"] else 0.0])
            dist.all_reduce(noisy)  # rank 0 decides for everyone
            if rec:
                rec["attempts"] = attempt + 1
            if not float(noisy) or attempt == conf["retry_noisy"]:
                break
        if rec:
            self.records.append(rec)

    def run(self) -> dict:
        """Warm-up, then the rounds (each m's systems in the round's order); this rank's records."""
        conf, rank, d = self.conf, self.rank, self.d
        entries_at = self.build()
        # warm-up: every system once (shape inference of torch's stages, allocator, caches)
        for m in conf["ms"]:
            for s, sp in entries_at[m]:
                self.one(s, sp, m, max(2, conf["warmup_steps"]), -1)
        gc.freeze()  # what setup and warm-up made is never collected: the collection before each segment stays short
        for rnd in range(conf["rounds"]):
            self.balance.append({sp: _stage_compute_ms(self.ctx, conf["balance_reps"], self.specs[sp])
                                 for sp in self.splits})
            for m in conf["ms"]:
                k = max(3, conf["steps"] or 2 + math.ceil(conf["window_microbatches"] / m))
                for s, sp in round_order(entries_at[m], rnd):
                    self.one(s, sp, m, k, rnd)
            if rank == 0:
                print(f"[d={d}] round {rnd + 1}/{conf['rounds']} done", flush=True)
        if self.prof is not None and conf.get("profile_dir"):
            os.makedirs(conf["profile_dir"], exist_ok=True)
            self.prof.dump_stats(os.path.join(conf["profile_dir"], f"{self.prof_system}_d{d}_rank{rank}.pstats"))
        return {"rank": rank, "records": self.records, "idle_cpu": self.idle_cpu, "balance_ms": self.balance,
                "quiet_wait_s": self.quiet_wait, "splits": {k: list(v) for k, v in self.splits.items()},
                "skipped": self.skipped}


def worker(conf: dict) -> dict:
    """Runs inside each of the d processes: build every system, then the rounds."""
    return _Worker(conf).run()
