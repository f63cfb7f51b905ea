"""Helpers for end-to-end tests: subprocesses with a hard timeout, a tiny cached corpus, shared runs.

``run(cmd, timeout=...)`` starts a command in its own process group and, if it outlives
``timeout``, kills the group and every descendant (torchrun gives each worker its own session):
a hang fails the test, it never blocks CI; ``python`` on an entry point or a tool is forked from the
tests' preloaded server instead (tests/inproc.py). ``torchrun(...)`` runs an entry point's ranks on CPU
(gloo), forked from the tests' preloaded server with torchrun's environment (tests/inproc.py), or
with ``real=True`` under ``python -m torch.distributed.run --standalone`` itself.

Session fixtures (import them into a test module to use them):
- ``corpus``: a ~0.1 MB corpus from tools/build_demo_corpus.py, a 512-piece SentencePiece
  model, a 400-piece one (for vocabulary mismatches) and the indexed dataset, built once;
- ``gpt_2bw_run`` / ``bert_flush_run``: straight training runs with checkpoints every 10
  steps, shared by the end-to-end, resume and kill tests so each costs one launch;
- ``gpt_2bw_killed``: ``gpt_2bw_run``'s flags with rank 1 killed mid-step 13, then a restart.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest

from megatron_2bw.faults import KILL_ITER_ENV, KILL_PLAN_ENV, KILL_RANK_ENV, POISON_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
LAUNCH_TIMEOUT = 240  # seconds; a tiny run takes ~10-30 s on two busy cores


@dataclasses.dataclass
class Result:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    lines: list[tuple[float, str]]  # (seconds since start, line) of stdout and stderr, as they came

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def first_time(self, text: str) -> float | None:
        """Seconds from start until a line containing ``text`` appeared."""
        return next((t for t, line in self.lines if text in line), None)

    def describe(self) -> str:
        return f"$ {' '.join(self.cmd)}\nexit {self.returncode} after {self.seconds:.1f}s\n{self.output[-6000:]}"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any launcher variables (so a child never thinks it is a rank)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
           and k not in (KILL_RANK_ENV, KILL_ITER_ENV, KILL_PLAN_ENV, POISON_ENV)
           and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun puts its workers in their own sessions)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def processes_with(token: str) -> list[int]:
    """Live processes whose command line contains ``token`` (e.g. a run's unique directory)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Started:
    """A command running in its own process group, its output collected as it comes (see :func:`start`)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None, cwd: str) -> None:
        self.cmd, self.t0 = cmd, time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env if env is not None else clean_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.chunks: dict[str, list[str]] = {"out": [], "err": []}
        self.readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, "out"), daemon=True),
                        threading.Thread(target=self._pump, args=(self.proc.stderr, "err"), daemon=True)]
        for r in self.readers:
            r.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self, stream, key: str) -> None:
        for line in stream:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))
            self.chunks[key].append(line)

    def wait_for(self, text: str, timeout: float = LAUNCH_TIMEOUT) -> float:
        """Seconds since start when a line containing ``text`` appeared; fails if the command ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((t for t, line in list(self.lines) if text in line), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not any(r.is_alive() for r in self.readers):
                pytest.fail(f"{' '.join(self.cmd)} ended before printing {text!r}\n"
                            f"{''.join(self.chunks['err'])[-4000:]}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no line with {text!r} after {timeout:.0f}s\n{''.join(self.chunks['err'])[-4000:]}")

    def kill(self) -> None:
        _kill(descendants(self.proc.pid))
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = LAUNCH_TIMEOUT) -> Result:
        """Wait for the exit; on timeout kill it and every descendant and fail (a hang)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            for r in self.readers:
                r.join(timeout=5)
            pytest.fail(f"hang: {' '.join(self.cmd)} still running after {timeout:.0f}s\n"
                        f"{''.join(self.chunks['err'])[-4000:]}")
        for r in self.readers:
            r.join(timeout=30)
        if any(r.is_alive() for r in self.readers):
            pytest.fail(f"{' '.join(self.cmd)} exited but processes it started still hold its output open")
        return Result(self.cmd, self.proc.returncode, "".join(self.chunks["out"]), "".join(self.chunks["err"]),
                      time.monotonic() - self.t0, self.lines)


def start(cmd: list[str], *, env: dict[str, str] | None = None, cwd: str = REPO) -> Started:
    """Start ``cmd`` (its own process group) without waiting: for tests that act on a running job."""
    return Started(cmd, env, cwd)


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = LAUNCH_TIMEOUT, cwd: str = REPO,
        fresh: bool = False, fsize: int | None = None, umask: int | None = None) -> Result:
    """Run ``cmd``; on timeout kill it and all its descendants and fail (a hang). ``fsize`` (bytes, bash's
    ``ulimit -f``) and ``umask`` limit the process. ``python <entry point>`` (``pretrain_*.py``, ``tools/*.py``)
    is forked from the preloaded server (tests/inproc.py: no interpreter start, no torch import) unless ``fresh``
    (what a new interpreter does is the test's subject), a fault variable is set or $E2E_REAL_TORCHRUN is 1;
    anything else runs in a new process group."""
    env = env if env is not None else clean_env()
    if not fresh and _entry_point(cmd) and not any(k in env for k in FAULT_ENVS) and os.environ.get(REAL_ENV) != "1":
        import inproc

        return inproc.run_script(cmd, env=env, timeout=timeout, cwd=cwd, fsize=fsize, umask=umask)
    if fsize is not None or umask is not None:
        setup = (f"ulimit -f {fsize // 1024}; " if fsize is not None else "") + \
            (f"umask {umask:03o}; " if umask is not None else "")
        cmd = ["bash", "-c", setup + 'exec "$@"', "bash", *cmd]
    return start(cmd, env=env, cwd=cwd).finish(timeout)


def _entry_point(cmd: list[str]) -> bool:
    """``cmd`` is ``python`` on one of the project's entry points or tools (not a test's own child script)."""
    if len(cmd) < 2 or cmd[0] != PY or not cmd[1].endswith(".py"):
        return False
    path = os.path.abspath(os.path.join(REPO, cmd[1]))
    folder, name = os.path.split(path)
    return os.path.isfile(path) and (folder == os.path.join(REPO, "tools") or (folder == REPO
                                                                                and name.startswith("pretrain_")))


def torchrun_cmd(script: str, args: list[str], *, nproc: int = 4, launcher: tuple[str, ...] = ("--standalone",)
                 ) -> list[str]:
    return [PY, "-m", "torch.distributed.run", *launcher, f"--nproc-per-node={nproc}", os.path.join(REPO, script),
            *args]


REAL_ENV = "E2E_REAL_TORCHRUN"  # 1: every launch a real process (torchrun, python): to compare, or to rule them out
FAULT_ENVS = (KILL_RANK_ENV, KILL_ITER_ENV, KILL_PLAN_ENV, POISON_ENV)


def torchrun(script: str, args: list[str], *, nproc: int = 4, env: dict[str, str] | None = None,
             timeout: float = LAUNCH_TIMEOUT, real: bool = False) -> Result:
    """``script args`` on ``nproc`` ranks: forked from the preloaded server (tests/inproc.py) unless ``real``
    (the launcher, its statuses, signals, restarts or a fault injected through the environment are the test's
    subject), a fault variable is set, or $E2E_REAL_TORCHRUN is 1. An in-process run that fails is run again
    under the real torchrun, whose Result is returned (a status other than 0 is torchrun's to give), with a
    warning."""
    cmd = torchrun_cmd(script, args, nproc=nproc)
    env = env if env is not None else clean_env()
    if real or any(k in env for k in FAULT_ENVS) or os.environ.get(REAL_ENV) == "1":
        return run(cmd, env=env, timeout=timeout)
    import inproc

    res = inproc.launch(script, args, nproc=nproc, env=env, timeout=timeout, cmd=cmd)
    if res.returncode == 0:
        return res
    warnings.warn(f"in-process launch exited {res.returncode}; running it under torchrun:\n{res.output[-2000:]}",
                  stacklevel=2)
    return run(cmd, env=env, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in records if r["type"] == "train"}


def tool(name: str, *args: str) -> None:
    res = run([PY, os.path.join(REPO, "tools", name), *args], timeout=180)
    assert res.returncode == 0, res.describe()


@dataclasses.dataclass(frozen=True)
class Corpus:
    dir: str
    prefix: str  # indexed dataset prefix (512-piece tokenizer)
    model: str  # SentencePiece model, 512 pieces
    small_model: str  # 400 pieces: does not cover the data's ids

    def data_args(self, split: str = "90,5,5") -> list[str]:
        return ["--data-path", self.prefix, "--split", split, "--tokenizer-type", "SentencePieceTokenizer",
                "--tokenizer-model", self.model]


# Session fixtures imported into several test modules get one pytest definition per module; this
# cache makes each one run once per session anyway.
_ONCE: dict[str, object] = {}


def once(fn):
    """Memoize a session fixture body by name (see ``_ONCE``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if fn.__name__ not in _ONCE:
            _ONCE[fn.__name__] = fn(*args, **kwargs)
        return _ONCE[fn.__name__]

    return wrapper


@pytest.fixture(scope="session")
@once
def corpus(tmp_path_factory) -> Corpus:
    return shared_corpus(tmp_path_factory)


def shared_corpus(tmp_path_factory) -> Corpus:
    """The tests' own small corpus and tokenizers (a fresh clone has no demo_data/), built once a session."""
    d = tmp_path_factory.getbasetemp() / "e2e_corpus"
    c = Corpus(str(d), str(d / "demo_text_document"), str(d / "tok512.model"), str(d / "tok400.model"))
    if not os.path.exists(c.prefix + ".idx"):
        d.mkdir(exist_ok=True)
        tool("build_demo_corpus.py", "--output", str(d / "corpus.jsonl"), "--max-mb", "0.1")
        tool("train_tokenizer.py", "--input", str(d / "corpus.jsonl"), "--vocab-size", "512",
             "--model-prefix", str(d / "tok512"))
        tool("train_tokenizer.py", "--input", str(d / "corpus.jsonl"), "--vocab-size", "400",
             "--model-prefix", str(d / "tok400"))
        tool("preprocess_data.py", "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "demo"),
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", c.model, "--append-eod")
    return c


def train_args(corpus: Corpus, *, preset: str, t: int = 1, d: int = 1, schedule: str = "2bw", iters: int = 30,
               micro: int = 2, global_batch: int = 8, lr: float = 3e-3, extra: tuple[str, ...] = ()) -> list[str]:
    """Flags of a tiny CPU run: logs every 10 steps, evaluation every 10 steps on 2 batches."""
    return [
        "--model-preset", preset, "--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(d),
        "--pipeline-schedule", schedule, "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
        "--train-iters", str(iters), "--lr", str(lr), "--lr-decay-style", "cosine", "--min-lr", "1e-4",
        "--lr-warmup-iters", "3", "--log-interval", "10", "--eval-interval", "10", "--eval-iters", "2",
        "--device", "cpu", *corpus.data_args(), *extra,
    ]


@dataclasses.dataclass
class Run:
    name: str
    args: list[str]
    result: Result
    metrics: list[dict]
    save: str
    script: str


def _straight_run(corpus: Corpus, tmp_path_factory, name: str, script: str, args: list[str]) -> Run:
    out = tmp_path_factory.mktemp(name)
    save, metrics = str(out / "ckpt"), str(out / "metrics.jsonl")
    full = [*args, "--save", save, "--save-interval", "10", "--metrics-file", metrics]
    res = torchrun(script, full)
    assert res.returncode == 0, res.describe()
    return Run(name, args, res, read_metrics(metrics), save, script)


@pytest.fixture(scope="session")
@once
def gpt_2bw_run(corpus, tmp_path_factory) -> Run:
    """GPT, PipeDream-2BW, (d, w) = (2, 2): 30 steps, checkpoints at 10, 20, 30."""
    return _straight_run(corpus, tmp_path_factory, "gpt_2bw_dw", "pretrain_gpt.py",
                         train_args(corpus, preset="gpt-tiny", d=2, schedule="2bw"))


@pytest.fixture(scope="session")
@once
def bert_flush_run(corpus, tmp_path_factory) -> Run:
    """BERT, PipeDream-Flush, (d, w) = (2, 2): 30 steps, checkpoints at 10, 20, 30."""
    return _straight_run(corpus, tmp_path_factory, "bert_flush_dw", "pretrain_bert.py",
                         train_args(corpus, preset="bert-tiny", d=2, schedule="flush"))


KILL_RANK, KILL_ITER = 1, 13


@dataclasses.dataclass
class KilledRun:
    killed: Result
    restarted: Result
    metrics: list[dict]  # the restarted run's
    save: str
    stragglers: list[int]  # processes of the killed job still alive after torchrun returned


@pytest.fixture(scope="session")
@once
def gpt_2bw_killed(corpus, gpt_2bw_run, tmp_path_factory) -> KilledRun:
    """``gpt_2bw_run``'s flags, rank 1 killed mid-step 13 (checkpoints at 10), then a restart with --load."""
    out = tmp_path_factory.mktemp("gpt_2bw_killed")
    save = str(out / "ckpt")
    env = clean_env(**{KILL_RANK_ENV: str(KILL_RANK), KILL_ITER_ENV: str(KILL_ITER)})
    killed = torchrun(gpt_2bw_run.script, [*gpt_2bw_run.args, "--save", save, "--save-interval", "10",
                                           "--metrics-file", str(out / "killed.jsonl")], env=env, real=True)
    stragglers = processes_with(str(out))
    _kill(stragglers)
    metrics = str(out / "restarted.jsonl")
    # the relaunch a user makes: a plain launch (forked ranks; a failure is run again under the real torchrun)
    restarted = torchrun(gpt_2bw_run.script, [*gpt_2bw_run.args, "--save", save, "--load", save,
                                              "--save-interval", "10", "--metrics-file", metrics])
    return KilledRun(killed, restarted, read_metrics(metrics) if os.path.exists(metrics) else [], save, stragglers)
