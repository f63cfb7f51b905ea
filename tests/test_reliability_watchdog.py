"""The watchdog names a stopped or hung rank within --stall-timeout-s: judged on a fake clock and store,
then for real on 4 gloo processes where one rank SIGSTOPs itself while the others wait in a collective."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.errors import ConfigError
from megatron_2bw.training.watchdog import EXIT_STALLED, Watchdog, check_stall_timeout, start_watchdog, watched_ranks


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ring(world: int, timeout: float = 10.0):
    """``world`` watchdogs sharing one in-memory store and one fake clock; exits are recorded, not taken."""
    store, clock, exits, lines = dist.HashStore(), Clock(), [], []
    dogs = [Watchdog(store, r, world, timeout, interval_s=1.0, exit_fn=exits.append, announce=lines.append,
                     clock=clock, hosts_store=False) for r in range(world)]
    return dogs, clock, exits, lines


def _advance(dogs, clock, seconds: float, *, skip=(), progress=()) -> None:
    for _ in range(int(seconds)):
        clock.t += 1.0
        for d in dogs:
            if d.rank in progress:
                d.progress()
        for d in dogs:
            if d.rank not in skip:
                d.tick()


def test_watched_ranks_cover_everyone():
    world, fanout = 100, 4
    watchers = {r: [] for r in range(world)}
    for r in range(world):
        for w in watched_ranks(r, world, fanout):
            watchers[w].append(r)
    assert all(len(v) >= fanout for v in watchers.values())  # every rank has fanout watchers (rank 0 adds one)
    assert watched_ranks(0, world, fanout) == list(range(1, world))
    assert watched_ranks(5, 6, 16) == [0, 1, 2, 3, 4]


def test_stopped_rank_is_named_once_after_the_timeout():
    dogs, clock, exits, lines = _ring(4, timeout=10.0)
    _advance(dogs, clock, 5, progress=range(4))
    assert exits == [] and all(d.judge(clock.t) is None for d in dogs)
    # rank 2 stops (SIGSTOP): its thread no longer publishes; the others keep going
    _advance(dogs, clock, 10, skip={2}, progress={0, 1, 3})
    assert exits == []  # exactly the timeout has passed: not yet
    _advance(dogs, clock, 2, skip={2}, progress={0, 1, 3})
    assert exits == [EXIT_STALLED] * 3
    assert len(lines) == 1, lines
    m = re.fullmatch(r"error: rank (\d): watchdog: rank 2 \(host (\S+), pid (\d+)\) stopped responding (\d+) s ago "
                     r"\(--stall-timeout-s 10\)", lines[0])
    assert m and m.group(2) == dogs[2].host and int(m.group(3)) == os.getpid()
    assert 10 < int(m.group(4)) <= 12


def test_hang_without_progress_names_the_oldest():
    dogs, clock, exits, lines = _ring(3, timeout=10.0)
    _advance(dogs, clock, 3, progress=range(3))
    _advance(dogs, clock, 4, progress={0, 2})   # rank 1 gets stuck first
    _advance(dogs, clock, 10, progress=())       # then everyone waits on it
    assert exits == []  # the newest progress is exactly 10 s old: not yet
    _advance(dogs, clock, 2, progress=())
    assert exits and lines, (exits, lines)
    assert "no rank made progress for" in lines[0] and "the oldest progress is on rank 1 (host" in lines[0]
    assert "rank 0 (" not in lines[0].split("oldest")[1] and "rank 2 (" not in lines[0].split("oldest")[1]


def test_paused_rank_suspends_the_progress_rule_but_not_the_heartbeat():
    dogs, clock, exits, lines = _ring(2, timeout=10.0)
    _advance(dogs, clock, 2, progress=range(2))
    with dogs[0].paused():  # rank 0 saves a checkpoint for a long time; rank 1 waits in the barrier
        _advance(dogs, clock, 30, progress=())
        assert exits == []
        _advance(dogs, clock, 12, skip={1})  # but a stopped peer is still found
    assert exits and "rank 1 (host" in lines[0] and "stopped responding" in lines[0]


def test_a_pause_is_bounded():
    """A save that never ends (two jobs in one --save hung 280 s in silence) is judged after the pause limit."""
    dogs, clock, exits, lines = _ring(2, timeout=10.0)
    for d in dogs:
        d.pause_limit = 40.0
    _advance(dogs, clock, 2, progress=range(2))
    with dogs[0].paused():
        _advance(dogs, clock, 38, progress=())
        assert exits == []  # within the limit: a long save is fine
        _advance(dogs, clock, 5, progress=())
        assert exits and "no rank made progress for" in lines[0], lines
    assert dogs[0].pause_limit == 40.0 and Watchdog(None, 0, 2, 45.0).pause_limit == 900.0


class SwitchableStore:
    """A store that can stop answering (its host, torchrun's agent, stopped with SIGSTOP) and come back."""

    def __init__(self) -> None:
        self.inner, self.down = dist.HashStore(), False

    def __getattr__(self, name):
        op = getattr(self.inner, name)

        def call(*a, **k):
            if self.down:
                raise RuntimeError("Socket Timeout")
            return op(*a, **k)
        return call


def test_a_stopped_store_does_not_kill_a_healthy_job_during_or_after():
    """SIGSTOP of torchrun (which hosts the store): the ranks keep training, so no verdict while it is stopped
    (one warning), and none after it resumes either, though every heartbeat is old by then."""
    store, clock, exits, lines = SwitchableStore(), Clock(), [], []
    dogs = [Watchdog(store, r, 2, 10.0, interval_s=1.0, exit_fn=exits.append, announce=lines.append, clock=clock,
                     hosts_store=False) for r in range(2)]
    _advance(dogs, clock, 3, progress=range(2))
    store.down = True
    _advance(dogs, clock, 40, progress=range(2))
    assert exits == [] and len(lines) == 2 and all("has not answered" in x and "training continues" in x for x in lines)
    store.down = False
    clock.t += 1.0
    dogs[0].tick()  # rank 0 reads before rank 1 has published again: rank 1's heartbeat is 41 s old
    _advance(dogs, clock, 5, progress=range(2))
    assert exits == [], lines
    _advance(dogs, clock, 12, skip={1}, progress={0})  # a rank that really stops is still named
    assert exits and "rank 1 (host" in lines[-1] and "stopped responding" in lines[-1]


def test_start_up_grace_then_hang_before_first_progress():
    dogs, clock, exits, lines = _ring(2, timeout=5.0)
    _advance(dogs, clock, 19, progress=())  # grace is 4 x 5 s: still starting up
    assert exits == []
    _advance(dogs, clock, 3, progress=())
    assert exits and "no rank made progress" in lines[0]


def _microbatches(dogs, clock, count: int, seconds: int) -> None:
    """``count`` microbatches of ``seconds`` each on every rank: progress at each one's start."""
    for _ in range(count):
        _advance(dogs, clock, 1, progress=range(len(dogs)))
        _advance(dogs, clock, seconds - 1, progress=())


def test_slow_microbatches_are_not_a_hang_but_a_hang_after_them_is():
    """Issue 44: a long sequence's microbatch (25 s here) takes longer than --stall-timeout-s (10 s). The first
    is covered by the start-up grace (40 s); from the second on, the limit is 3 x the longest gap measured
    (75 s); a rank that then stops progressing is named once that limit has passed, and not before."""
    dogs, clock, exits, lines = _ring(3, timeout=10.0)
    _microbatches(dogs, clock, 6, 25)
    assert exits == [], lines
    assert all(d.limit() == 75.0 for d in dogs), [d.limit() for d in dogs]
    _advance(dogs, clock, 1, progress={0, 2})  # rank 1 hangs at a microbatch's start
    _advance(dogs, clock, 73, progress=())
    assert exits == [], lines
    _advance(dogs, clock, 3, progress=())
    assert exits and "scaled to 75 s by the slowest unit of work measured" in lines[0], lines
    assert "the oldest progress is on rank 1 (host" in lines[0]


def test_the_slow_limit_needs_a_measured_gap_and_has_a_ceiling():
    """Without a second progress call nothing is scaled (the grace covers the first microbatch, then the
    plain timeout holds); the scaled limit never exceeds the pause limit."""
    dogs, clock, exits, lines = _ring(2, timeout=5.0)
    _advance(dogs, clock, 1, progress=range(2))
    _advance(dogs, clock, 18, progress=())  # one progress each: within the 20 s grace
    assert exits == [] and dogs[0].limit() == 5.0
    _advance(dogs, clock, 3, progress=())
    assert exits and "no rank made progress" in lines[0] and "scaled" not in lines[0]
    dog = _ring(1, timeout=5.0)[0][0]
    dog.progress()
    dog.clock.t += 10_000.0
    dog.progress()
    assert dog.limit() == dog.pause_limit == 600.0


def test_store_that_stops_answering_is_reported():
    class DeadStore:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise RuntimeError("Socket Timeout")
            return fail

    clock, exits, lines = Clock(), [], []
    dog = Watchdog(DeadStore(), 1, 2, 5.0, interval_s=1.0, exit_fn=exits.append, announce=lines.append, clock=clock,
                   store_host="10.0.0.1:29500".replace("10.0.0.1", "nodeA"))
    for _ in range(6):
        clock.t += 1.0
        dog.tick()
    assert exits == [EXIT_STALLED]
    assert lines[0].startswith("error: rank 1: watchdog: the c10d store at nodeA:29500 has not answered for 6 s")


def test_stall_timeout_flag_check():
    check_stall_timeout(0)
    check_stall_timeout(30)
    for bad in (-1, 0.5, float("nan")):
        with pytest.raises(ConfigError, match="--stall-timeout-s must be 0"):
            check_stall_timeout(bad)


# ------------------------------------------------------------------ 4 real processes
STALL_S = 6.0


def _stop_one_rank(tmpdir: str, victim: int) -> None:
    rank = dist.get_rank()
    err = open(os.path.join(tmpdir, f"stderr.{rank}"), "w")
    os.dup2(err.fileno(), 2)  # the watchdog's line goes to fd 2; keep it per rank

    def record_exit(code: int) -> None:
        with open(os.path.join(tmpdir, f"exit.{rank}"), "w") as f:
            f.write(f"{code} {time.time()}\n")
        os._exit(code)

    wd = start_watchdog(STALL_S, exit_fn=record_exit, interval_s=0.5)
    wd.progress()
    dist.barrier()
    with open(os.path.join(tmpdir, f"pid.{rank}"), "w") as f:
        f.write(f"{os.getpid()} {time.time()}\n")
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    import torch
    dist.all_reduce(torch.ones(1))  # blocks forever: the victim never joins
    raise AssertionError("the collective completed without the stopped rank")


def test_sigstopped_rank_is_named_by_a_peer_within_the_timeout(tmp_path):
    victim = 2
    with pytest.raises(RuntimeError) as failure:
        run_workers(_stop_one_rank, 4, str(tmp_path), victim, timeout=120, pg_timeout=100)
    # run_workers SIGKILLs what is left (the stopped rank) on the way out
    victim_pid, stopped_at = (float(x) for x in (tmp_path / f"pid.{victim}").read_text().split())
    deadline = time.time() + 10
    while time.time() < deadline and not all((tmp_path / f"exit.{r}").exists() for r in (1, 3)):
        time.sleep(0.2)
    exits = {r: (tmp_path / f"exit.{r}").read_text().split() for r in (0, 1, 3) if (tmp_path / f"exit.{r}").exists()}
    assert {1, 3} <= set(exits) and all(int(code) == EXIT_STALLED for code, _ in exits.values()), exits
    if 0 not in exits:  # rank 0 hosts the store and waits for the claims; its collective may fail first
        assert "Connection closed by peer" in str(failure.value), str(failure.value)[-2000:]
    first_exit = min(float(t) for _, t in exits.values())
    assert STALL_S < first_exit - stopped_at < STALL_S + 5, first_exit - stopped_at
    reports = [(tmp_path / f"stderr.{r}").read_text() for r in (0, 1, 3)]
    named = [line for text in reports for line in text.splitlines() if "watchdog" in line]
    assert len(named) == 1, reports
    assert f"rank {victim} (host " in named[0] and f"pid {int(victim_pid)})" in named[0]
    assert "stopped responding" in named[0]
    assert not (tmp_path / f"exit.{victim}").exists()
    with pytest.raises(ProcessLookupError):  # it was killed, not left stopped
        for _ in range(50):
            os.kill(int(victim_pid), 0)
            time.sleep(0.1)


def test_start_up_grace_counts_from_the_end_of_model_construction():
    """Review L2: building a large model and restoring its checkpoint can take longer than the grace
    (4 x the timeout); the grace now starts when that is done."""
    dogs, clock, exits, lines = _ring(2, timeout=5.0)
    with dogs[0].starting_up(), dogs[1].starting_up():
        _advance(dogs, clock, 100, progress=())  # 5 x the grace of 20 s
    assert exits == []
    _advance(dogs, clock, 19, progress=())  # the grace, counted from the end of construction
    assert exits == []
    _advance(dogs, clock, 3, progress=())
    assert exits and "no rank made progress" in lines[0]


def test_the_trainer_is_built_inside_the_watchdogs_start_up(monkeypatch):
    """``session.run`` builds the Trainer (model, checkpoint restore) inside ``starting_up``."""
    import types

    import torch

    from megatron_2bw.parallel_state import ParallelState
    from megatron_2bw.training import session as loop

    dog = Watchdog(dist.HashStore(), 0, 2, 5.0, interval_s=1.0, exit_fn=lambda c: None, hosts_store=False)
    seen = {}

    class FakeTrainer:
        def __init__(self, prep, state, faults, wd):
            seen["paused_while_built"] = wd is dog and dog._paused > 0

        def train(self) -> int:
            seen["paused_while_training"] = dog._paused > 0
            return 0

    monkeypatch.setattr(loop.parallel_state, "initialize", lambda *a, **k: ParallelState.single(torch.device("cpu")))
    monkeypatch.setattr(loop.watchdog, "start_watchdog", lambda *a, **k: dog)
    monkeypatch.setattr(loop, "Trainer", FakeTrainer)
    system = types.SimpleNamespace(stall_timeout_s=5.0, timeout_minutes=1.0, device="cpu", backend="gloo")
    cfg = types.SimpleNamespace(system=system, parallel=None, model=types.SimpleNamespace(moe=None),  # a dense model
                                tied_across_ranks=False)
    prep = types.SimpleNamespace(cfg=cfg, loaded_iteration=None)
    assert loop.run(prep, faults=None) == 0
    assert seen == {"paused_while_built": True, "paused_while_training": False}
