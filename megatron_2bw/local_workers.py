"""Run a function on N local processes with a hard timeout (the profiler, benchmarks, tests).

``run_workers(fn, n, *args)`` starts ``n`` spawned processes on a fresh free port, calls
``fn(*args)`` in each after ``torch.distributed`` is initialized (gloo by default; with
``backend="nccl"`` rank r first selects GPU r), and returns the list of per-rank return values.
A worker that raises fails the call with its traceback; a job that does not finish within
``timeout`` seconds is killed and fails: a hang is a failure, never a stuck CI. ``fn`` must be a
module-level function (it is pickled by name).

``start_method="forkserver"`` forks the workers from one server process that has imported the
``preload`` modules once (torch and the package take 1-3 s per process to import; a fork takes
about 50 ms), which is what the test suite uses. Either way a worker runs with the caller's
environment and working directory as they are at the call (a forked worker would otherwise see
the server's, fixed when it started). Benchmarks keep ``spawn``: a fresh interpreter per worker,
so what they measure of a process (its resident memory) holds nothing of the server's.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    """A TCP port that is free on this host now (the rendezvous port of one job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_kwargs(backend: str, rank: int) -> dict:
    """NCCL: ``device_id``, so the communicators are made at start-up as the trainer makes them."""
    if backend != "nccl":
        return {}
    import torch

    return {"device_id": torch.device("cuda", rank)}


def _worker(fn: Callable, rank: int, world: int, port: int, args: tuple, queue, pg_timeout: float,
            backend: str, env: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout), **init_kwargs(backend, rank),
        )
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
        # plain pickle bytes: tensors travel by value, not through shared memory that dies with us
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_workers(
    fn: Callable, world: int, *args: Any, timeout: float = 180.0, pg_timeout: float = 120.0, backend: str = "gloo",
    start_method: str = "spawn", preload: tuple[str, ...] = (),
) -> list[Any]:
    """``fn(*args)`` on ``world`` fresh processes; the per-rank results in rank order."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))  # takes effect when the server starts (the first call)
    queue = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue, pg_timeout, backend, env, cwd),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"{fn.__name__} on {world} processes did not finish within {timeout:.0f}s (hang?)")
            try:
                rank, ok, value = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for dead workers
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    raise RuntimeError(f"{fn.__name__}: a worker died with exit code {dead[0].exitcode}") from None
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # peers of a failed rank may block; fail fast
        if errors:
            raise RuntimeError(f"{fn.__name__} failed on {world} processes:\n" + "\n".join(errors))
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
