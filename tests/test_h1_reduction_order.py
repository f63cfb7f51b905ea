"""Review findings H1, S2 and P1: the reduction chain never makes a GPU stream wait on another rank.

H1. If a wait on a cross-rank collective blocks the rank's later work (one hardware queue with
``CUDA_DEVICE_MAX_CONNECTIONS=1``, or ``TORCH_NCCL_BLOCKING_WAIT=1``), a chain expressed as stream
waits behaves as if REDUCE_GRADS(t) blocked the program until every stage reached it, and 2BW
deadlocks (``ChainInProgram``, the review's appendix A, pins this down). The reducer instead runs
every link on its worker thread and issues a link only once the previous one has completed, so
under the same blocking semantics (every collective and every grouped transfer a rendezvous) the
program blocks only at APPLY_UPDATE(t), for chain(t), and at a forward, for the all-gather of its
weights (``EngineModel``): deadlock-free for every schedule at d = 2, 3, 4, with and without the
distributed optimizer. ``test_reducer_*`` checks that the real :class:`GradReducer` has the
properties that model assumes, with fake collectives whose completion the test controls.

P1. The all-gather of W(t+1) shares the worker with chain(t+1); the schedule issues it first on
every stage, and half-way between step t's reductions and the first forward on W(t+1), so 2BW
with the distributed optimizer is as fast as without it in the timed model, also with collectives
that take time (the old order is measurably slower there: the model can tell them apart).
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_2bw.pipeline import grad_reducer, zero
from megatron_2bw.schedule import schedules
from megatron_2bw.schedule.actions import Action, Op
from megatron_2bw.pipeline.grad_reducer import GradReducer
from megatron_2bw.schedule.grouping import comm_groups
from megatron_2bw.schedule.replay import BLOCKED, Rendezvous, Replay, ScheduleError, Timing
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, stage_actions
from megatron_2bw.pipeline.zero import ShardLayout


# --------------------------------------------------------------------------- replay models
class ChainInProgram(Replay):
    """The chain as stream waits under blocking semantics: REDUCE_GRADS(t) blocks its stage until every
    stage has reached it (a collective of the model group)."""

    def _reduce(self, r: int, i: int, a: Action) -> int:
        arrived = self.launched.setdefault(a.step, {})
        if r not in arrived:
            arrived[r] = self.clock[r]
            if len(arrived) == self.d:
                self.reduced_at[a.step] = max(arrived.values())
                self.ready.extend(self.update_waiters.pop(("red", a.step), ()))
        if a.step not in self.reduced_at:
            self.update_waiters.setdefault(("red", a.step), []).append(r)
            return BLOCKED
        self.end[r][i] = self.clock[r] = max(self.clock[r], self.reduced_at[a.step])
        return i + 1


class EngineModel(Replay):
    """The engine as built: REDUCE_GRADS(t) and (``zero``) APPLY_UPDATE(t)'s all-gather of W(t+1) only
    queue a job on the stage's worker, which runs its jobs in order, each link a rendezvous: chain(t)
    ends when every stage's worker has reached it; a gather among the stage's replicas (which run
    the same program) ends when its worker reaches it. APPLY_UPDATE(t) waits for chain(t); a
    forward on W(v), v >= 1, waits for the gather of W(v)."""

    def __init__(self, programs, *, zero: bool, **kw) -> None:
        super().__init__(programs, **kw)
        self.zero = zero
        self.lane: list[list[tuple[str, int, float]]] = [[] for _ in range(self.d)]  # (kind, step or version, issued)
        self.lane_free = [0.0] * self.d
        self.gathered: list[dict[int, float]] = [{} for _ in range(self.d)]  # version -> its gather done
        self.gather_waiters: dict[tuple[int, int], int] = {}
        self.chain_s = self.gather_s = 0.0  # how long a chain / an all-gather takes once every member is in

    def _pump(self) -> None:
        """Run every worker until each is empty or waits for another stage's worker at a chain."""
        progress = True
        while progress:
            progress = False
            for r in range(self.d):
                while self.lane[r] and self.lane[r][0][0] == "gather":
                    _, v, issued = self.lane[r].pop(0)
                    self.lane_free[r] = self.gathered[r][v] = max(issued, self.lane_free[r]) + self.gather_s
                    if (r, v) in self.gather_waiters:
                        self.ready.append(self.gather_waiters.pop((r, v)))
                    progress = True
            heads = [q[0] if q else None for q in self.lane]
            if all(h is not None and h[0] == "chain" for h in heads) and len({h[1] for h in heads}) == 1:
                t = heads[0][1]
                done = max(max(h[2], free) for h, free in zip(heads, self.lane_free)) + self.chain_s
                for r in range(self.d):
                    self.lane[r].pop(0)
                    self.lane_free[r] = done
                self.reduced_at[t] = done
                self.ready.extend(self.update_waiters.pop(t, ()))
                progress = True

    def _reduce(self, r: int, i: int, a: Action) -> int:
        self.lane[r].append(("chain", a.step, self.clock[r]))
        self._pump()
        self.end[r][i] = self.clock[r]
        return i + 1

    def _update(self, r: int, i: int, a: Action) -> int:
        nxt = super()._update(r, i, a)
        if nxt != BLOCKED and self.zero:
            self.lane[r].append(("gather", a.step + 1, self.clock[r]))
            self._pump()
        return nxt

    def _forward(self, r: int, i: int, a: Action) -> int:
        if self.zero and a.version >= 1:
            done = self.gathered[r].get(a.version)
            if done is None:
                self.gather_waiters[(r, a.version)] = r
                return BLOCKED
            self.clock[r] = max(self.clock[r], done)
        return super()._forward(r, i, a)


def _programs(schedule: str, d: int, m: int, steps: int, last_stage_reduce_first: bool = False) -> list[list[Action]]:
    progs = [stage_actions(schedule, d, r, m, 0, steps) for r in range(d)]
    if last_stage_reduce_first:  # the order before the P1 fix: REDUCE_GRADS(t+1) before APPLY_UPDATE(t)
        p = progs[-1]
        for i in range(len(p) - 1):
            if p[i].op is Op.APPLY_UPDATE and p[i + 1].op is Op.REDUCE_GRADS and p[i + 1].step == p[i].step + 1:
                p[i], p[i + 1] = p[i + 1], p[i]
    return progs


# --------------------------------------------------------------------------- H1: the replays
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("d", (2, 3, 4))
def test_blocking_collectives_never_deadlock_the_engine(schedule: str, d: int) -> None:
    least = schedules.get_schedule(schedule).min_microbatches(d)  # zb-v: 2d - 1
    for m in sorted({max(d, 2, least), 2 * d}):
        for use_zero in (False, True):
            EngineModel(_programs(schedule, d, m, 4), zero=use_zero, channel=Rendezvous(comm_groups),
                        placement=schedules.get_schedule(schedule).placement(d)).run()


@pytest.mark.parametrize("d", (2, 3, 4))
def test_a_chain_of_stream_waits_deadlocks_2bw_under_the_same_semantics(d: int) -> None:
    """The hazard the design removes: the model tells it apart (flush and gpipe survive even this)."""
    with pytest.raises(ScheduleError, match="deadlock"):
        ChainInProgram(_programs("2bw", d, d, 3), channel=Rendezvous(comm_groups)).run()
    for schedule in ("flush", "gpipe"):
        ChainInProgram(_programs(schedule, d, d, 3), channel=Rendezvous(comm_groups)).run()


# --------------------------------------------------------------------------- P1: order and time
@pytest.mark.parametrize("d", (1, 2, 3, 4, 8))
def test_every_stage_applies_update_t_before_it_reduces_step_t_plus_1(d: int) -> None:
    for m in (d, 2 * d):
        for r in range(d):
            prog = stage_actions("2bw", d, r, m, 0, 5)
            at = {(a.op, a.step): i for i, a in enumerate(prog) if a.op in (Op.APPLY_UPDATE, Op.REDUCE_GRADS)}
            for t in range(4):
                assert at[(Op.APPLY_UPDATE, t)] < at[(Op.REDUCE_GRADS, t + 1)], (d, m, r, t)


def _old_programs(monkeypatch, d: int, m: int, steps: int) -> list[list[Action]]:
    """The 2BW order before the P1 fix: APPLY_UPDATE(t) just before step t+2's first forward, after
    REDUCE_GRADS(t+1) on the last stage."""
    monkeypatch.setattr(schedules._TwoBW, "update_forward", staticmethod(lambda d, m: m))
    try:
        return _programs("2bw", d, m, steps, last_stage_reduce_first=True)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("d", (2, 4, 8))
def test_the_all_gather_hides_in_the_timed_model(monkeypatch, d: int) -> None:
    """Forward 1, backward 2, 6 steps (the review's appendix C), free collectives: 2BW with the
    distributed optimizer takes exactly as long as without it; the old order stalls on the last stage
    (75 -> 83 at d = 2, as the review modelled). With a reduction chain of 3 units and an all-gather
    of 1 (m = 2d): still exactly as long as 2BW without the distributed optimizer."""
    m = 2 * d
    timing = Timing((1.0,) * d, (2.0,) * d, *([(0.0,) * d] * 5))

    def makespan(progs, zero_on: bool, chain_s: float = 0.0, gather_s: float = 0.0) -> float:
        model = EngineModel(progs, zero=zero_on, timing=timing)
        model.chain_s, model.gather_s = chain_s, gather_s
        return model.run().makespan

    new, old = _programs("2bw", d, m, 6), _old_programs(monkeypatch, d, m, 6)
    plain = makespan(new, False)
    assert makespan(new, True) == plain == makespan(old, False)
    assert makespan(old, True) > plain * 1.05
    assert makespan(new, True, 3.0, 1.0) == makespan(new, False, 3.0) < makespan(old, True, 3.0, 1.0)


# --------------------------------------------------------------------------- the reducer itself
class _Work:
    """A collective whose completion the test's ``settle`` counter controls (done after 3 polls)."""

    def __init__(self, log: list, name: str, group, **kw) -> None:
        self.log, self.name, self.group, self.kw, self.polls = log, name, group, kw, 0
        self.thread = threading.current_thread()
        self.earlier = [w for w in log if w is not self]
        log.append(self)

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls > 3

    def wait(self) -> bool:
        assert self.polls > 3, f"wait() on the unfinished {self.name}: a stream wait on other ranks on NCCL"
        return True


@pytest.fixture
def fake_dist(monkeypatch):
    log: list[_Work] = []
    d = grad_reducer.dist

    def collective(name: str):
        return lambda *args, group=None, async_op=False, src=None, **kw: _Work(
            log, name, group, **({"src": src} if name == "broadcast" else {"n": args[0].numel()}))

    monkeypatch.setattr(d, "all_reduce", collective("all_reduce"))
    monkeypatch.setattr(d, "broadcast", collective("broadcast"))
    monkeypatch.setattr(d, "get_global_rank", lambda group, r: {"dp": 6}[group] + r)
    monkeypatch.setattr(zero, "_gloo", lambda group: False)  # the NCCL collectives
    monkeypatch.setattr(zero, "_reduce_scatter", collective("reduce_scatter"))
    monkeypatch.setattr(zero, "_all_gather", collective("all_gather"))
    return log


def _reducer(shard: ShardLayout | None = None) -> GradReducer:
    red = GradReducer(dp_group="dp", embedding_group="emb", model_group="model", w=2, shared_range=(0, 4),
                      bucket_numel=8, has_embedding_group=True, device=torch.device("cpu"), shard=shard)
    red.poll = True  # the CUDA (NCCL) path: settle by polling completion
    return red


def _check_links(log: list[_Work]) -> None:
    """Every link from the worker thread, each issued after every earlier one had completed."""
    for w in log:
        assert w.thread is not threading.main_thread(), w.name
        assert all(e.polls > 3 for e in w.earlier), f"{w.name} issued before an earlier link completed"


def test_reducer_orders_the_chain_on_its_worker_and_broadcasts_the_norm(fake_dist) -> None:
    red = _reducer()
    grad = torch.arange(20, dtype=torch.float32)
    red.start(0, grad, [grad[:12], grad[12:]])
    sumsq = red.finish(0)
    assert isinstance(sumsq, float) and sumsq == float((grad.double() ** 2).sum())
    assert [(w.name, w.group) for w in fake_dist] == [
        ("all_reduce", "emb"), *[("all_reduce", "dp")] * 3, ("all_reduce", "model"), ("broadcast", "dp")]
    assert [w.kw["n"] for w in fake_dist[1:4]] == [8, 8, 4]  # the buckets
    assert fake_dist[-1].kw["src"] == 6  # S2: data-parallel rank 0's total reaches every replica
    _check_links(fake_dist)


def test_reducer_distributed_optimizer_chain_and_gather(fake_dist) -> None:
    layout = ShardLayout(16, 2, 0)
    red = _reducer(layout)
    grad = torch.ones(16)
    red.start(0, grad, [grad])
    red.finish(0)
    red.gather(1, torch.zeros(16))
    red.wait_slot(1)
    assert [(w.name, w.group) for w in fake_dist] == [
        ("all_reduce", "emb"), ("reduce_scatter", "dp"), ("all_reduce", "dp"), ("all_reduce", "model"),
        ("broadcast", "dp"), ("all_gather", "dp")]
    _check_links(fake_dist)
