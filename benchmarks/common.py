"""Helpers shared by the benchmarks: model flags, data, process spawning, statistics and output.

Nothing here measures anything by itself. The benchmarks are scripts (``python
benchmarks/<name>.py``); this module sits beside them and is imported as ``common``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------- model flags
def add_model_args(p: argparse.ArgumentParser, *, layers=4, hidden=256, heads=4, seq=128, micro_batch=4,
                   vocab=1000) -> None:
    g = p.add_argument_group("model (a GPT built from megatron_2bw's layers)")
    g.add_argument("--layers", type=int, default=layers, help="transformer layers (divisible by every d)")
    g.add_argument("--hidden", type=int, default=hidden)
    g.add_argument("--heads", type=int, default=heads)
    g.add_argument("--seq", type=int, default=seq, help="sequence length")
    g.add_argument("--micro-batch", type=int, default=micro_batch, help="b, samples per microbatch")
    g.add_argument("--vocab", type=int, default=vocab, help="vocabulary (padded to a multiple of 128)")


def model_dict(args: argparse.Namespace) -> dict:
    """ModelConfig fields of the flags (a plain dict: it travels to spawned processes)."""
    return dict(kind="gpt", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=args.vocab)


def token_pool(cfg, n: int, b: int, seed: int = 99):
    """``n`` fixed random microbatches of GPT token samples, ``[n, b, s+1]`` (int64)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, b, cfg.seq_length + 1), generator=g)


# ---------------------------------------------------------------------------------------- machine
def machine_info() -> dict:
    import torch

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    info = {
        "cpu": model or platform.processor(), "logical_cpus": os.cpu_count(), "cpus_usable": affinity,
        "loadavg_at_start": load, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads_per_process": 1,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def cpu_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes, every core), from /proc/stat.

    Differences over a segment, minus our own processes' CPU time, give the load that other jobs
    put on the machine while we measured (0 where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    v = [int(x) for x in fields]
    busy = v[0] + v[1] + v[2] + sum(v[5:8])  # user nice system irq softirq steal (not idle, iowait)
    return busy / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_cpus: float, timeout_s: float, sample_s: float = 1.0) -> float:
    """Sleep until the machine's busy CPUs (sampled over ``sample_s``) drop under ``max_cpus``;
    give up after ``timeout_s``. Call while our own processes idle. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        b0 = cpu_busy_seconds()
        time.sleep(sample_s)
        if (cpu_busy_seconds() - b0) / sample_s < max_cpus:
            break
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------------- processes
# How workers start: "spawn", a fresh interpreter each, so what a benchmark measures of a process (its resident
# memory) holds nothing of another's. The smoke tests, which check the JSON and its arithmetic and not the numbers
# of a process, fork them from their preloaded server instead ("forkserver": no torch import per worker).
START_METHOD = "spawn"


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 1800.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` spawned gloo processes (1 torch thread each, no core pinning).

    The processes are started once and live for the whole call, so every round of a benchmark
    runs inside the same process group (the package's ``local_workers``, with a longer collective
    timeout: a rank may wait at a barrier while the other measures the single-process baseline).
    """
    from megatron_2bw.local_workers import run_workers

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children before torch loads there
    return run_workers(fn, world, *args, timeout=timeout, pg_timeout=300.0, start_method=START_METHOD)


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ideal_vs_single(system: str, d: int, m: int) -> float:
    """Bubble-limited speedup over one process with perfectly balanced stages and free transfers."""
    if system in ("single", "engine_d1"):
        return 1.0
    if system == "2bw":
        return float(d)
    return d * m / (m + d - 1)  # flush, gpipe, torch_1f1b, torch_gpipe: a fill and a drain every step


# ---------------------------------------------------------------------------------------- output
def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def table(rows: Sequence[dict], cols: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table; ``cols`` are (key, header, format spec)."""
    cells = [[h for _, h, _ in cols]] + [[fmt(r.get(k), s) for k, _, s in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _one_line(call, *args, **kwargs):
    """``call``'s result; its ConfigError as one ``error:`` line and exit status 2 (as the tools)."""
    from megatron_2bw.errors import ConfigError  # noqa: PLC0415

    try:
        return call(*args, **kwargs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def write_json(path: str | None, obj: dict) -> None:
    """The results file, written under a temporary name and renamed; a directory or a file that is not a
    JSON object at ``path`` is refused (export/outputs.py)."""
    from megatron_2bw.export.outputs import write_json_atomic  # noqa: PLC0415

    if not path:
        return
    _one_line(write_json_atomic, path, obj, flag="--json")
    print(f"wrote {path}")


def out_dir(path: str, benchmark: str) -> str:
    """A benchmark's ``--out-dir``: refused unless new, empty or this benchmark's earlier output (export/outputs.py)."""
    from megatron_2bw.export.outputs import claim_dir  # noqa: PLC0415

    return _one_line(claim_dir, path, f"benchmarks/{benchmark}", flag="--out-dir")
