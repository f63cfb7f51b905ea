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
from megatron_2bw.pipeline.grad_reducer import GradReducer
from megatron_2bw.pipeline.zero import ShardLayout
from megatron_2bw.schedule import schedules
from megatron_2bw.schedule.actions import Action, Op
from megatron_2bw.schedule.grouping import comm_groups
from megatron_2bw.schedule.replay import BLOCKED, Rendezvous, Replay, ScheduleError, Timing
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, stage_actions

pytestmark = pytest.mark.torch_floor


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


class SingleQueue(Replay):
    """N1: one hardware queue per GPU (``CUDA_DEVICE_MAX_CONNECTIONS=1``, or two streams on one connection),
    where a stream wait blocks every stream queued behind it.

    ``settles`` False, the engine before the fix (the review's section 3.1 replay): each grouped transfer's
    ``work.wait()`` is a stream wait and the training thread blocks its host only at APPLY_UPDATE(t) or
    VALIDATE(t). In the worst case the worker queues chain(t)'s cross-stage links behind everything the
    training thread queued until then, so chain(t) is done only once every stage is at that host wait with
    its earlier transfers matched. ``settles`` True, the engine as built (``GradReducer.busy``): before a
    job is queued the training thread settles its unmatched transfers on the host, and while one runs it
    settles each transfer before its stream wait, so no remote wait is ahead of a link: a job's links run
    once every stage has issued the job (REDUCE_GRADS(t); the norm's job at the speculative APPLY_UPDATE(t)
    under post-validation), while each stage blocks at its transfers (the ``Rendezvous`` channel)."""

    def __init__(self, programs, *, settles: bool, **kw) -> None:
        super().__init__(programs, **kw)
        self.settles = settles
        self.arrived: dict[tuple[str, int], dict[int, float]] = {}

    def _arrive(self, key: tuple[str, int], r: int) -> None:
        arrived = self.arrived.setdefault(key, {})
        if r not in arrived:
            arrived[r] = self.clock[r]
            if len(arrived) == self.d:
                self.ready.extend(self.update_waiters.pop(key, ()))

    def _barrier(self, key: tuple[str, int], r: int, i: int) -> int:
        """Block stage ``r`` until every stage arrived at ``key`` (arriving itself first)."""
        self._arrive(key, r)
        arrived = self.arrived[key]
        if len(arrived) < self.d:
            self.update_waiters.setdefault(key, []).append(r)
            return BLOCKED
        self.end[r][i] = self.clock[r] = max(self.clock[r], *arrived.values())
        return i + 1

    def _reduce(self, r: int, i: int, a: Action) -> int:
        if not self.settles:
            self.end[r][i] = self.clock[r]
            return i + 1
        if a.step not in self.validated[r]:  # the norm's job goes with the gradient's
            self._arrive(("norm", a.step), r)
        return super()._reduce(r, i, a)

    def _reduce_embedding(self, r: int, i: int, a: Action) -> int:
        if not self.settles:
            self.end[r][i] = self.clock[r]
            return i + 1
        return super()._reduce_embedding(r, i, a)

    def _update(self, r: int, i: int, a: Action) -> int:
        if not self.settles:
            if a.step in self.validated[r]:  # speculative (lenient: the norm is VALIDATE's)
                self.end[r][i] = self.clock[r]
                return i + 1
            return self._barrier(("host", a.step), r, i)
        nxt = super()._update(r, i, a)
        if nxt != BLOCKED and a.step in self.validated[r]:
            self._arrive(("norm", a.step), r)  # start_norm after the speculative update
        return nxt

    def _validate(self, r: int, i: int, a: Action) -> int:
        return self._barrier(("host" if not self.settles else "norm", a.step), r, i)


def _single_queue(schedule: str, d: int, m: int, settles: bool, pv: bool = False) -> None:
    progs = [stage_actions(schedule, d, r, m, 0, 4, None, pv) for r in range(d)]
    SingleQueue(progs, settles=settles, channel=Rendezvous(comm_groups),
                placement=schedules.get_schedule(schedule).placement(d)).run()


@pytest.mark.parametrize("d", (2, 3, 4))
def test_single_hardware_queue_2bw_deadlocks_with_stream_waits_and_not_as_built(d: int) -> None:
    """N1 (review section 3.1): stream waits on transfers ahead of the reducer's links deadlock 2BW at every
    d and m; settling transfers on the host while the reducer is busy (the engine as built) does not."""
    for m in (d, 2 * d):
        with pytest.raises(ScheduleError, match="deadlock"):
            _single_queue("2bw", d, m, settles=False)
        _single_queue("2bw", d, m, settles=True)


@pytest.mark.parametrize("d", (2, 3, 4))
def test_single_hardware_queue_every_schedule_as_built(d: int) -> None:
    for schedule in SCHEDULE_NAMES:
        spec = schedules.get_schedule(schedule)
        m = max(d, 2, spec.min_microbatches(d))
        for pv in (False, True) if schedule in ("zb-h1", "zb-h2", "zb-v") else (False,):
            _single_queue(schedule, d, m, settles=True, pv=pv)
            if schedule != "2bw":  # the review found only 2BW exposed; so does this model
                _single_queue(schedule, d, m, settles=False, pv=pv)


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
    """A collective whose completion the test's ``settle`` counter controls (done after 3 polls, and not
    while ``_Work.hold`` is set and the work is one of the reducer's)."""

    hold = threading.Event()

    def __init__(self, log: list, name: str, group, *, stream_wait_ok: bool = False, **kw) -> None:
        self.log, self.name, self.group, self.kw, self.polls = log, name, group, kw, 0
        self.thread = threading.current_thread()
        self.unfinished_before = [j for j, w in enumerate(log) if not w.done]  # at issue time
        self.stream_wait_ok, self.waited_unfinished = stream_wait_ok, False
        log.append(self)

    @property
    def done(self) -> bool:
        return self.polls > 3

    def is_completed(self) -> bool:
        if not (self.hold.is_set() and self.thread is not threading.main_thread()):
            self.polls += 1
        return self.done

    def wait(self) -> bool:
        if not self.done:
            assert self.stream_wait_ok, f"wait() on the unfinished {self.name}: a stream wait on other ranks on NCCL"
            self.waited_unfinished = True
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
    red = GradReducer(dp_group="dp", embedding_group="emb", model_group="model", replicas=2, shared_range=(0, 4),
                      bucket_numel=8, has_embedding_group=True, device=torch.device("cpu"), shard=shard)
    red.poll = True  # the CUDA (NCCL) path: settle by polling completion
    return red


def _check_links(log: list[_Work], runs: tuple[range, ...] = ()) -> None:
    """Every link from the worker thread, each issued after every earlier one had completed, except the
    works of one run (a link's buckets: one group, issued back to back)."""
    for k, w in enumerate(log):
        assert w.thread is not threading.main_thread(), w.name
        same = next((run for run in runs if k in run), ())
        assert all(j in same for j in w.unfinished_before), f"{w.name} issued before an earlier link completed"


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
    # N7: the three buckets are issued back to back, before the first one settles; the model group's link
    # only once all three completed
    assert fake_dist[3].unfinished_before == [1, 2] and fake_dist[4].unfinished_before == []
    _check_links(fake_dist, runs=(range(1, 4),))


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


def test_transfers_settle_on_the_host_while_the_reducer_is_busy(fake_dist, monkeypatch) -> None:
    """N1, the engine's side: a grouped transfer's stream wait is allowed while the reducer is idle; before a
    job is queued those transfers are settled on the host (none unfinished when the first link is issued),
    and while the job runs every transfer completes before its ``wait()``."""
    from megatron_2bw.pipeline import transport as tp

    monkeypatch.setattr(tp.dist, "P2POp", lambda fn, tensor, peer, tag=0: (fn, peer, tag))
    p2p: list[_Work] = []

    def batch(ops: list) -> list[_Work]:
        p2p.append(_Work(fake_dist, "p2p", "world", stream_wait_ok=True))
        return p2p[-1:]

    monkeypatch.setattr(tp.dist, "batch_isend_irecv", batch)
    red = _reducer()
    link = tp.Transport(0, None, (2,), torch.float32, torch.device("cpu"), mode="grouped")
    link.poll = True  # NCCL on CUDA
    link.settle_while, red.before_issue = red.busy, link.quiesce  # as the executor wires them
    send = [Action(Op.SEND_GRAD, 0)]

    link.exchange(send, {send[0]: torch.ones(2)})
    assert p2p[0].waited_unfinished and not red.busy()  # idle: the stream waits, the host goes on
    _Work.hold.set()  # the worker's links do not complete until released
    try:
        grad = torch.arange(20, dtype=torch.float32)
        red.start(0, grad, [grad])
        assert p2p[0].done and red.busy()
        link.exchange(send, {send[0]: torch.ones(2)})  # while the chain runs
        assert p2p[1].done and not p2p[1].waited_unfinished
    finally:
        _Work.hold.clear()
    assert red.finish(0) == pytest.approx(float((grad.double() ** 2).sum()), rel=1e-6) and not red.busy()
    links = [w for w in fake_dist if w.name != "p2p"]
    assert links and all(fake_dist.index(p2p[0]) not in w.unfinished_before for w in links)
    link.exchange(send, {send[0]: torch.ones(2)})
    assert p2p[2].waited_unfinished  # idle again: back to stream waits
