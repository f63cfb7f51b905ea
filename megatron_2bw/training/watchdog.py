"""A heartbeat watchdog that names the rank that stopped making progress (``--stall-timeout-s``).

Without it a hung rank (SIGSTOP, a stuck kernel, a dead host) is found only when a
collective times out (10 to 60 minutes) and the message names no one. Here each rank runs
one daemon thread that, every ``interval_s``:

- publishes ``{seq, progress count, seconds since last progress, paused, host, pid}`` under
  its own key in the c10d store (a cloned client with a short timeout, so a store that
  stopped answering cannot block the thread);
- reads the heartbeats of the ranks it watches (its ``fanout`` successors; rank 0 all of
  them), and judges on its own monotonic clock, so clock skew between hosts is harmless:

  1. a heartbeat whose ``seq`` has not changed for ``stall_timeout_s``: that rank stopped
     responding (stopped, dead, or its host is gone);
  2. the store itself has not answered for ``stall_timeout_s``: its host (rank 0, or the
     launcher under torchrun) stopped responding;
  3. (ranks that watch everyone) every rank publishes but none has called :meth:`progress`
     for the progress limit and none is paused: a hang; name the rank(s) whose last
     progress is oldest (the one that got stuck first).

The progress limit, for a slow microbatch: a rank's progress comes once per microbatch, and a long
sequence's microbatch can legitimately take longer than ``stall_timeout_s`` (a 16k-token context-parallel
microbatch on a CPU: about a minute). So each rank measures the longest gap between two of its progress
calls (pauses excluded) and publishes it; the limit is ``max(stall_timeout_s, SLOW_FACTOR x the longest
gap any rank measured)``, at most the pause limit. Until every rank has measured one gap (two progress
calls) the start-up grace (``4 x stall_timeout_s``, from the end of start-up) stands in for it. A true
hang is still named: once no rank progresses for ``SLOW_FACTOR`` times the slowest unit of work seen.

The first detector (by an atomic ``add`` on the store) prints one line; every detector
exits with ``EXIT_STALLED`` through ``os._exit``, so the launcher tears the job down (and
``torchrun --max-restarts`` restarts it from the last checkpoint). The thread only sleeps
and does a few small store operations per interval: no measurable GIL time.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from ..config.rules import check_stall_timeout  # noqa: F401 - one implementation, below the config floor

if TYPE_CHECKING:
    import torch.distributed as dist

EXIT_STALLED = 4
DEFAULT_STALL_TIMEOUT_S = 45.0
DEFAULT_FANOUT = 16


BLIND_INTERVALS = 3  # a store round that succeeds this many intervals after the last: the watchdog was blind
PAUSE_LIMIT_FACTOR = 20  # a save may pause the no-progress rule for this many stall timeouts ...
MIN_PAUSE_LIMIT_S = 600.0  # ... and at least this long (a large checkpoint on a slow file system)
SLOW_FACTOR = 3.0  # no progress for this many times the slowest unit of work measured is a hang (docstring)


def watched_ranks(rank: int, world: int, fanout: int = DEFAULT_FANOUT) -> list[int]:
    """The ranks ``rank`` watches: its ``fanout`` successors (mod world); rank 0 watches everyone."""
    if rank == 0 or world - 1 <= fanout:
        return [r for r in range(world) if r != rank]
    return [(rank + i) % world for i in range(1, fanout + 1)]


def _exit_now(code: int) -> None:
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """One per rank. ``progress()`` from the training loop; ``paused()`` around long legitimate waits."""

    def __init__(self, store, rank: int, world: int, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, *,
                 interval_s: float | None = None, startup_grace_s: float | None = None,
                 fanout: int = DEFAULT_FANOUT, store_host: str | None = None, hosts_store: bool | None = None,
                 exit_fn: Callable[[int], None] = _exit_now, announce: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, pause_limit_s: float | None = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout = float(stall_timeout_s)
        # A save may pause the no-progress rule, but not forever: two jobs saving into one directory hung
        # a job for 280 s with nothing said. Past this a paused rank is judged like any other.
        self.pause_limit = pause_limit_s if pause_limit_s is not None else max(PAUSE_LIMIT_FACTOR * self.timeout,
                                                                               MIN_PAUSE_LIMIT_S)
        self.interval = interval_s if interval_s is not None else min(5.0, max(self.timeout / 10, 0.05))
        self.startup_grace = startup_grace_s if startup_grace_s is not None else 4 * self.timeout
        self.watched = watched_ranks(rank, world, fanout)
        self.watches_all = len(self.watched) == world - 1
        self.store_host = store_host
        # Rank 0 hosts the store unless torchrun's agent does: it must outlive the other detectors' claims.
        self.hosts_store = (rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
                            if hosts_store is None else hosts_store)
        self.exit_fn, self.clock = exit_fn, clock
        self.announce = announce if announce is not None else (lambda line: print(line, file=sys.stderr, flush=True))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.started = clock()
        self._count = 0
        self._last_progress = self.started
        self._longest_gap = 0.0  # the longest time between two progress calls (a microbatch's, at least)
        self._paused = 0
        self._paused_since = self.started
        self._seq = 0
        self._peers: dict[int, dict] = {}  # rank -> {"seq", "changed_at", "seen_at", "info"}
        self._store_ok_at = self.started
        self._store_warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.verdict: str | None = None

    # ------------------------------------------------------------------ called by the training loop
    def progress(self) -> None:
        """Cheap (a few attribute stores): this rank completed a unit of work (a microbatch, a step)."""
        now = self.clock()
        if self._count:
            self._longest_gap = max(self._longest_gap, now - self._last_progress)
        self._count += 1
        self._last_progress = now

    def limit(self) -> float:
        """Seconds without progress on every rank that make a hang (module docstring): the stall timeout,
        scaled to ``SLOW_FACTOR`` times the slowest unit of work any rank measured."""
        gaps = [self._longest_gap] + [p["info"].get("gap", 0.0) for p in self._peers.values()]
        return max(self.timeout, min(SLOW_FACTOR * max(gaps), self.pause_limit))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Suspend the no-progress rule (not the heartbeat) while this rank legitimately waits (a save),
        for at most ``pause_limit`` seconds."""
        if self._paused == 0:
            self._paused_since = self.clock()
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last_progress = self.clock()

    @contextlib.contextmanager
    def starting_up(self) -> Iterator[None]:
        """Model construction and checkpoint restore: the no-progress rule waits (as in :meth:`paused`)
        and the start-up grace counts from the end, however long they took (a large model is drawn in
        full on the CPU on every tensor rank). The heartbeat still names a rank that stops."""
        with self.paused():
            yield
        self.started = self.clock()

    def start(self) -> "Watchdog":
        """Publish a first heartbeat now (so a rank that stops at once is still named), then start the thread."""
        if self.timeout > 0 and self._thread is None:
            try:
                self._publish(self.clock())
            except Exception:  # noqa: BLE001 - the thread retries
                pass
            self._thread = threading.Thread(target=self._run, name="megatron_2bw-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def tick(self) -> str | None:
        """One round: publish, read, judge; on a verdict report it and exit. Returns the verdict (tests)."""
        now = self.clock()
        try:
            self._publish(now)
            self._read(now)
            if now - self._store_ok_at > BLIND_INTERVALS * self.interval:
                self._restart_observation(now)
            self._store_ok_at = now
            self._store_warned = False
        except Exception:  # noqa: BLE001 - a timed-out or refused store operation: judged below
            pass
        verdict = self.judge(self.clock())
        if verdict is not None and self.verdict is None:
            self.verdict = verdict
            self._report(verdict)
        return verdict

    def _restart_observation(self, now: float) -> None:
        """After a stretch without the store (torchrun stopped with SIGSTOP, a network hiccup) no peer could publish:
        their unchanged heartbeats say nothing about them, so their clocks restart now (a peer that really stopped
        is still named one timeout later)."""
        for peer in self._peers.values():
            peer["changed_at"] = peer["seen_at"] = now

    def _publish(self, now: float) -> None:
        self._seq += 1
        info = {"seq": self._seq, "count": self._count, "idle": now - self._last_progress, "gap": self._longest_gap,
                "paused": self._paused > 0, "paused_s": now - self._paused_since if self._paused else 0.0,
                "host": self.host, "pid": self.pid}
        self.store.set(str(self.rank), json.dumps(info))

    def _read(self, now: float) -> None:
        known = [r for r in self.watched if r in self._peers]
        new = [r for r in self.watched if r not in self._peers and self.store.check([str(r)])]
        ranks = known + new
        if not ranks:
            return
        values = self.store.multi_get([str(r) for r in ranks])
        for r, raw in zip(ranks, values):
            info = json.loads(bytes(raw).decode())
            peer = self._peers.get(r)
            if peer is None or peer["info"]["seq"] != info["seq"]:
                self._peers[r] = {"changed_at": now, "seen_at": now, "info": info}

    # ------------------------------------------------------------------ judging (pure given the snapshot)
    def _name(self, r: int) -> str:
        info = self._peers.get(r, {}).get("info")
        if info is None:
            return f"rank {r} (no heartbeat since start-up)"
        return f"rank {r} (host {info['host']}, pid {info['pid']})"

    def judge(self, now: float) -> str | None:
        """The one-line verdict, or None while everything looks alive and progressing."""
        if now - self._store_ok_at > self.timeout:
            host = self.store_host or "its host"
            owner = "the launcher hosts it" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
                else self._name(0) + " hosts it"
            if now - self._last_progress <= self.timeout:  # training goes on without the store: not a hang
                if not self._store_warned:
                    self._store_warned = True
                    self.announce(f"warning: rank {self.rank}: watchdog: the c10d store at {host} has not answered "
                                  f"for {now - self._store_ok_at:.0f} s ({owner}; a stopped launcher?); training "
                                  "continues, the watchdog waits for it")
                return None
            return (f"the c10d store at {host} has not answered for {now - self._store_ok_at:.0f} s ({owner}): "
                    "it stopped responding")
        stale = [(now - (self._peers[r]["changed_at"] if r in self._peers else self.started), r) for r in self.watched]
        stale = [(age, r) for age, r in stale if age > self.timeout]
        if stale:
            age, r = max(stale)
            return f"{self._name(r)} stopped responding {age:.0f} s ago (--stall-timeout-s {self.timeout:g})"
        if self.watches_all:
            return self._judge_progress(now)
        return None

    def _idle(self, now: float) -> dict[int, float] | None:
        """Seconds since each rank's last progress; None when some rank is paused or not yet seen."""
        if self._paused and now - self._paused_since <= self.pause_limit:
            return None
        idle = {self.rank: now - self._last_progress}
        for r in self.watched:
            peer = self._peers.get(r)
            if peer is None:
                return None
            paused_s = peer["info"].get("paused_s", 0.0) + (now - peer["seen_at"])
            if peer["info"]["paused"] and paused_s <= self.pause_limit:
                return None
            idle[r] = peer["info"]["idle"] + (now - peer["seen_at"])
        return idle

    def _judge_progress(self, now: float) -> str | None:
        idle, limit = self._idle(now), self.limit()
        if idle is None or min(idle.values()) <= limit:
            return None
        counts = {r: (self._count if r == self.rank else self._peers[r]["info"]["count"]) for r in idle}
        if min(counts.values()) < 2 and now - self.started <= self.startup_grace:
            return None  # some rank has not measured one unit of work yet: start-up, or a first slow microbatch
        oldest = max(idle.values())
        worst = sorted(r for r, v in idle.items() if v >= oldest - max(1.0, self.interval))
        who = ", ".join(self._name(r) if r != self.rank else f"rank {r} (host {self.host}, pid {self.pid})"
                        for r in worst)
        scaled = f", scaled to {limit:.0f} s by the slowest unit of work measured" if limit > self.timeout else ""
        return (f"no rank made progress for {min(idle.values()):.0f} s (--stall-timeout-s {self.timeout:g}{scaled}); "
                f"the oldest progress is on {who}, {oldest:.0f} s ago (hung in a collective?)")

    def _report(self, verdict: str) -> None:
        first = True
        if not verdict.startswith("the c10d store"):
            try:
                first = int(self.store.add("reported", 1)) == 1
            except Exception:  # noqa: BLE001 - the store failed just now: report anyway
                first = True
        if first:
            self.announce(f"error: rank {self.rank}: watchdog: {verdict}")
        if self.hosts_store:
            time.sleep(2 * self.interval + 0.5)  # keep the store up while the other detectors claim
        self.exit_fn(EXIT_STALLED)


def _watchdog_store(op_timeout_s: float) -> dist.PrefixStore:
    """A private client of the default process group's store, with its own short timeout, under a fresh prefix."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    base = c10d._get_default_store()
    try:
        base = base.clone()
        base.set_timeout(datetime.timedelta(seconds=op_timeout_s))
    except Exception:  # noqa: BLE001 - a store without clone(): share it (ops may then block longer)
        pass
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megatron_2bw/watchdog/{attempt}/", base)


def start_watchdog(stall_timeout_s: float, rank: int | None = None, world: int | None = None,
                   **kwargs) -> Watchdog | None:
    """Start the watchdog after ``init_process_group`` (every rank); None when disabled (0) or single-process."""
    import torch.distributed as dist

    if not stall_timeout_s or not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    if world < 2:
        return None
    interval = kwargs.pop("interval_s", None) or min(5.0, max(stall_timeout_s / 10, 0.05))
    store = _watchdog_store(max(2.0, 2 * interval))
    host = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return Watchdog(store, rank, world, stall_timeout_s, interval_s=interval, store_host=host, **kwargs).start()
