"""torchrun without torchrun: an entry point's ranks forked from the tests' preloaded server (``e2e.torchrun``);
and ``python script.py`` without a new interpreter (``e2e.run`` of the project's entry points and tools).

A real ``python -m torch.distributed.run`` costs an interpreter for the agent plus one per worker, each
importing torch and the package (~1.7-2 CPU-s apiece): a 4-rank launch burns ~8 CPU-s before its first step.
Here the ranks are forked from the forkserver that ``tests/multiproc.py`` preloads (about 50 ms each) and
run the script as ``python script.py args`` would (``runpy``, ``sys.argv``, the script's folder first on
``sys.path``), with the variables torchrun's agent gives its workers (rank, world, run id, restart count, the
agent's store) and the agent's store hosted here, as torchrun hosts it. Each rank's stdout and stderr go to files
(``dup2`` inside the rank) that are tailed into the same :class:`e2e.Result` a real launch gives. The status is
torchrun's for runs that succeed (0) and 1 otherwise; tests about failures, signals, restarts or the launcher keep
the real torchrun (``e2e.torchrun(..., real=True)``). A launch past its ``timeout`` is killed and fails (a hang
never sticks). :func:`run_script` is the one-process form, without the agent's variables: the process's own
status, and bash's ``ulimit -f`` / ``umask`` applied inside it where a test asks for them.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import sys
import tempfile
import time
import uuid

import multiproc
import pytest


def agent_env(rank: int, nproc: int, port: int, run_id: str, err_dir: str) -> dict[str, str]:
    """The variables torchrun's agent (one node, ``--standalone``, no restarts) sets for worker ``rank``."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_ERROR_FILE": os.path.join(err_dir, run_id, "attempt_0", str(rank), "error.json"),
    }


def _rank_main(script: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str,
               limits: tuple[int | None, int | None] = (None, None)) -> None:
    """One rank: its output onto the files, the launch's environment and limits (file size in bytes as
    ``ulimit -f``, umask), then ``python script args`` (the script's folder first on ``sys.path``, as there)."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line-buffered, as PYTHONUNBUFFERED
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fsize, umask = limits
    if fsize is not None:  # bash's ``ulimit -f``: whole KiB, soft and hard (the output files count too: keep above)
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize // 1024 * 1024,) * 2)
    if umask is not None:
        os.umask(umask)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    import torch

    # torch read the server's OMP_NUM_THREADS when the server imported it: apply the launch's, as at import
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback and status 1, as the interpreter
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a forked child skips them; the interpreter under torchrun runs them
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


class _Tail:
    """The ranks' output files read as they grow: (seconds since start, line) in arrival order, per stream."""

    def __init__(self, paths: dict[str, list[str]], t0: float) -> None:
        self.paths, self.t0 = paths, t0
        self.lines: list[tuple[float, str]] = []
        self.chunks: dict[str, list[str]] = {"out": [], "err": []}
        self._pos = {p: 0 for ps in paths.values() for p in ps}
        self._rest = {p: b"" for p in self._pos}

    def poll(self, final: bool = False) -> None:
        for key, ps in self.paths.items():
            for p in ps:
                try:
                    with open(p, "rb") as f:
                        f.seek(self._pos[p])
                        data = f.read()
                except FileNotFoundError:
                    continue
                self._pos[p] += len(data)
                buf = self._rest[p] + data
                *whole, self._rest[p] = buf.split(b"\n")
                if final and self._rest[p]:
                    whole.append(self._rest[p])
                    self._rest[p] = b""
                now = time.monotonic() - self.t0
                for raw in whole:
                    line = raw.decode("utf-8", "replace")
                    self.lines.append((now, line))
                    self.chunks[key].append(line + "\n")


def launch(script: str, args: list[str], *, nproc: int, env: dict[str, str], timeout: float, cmd: list[str]):
    """``script args`` on ``nproc`` forked ranks under a torchrun-like environment: an ``e2e.Result``."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)  # torchrun's agent store
    port, run_id = store.port, uuid.uuid4().hex[:12]
    codes, result = _forked(script, args, lambda r, tmp: {**env, **agent_env(r, nproc, port, run_id, tmp)},
                            nproc=nproc, timeout=timeout, cmd=cmd, what="in-process ranks")
    del store
    result.returncode = 0 if all(c == 0 for c in codes) else 1
    return result


def run_script(cmd: list[str], *, env: dict[str, str], timeout: float, cwd: str | None = None,
               fsize: int | None = None, umask: int | None = None):
    """``python script args`` (``cmd``) as one process forked from the preloaded server: its own exit status
    (negative: the signal that ended it, as ``subprocess`` reports it), output and timing, as ``e2e.run``."""
    codes, result = _forked(cmd[1], cmd[2:], lambda r, tmp: dict(env), nproc=1, timeout=timeout, cmd=cmd,
                            what="in-process python", cwd=cwd, limits=(fsize, umask))
    result.returncode = codes[0]
    return result


def _forked(script: str, args: list[str], env_of, *, nproc: int, timeout: float, cmd: list[str], what: str,
            cwd: str | None = None, limits: tuple[int | None, int | None] = (None, None)):
    """``nproc`` processes of ``script args`` forked from the server (``env_of(rank, tmp)`` their environment):
    their exit codes and an ``e2e.Result`` of their output (a hang past ``timeout`` is killed and fails)."""
    from e2e import REPO, Result

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(multiproc.PRELOAD))  # the first launch of the session (server) decides
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="inproc_") as tmp:
        paths = {k: [os.path.join(tmp, f"{r}.{k}") for r in range(nproc)] for k in ("out", "err")}
        procs = [ctx.Process(target=_rank_main, daemon=False, args=(
            os.path.join(REPO, script), list(args), env_of(r, tmp), cwd or REPO, paths["out"][r], paths["err"][r],
            limits)) for r in range(nproc)]
        for p in procs:
            p.start()
        tail = _Tail(paths, t0)
        hang = _wait(procs, tail, t0 + timeout)
        tail.poll(final=True)
    result = Result(cmd, 1, "".join(tail.chunks["out"]), "".join(tail.chunks["err"]), time.monotonic() - t0,
                    tail.lines)
    if hang:
        pytest.fail(f"hang: {' '.join(cmd)} ({what}) still running after {timeout:.0f}s\n{result.stderr[-4000:]}")
    return [p.exitcode for p in procs], result


def _wait(procs, tail: _Tail, deadline: float) -> bool:
    """Tail the output until every rank ended (False) or the deadline passed (True: all killed)."""
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            from e2e import _kill, descendants

            _kill([d for p in procs if p.pid is not None for d in descendants(p.pid)])  # what a rank started
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            return True
        tail.poll()
        time.sleep(0.05)
    for p in procs:
        p.join()
    return False
