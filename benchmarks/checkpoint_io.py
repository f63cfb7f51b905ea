"""Checkpoint I/O at size (issue 21): save and resume time and peak host memory, torch vs torch_dist.

    python benchmarks/checkpoint_io.py --size 150 --json out.json     # ~150M parameters, d = 2 on CPU
    python benchmarks/checkpoint_io.py --size 1000 --hidden 2048 --schedule flush --optimizer sgd \\
        --dir SCRATCH --json docs/data/checkpoint_io_1b.json            # the issue's 1.01B in ~18 GiB of RAM
    python benchmarks/checkpoint_io.py --quick                           # smoke run, a tiny model

A GPT of about ``--size`` million parameters (hidden 768 or ``--hidden``, 50257-token vocabulary,
``--seq`` tokens, as many layers as the size allows) runs as a d = 2 pipeline (2 processes,
``--schedule``, bf16 weights with an fp32 master, ``--optimizer``, fp32 gradients unless
``--bf16-grads``, micro-batch 1). For each format, in the same processes: a save (``torch``,
``torch_dist``, ``torch_dist --async-save``) with its pause of training, its background write
(async) and one step trained while the write runs; then, in fresh processes, a resume (read +
restore), checked against the saved state (a float64 sum of every state buffer).

Memory is measured two ways, per operation: the kernel's peak RSS (``VmHWM`` after
``/proc/self/clear_refs``), which counts the pages of a memory-mapped file that a torch-format
resume reads (clean page cache the kernel can drop, gone with the mapping), and the peak of
anonymous RSS (``RssAnon``: the heap, what a rank really allocates), sampled every 2 ms by a thread.
Both are reported relative to the stage's state bytes (its weight versions, the fp32 master, the
optimizer state: what a checkpoint holds; the arithmetic is in the JSON). The issue's targets: a
save adds at most 10% of the state bytes (an async save beyond its host copy, which is the state
itself); a resume's peak is at most 1.1x the rank's own state, i.e. the restore adds at most 0.1x
to what the built rank holds. The run refuses to start when the arithmetic of both ranks' memory
exceeds the machine's available memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import common

FORMATS = ("torch", "torch_dist", "torch_dist_async")
# a rank's Python, torch and gloo and the step's activations (measured: ~0.2 GiB before the build)
RUNTIME_BYTES = 700 << 20
MARGIN_BYTES = 1 << 30  # left to the machine's other processes
# a step's transient beyond the buffers: each parameter's gradient as autograd makes it and the activations
# (measured: 0.39-0.40 GiB per rank at 405M parameters with Adam; SGD's weight decay took 4 B/param more
# until it wrote into the weights in place)
STEP_BYTES_PER_PARAM = 1


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class Peak:
    """Peak RSS (``VmHWM``, reset on entry) and sampled peak anonymous / file-backed RSS while a block runs."""

    def __enter__(self) -> "Peak":
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # VmHWM := VmRSS
        self.start = _status()
        self.anon = self.start["RssAnon"]
        self.file = self.start["RssFile"]
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.002):
                s = _status()
                self.anon, self.file = max(self.anon, s["RssAnon"]), max(self.file, s["RssFile"])

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        end = _status()
        self.anon, self.file = max(self.anon, end["RssAnon"]), max(self.file, end["RssFile"])
        self.hwm = end["VmHWM"]

    def added(self) -> dict[str, int]:
        return {"rss_peak_added": self.hwm - self.start["VmRSS"], "anon_peak_added": self.anon - self.start["RssAnon"],
                "file_peak_added": self.file - self.start["RssFile"], "anon_before": self.start["RssAnon"],
                "anon_peak": self.anon, "rss_peak": self.hwm}


def _opt(conf: dict):
    from megatron_2bw.config import OptimizerConfig

    return OptimizerConfig(conf["optimizer"], lr=1e-4, dtype=conf["dtype"], sgd_momentum=conf["sgd_momentum"],
                           accumulate_allreduce_grads_in_fp32=not conf["bf16_grads"])


def _build(conf: dict):
    import torch

    from megatron_2bw.checkpoint.names import WORD
    from megatron_2bw.config import ModelConfig, PipelineConfig
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage
    from megatron_2bw.pipeline.weights import GlobalNames
    from megatron_2bw.tensor_parallel.random import RNGTracker

    d = conf["d"]
    state = build_state(Axes(pipeline=d), torch.device("cpu"))
    cfg = ModelConfig(**conf["model"])
    tracker = RNGTracker(1234, 0)
    spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker)
    opt = _opt(conf)
    runtime = _status()["RssAnon"]
    stage = build_stage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state,
                          PipelineConfig(conf["schedule"], 1, d), opt, (1, cfg.seq_length, cfg.hidden_size),
                          rng_tracker=tracker, names=GlobalNames(spec.stage_range(d, state.pp_rank)[0], tied=WORD),
                          cpu_init=False)
    batches = [spec.make_batch(t) for t in common.token_pool(cfg, 4, 1)]
    return stage, tracker, cfg, opt, state, (lambda mb: batches[mb % len(batches)]), runtime


def _state(stage) -> dict:
    """The stage's state bytes, measured from its buffers and as arithmetic per parameter."""
    w, u = stage.weights, stage.updater
    n = w.numel
    opt_per_param = u.state_bytes / n
    return {"params": n, "weight_versions": w.num_versions, "weight_bytes_per_param": w.dtype.itemsize,
            "master_bytes_per_param": u.master_bytes / n, "optimizer_state_bytes_per_param": opt_per_param,
            "state_bytes_per_param": w.weight_bytes / n + u.master_bytes / n + opt_per_param,
            "state_bytes": w.weight_bytes + u.master_bytes + u.state_bytes,
            "grad_bytes_per_param": w.grad_bytes / n, "grad_bytes": w.grad_bytes,
            "arithmetic": f"{n} params x ({w.num_versions} x {w.dtype.itemsize} B weights + "
                          f"{u.master_bytes / n:g} B master + {opt_per_param:g} B optimizer state)"}


def _checksums(stage) -> list[float]:
    """A float64 sum of every state buffer (the newest weights, master, optimizer state): what a resume
    must give back."""
    import torch

    from megatron_2bw.checkpoint.dist_checkpoint import shard_map

    return [sum(float(t.sum(dtype=torch.float64)) for _, t in f.spans) for f in shard_map.families(stage)]


def _config(cfg, opt) -> dict:
    from dataclasses import asdict

    return {"model": asdict(cfg), "optimizer": asdict(opt), "pipeline": {"layer_split": None}}


def save_worker(conf: dict) -> dict:
    import torch.distributed as dist

    from megatron_2bw.checkpoint import checkpointing as ck
    from megatron_2bw.checkpoint import dist_checkpoint as dc

    t0 = time.perf_counter()
    stage, tracker, cfg, opt, state, batch, runtime = _build(conf)
    build_s = time.perf_counter() - t0
    step = lambda: stage.train(1, batch, lambda t: 1e-4)  # noqa: E731
    step()
    dist.barrier()
    with Peak() as p:
        t0 = time.perf_counter()
        step()
        step_s = time.perf_counter() - t0
    out = {"rank": state.rank, "build_s": build_s, "runtime_anon_bytes": runtime, "state": _state(stage),
           "step_s": step_s, "step": p.added(), "checksums": _checksums(stage), "saved_step": stage.step}
    config = _config(cfg, opt)
    for fmt in conf["formats"]:
        root = os.path.join(conf["dir"], fmt)
        it = stage.step
        dist.barrier()
        writer = None
        with Peak() as p:
            t0 = time.perf_counter()
            if fmt == "torch":
                ck.save(root, it, state, lambda it=it: ck.payload(stage, iteration=it, tracker=tracker,
                                                                  consumed_samples=0, global_batch=conf["d"],
                                                                  config=config, args={}))
            else:
                common_ = dc.common_state(stage, iteration=it, config=config, args={}, consumed_samples=0,
                                          global_batch=1)
                writer = dc.AsyncWriter() if fmt.endswith("async") else None
                dc.save(root, it, stage, tracker, common_, writer)
            row = {"pause_s": time.perf_counter() - t0}
            if writer is not None:
                t1 = time.perf_counter()
                step()  # trained while the write runs
                row["overlapped_step_s"] = time.perf_counter() - t1
                row["write_busy_after_step"] = writer.busy
                writer.wait()
                row["write_s"] = time.perf_counter() - t0
                row["staging_bytes"] = sum(b.numel() * b.element_size() for b in writer.staging.buffers.values())
            dist.barrier()
            row["total_s"] = time.perf_counter() - t0
        row.update(p.added())
        out[fmt] = row
        if writer is not None:
            writer.staging.buffers.clear()
    return out


def resume_worker(conf: dict, fmt: str) -> dict:
    import torch.distributed as dist

    from megatron_2bw.checkpoint import checkpointing as ck
    from megatron_2bw.checkpoint import dist_checkpoint as dc
    from megatron_2bw.checkpoint import formats

    stage, tracker, cfg, opt, state, batch, runtime = _build(conf)
    root = os.path.join(conf["dir"], fmt)
    it = ck.read_tracker(root)
    dist.barrier()
    with Peak() as p:
        t0 = time.perf_counter()
        if fmt == "torch":
            sd = ck.load_rank_file(root, it, 1, conf["d"], 0, state.pp_rank)
        else:
            sd = dc.read_checkpoint(root, it, state.rank, state.world_size, (1, conf["d"], 1, None))
        formats.of_file(sd).restore(sd, stage, tracker, state.device)
        del sd
        dt = time.perf_counter() - t0
    return {"rank": state.rank, "resume_s": dt, "runtime_anon_bytes": runtime, "state": _state(stage),
            "step": stage.step, "checksums": _checksums(stage), **p.added()}


def model_for(size_m: float, hidden: int, vocab: int = 50257, seq: int = 128) -> dict:
    """A GPT of about ``size_m`` million parameters at ``hidden``: an even number of layers (d = 2)."""
    h, vp = hidden, -(-vocab // 128) * 128
    per_layer = 12 * h * h + 13 * h
    layers = max(2, round((size_m * 1e6 - vp * h - seq * h) / per_layer / 2) * 2)
    return dict(kind="gpt", num_layers=layers, hidden_size=h, num_attention_heads=max(1, h // 64), seq_length=seq,
                max_position_embeddings=seq, vocab_size=vocab)


def memory_plan(model: dict, conf: dict) -> dict:
    """Arithmetic of what both ranks hold at the peak (the async save's host copy included): checked
    against the machine before anything starts."""
    h, vp, L = model["hidden_size"], -(-model["vocab_size"] // 128) * 128, model["num_layers"]
    per_layer = 12 * h * h + 13 * h
    stage0 = L // 2 * per_layer + vp * h + model["seq_length"] * h  # layers, word and position embeddings
    versions = 2 if conf["schedule"] == "2bw" else 1
    opt = {"adam": 8, "sgd": 4 if conf["sgd_momentum"] else 0}[conf["optimizer"]]
    half = conf["dtype"] == "bf16"
    state_pp = versions * (2 if half else 4) + (4 if half else 0) + opt  # versions, fp32 master, optimizer
    grads_pp = versions * (2 if conf["bf16_grads"] and half else 4)
    copy = "torch_dist_async" in conf["formats"]
    per_rank = stage0 * (state_pp * (2 if copy else 1) + grads_pp + STEP_BYTES_PER_PARAM) + RUNTIME_BYTES
    with open("/proc/meminfo", encoding="ascii") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return {"params_per_stage_about": stage0, "state_bytes_per_param": state_pp, "grad_bytes_per_param": grads_pp,
            "async_host_copy": copy, "step_transient_bytes_per_param": STEP_BYTES_PER_PARAM,
            "runtime_bytes_per_rank": RUNTIME_BYTES, "bytes_per_rank": per_rank,
            "bytes_both_ranks": 2 * per_rank, "mem_available_bytes": avail,
            "arithmetic": f"2 ranks x ({stage0} params x ({state_pp} B state{' x 2 (async copy)' if copy else ''} + "
                          f"{grads_pp} B grads + {STEP_BYTES_PER_PARAM} B step transient) + {RUNTIME_BYTES >> 20} MiB "
                          f"runtime) = {2 * per_rank / 2**30:.1f} GiB"}


DEFINITIONS = {  # the JSON's row keys (all *_over_state are fractions of the rank's state bytes)
    "state_GiB": "the stage's state: weight versions + fp32 master + optimizer state (ranks[].state: the arithmetic)",
    "steps_lost": "save pause / step time; async: (pause + the overlapped step's extra time) / step time",
    "save_peak_added_over_state": "peak RSS (VmHWM) during the save minus RSS before it",
    "save_anon_peak_added_over_state": "the same for anonymous RSS (RssAnon, sampled every 2 ms): heap only",
    "save_anon_peak_beyond_staging_and_step_over_state":
        "async: the save's anonymous peak beyond its host copy and beyond a plain step's own peak",
    "resume_peak_over_state": "the whole process's peak RSS during the resume (state, gradients, runtime, "
                              "file pages) over the state: not the target's measure",
    "resume_peak_added_over_state": "peak RSS during read + restore minus RSS before (file pages included)",
    "resume_file_peak_added_over_state": "of which file-backed (a torch-format file's mmap pages: droppable cache)",
    "resume_anon_peak_added_over_state": "anonymous peak added by read + restore (target: <= 0.1)",
    "resume_anon_peak_over_rank_before": "anonymous peak over what the built rank held before (target: <= 1.1)",
    "rank_anon_before_resume_over_state": "the built rank's anonymous RSS (state + gradients + runtime) over the state",
    "resume_matches_save": "float64 sums of every state buffer and the step equal the saved ones",
}


def _row(fmt: str, s: dict, res: dict, r: dict) -> dict:
    st = r["state"]
    state = st["state_bytes"]
    row = {"rank": r["rank"], "format": fmt, "params": st["params"], "state_GiB": state / 2**30,
           "step_s": r["step_s"], "save_pause_s": s["pause_s"], "save_total_s": s["total_s"],
           "steps_lost": s["pause_s"] / r["step_s"],
           "save_peak_added_over_state": s["rss_peak_added"] / state,
           "save_anon_peak_added_over_state": s["anon_peak_added"] / state,
           "resume_s": res["resume_s"],
           "resume_matches_save": res["checksums"] == r["checksums"] and res["step"] == r["saved_step"],
           # the whole process's peak RSS (file pages, gradients and the runtime included) over the state
           "resume_peak_over_state": res["rss_peak"] / state,
           "resume_peak_added_over_state": res["rss_peak_added"] / state,
           "resume_file_peak_added_over_state": res["file_peak_added"] / state,
           "resume_anon_peak_added_over_state": res["anon_peak_added"] / state,
           # what the rank holds before the restore: its state, gradients and runtime (anonymous)
           "rank_anon_before_resume_over_state": res["anon_before"] / state,
           "resume_anon_peak_over_rank_before": res["anon_peak"] / res["anon_before"],
           "resume_anon_peak_over_state_plus_grads_and_runtime":
               res["anon_peak"] / (state + st["grad_bytes"] + res["runtime_anon_bytes"])}
    if "write_s" in s:
        step_anon = r["step"]["anon_peak"]  # the step's own peak without a save
        row.update(write_s=s["write_s"], overlapped_step_s=s["overlapped_step_s"],
                   write_still_busy_after_a_step=s["write_busy_after_step"],
                   staging_over_state=s["staging_bytes"] / state,
                   save_peak_added_beyond_staging_over_state=(s["rss_peak_added"] - s["staging_bytes"]) / state,
                   save_anon_peak_beyond_staging_and_step_over_state=(s["anon_peak"] - s["staging_bytes"]
                                                                      - max(step_anon, s["anon_before"])) / state,
                   steps_lost=(s["pause_s"] + max(s["overlapped_step_s"] - r["step_s"], 0)) / r["step_s"])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=150, help="millions of parameters (the issue's target is ~1000)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--schedule", default="2bw", choices=("2bw", "flush"), help="flush: one weight version")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="bf16: bf16 weights, fp32 master")
    p.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    p.add_argument("--sgd-momentum", type=float, default=0.0)
    p.add_argument("--bf16-grads", action="store_true", help="gradients in bf16 (default: fp32, as for bf16 runs)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder, removed)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model")
    p.add_argument("--force", action="store_true", help="start even if the memory arithmetic exceeds MemAvailable")
    args = p.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    if not formats or any(f not in FORMATS for f in formats):
        print(f"error: --formats takes {', '.join(FORMATS)}, got {args.formats!r}", file=sys.stderr)
        return 2
    model = model_for(2, 128, 1000, seq=32) if args.quick else model_for(args.size, args.hidden, seq=args.seq)
    conf = {"model": model, "d": 2, "schedule": args.schedule, "optimizer": args.optimizer, "dtype": args.dtype,
            "sgd_momentum": args.sgd_momentum, "bf16_grads": args.bf16_grads, "formats": formats}
    plan = memory_plan(model, conf)
    if plan["bytes_both_ranks"] + MARGIN_BYTES > plan["mem_available_bytes"] and not args.force:
        print(f"error: the run needs about {plan['bytes_both_ranks'] / 2**30:.1f} GiB ({plan['arithmetic']}) and "
              f"{MARGIN_BYTES >> 30} GiB to spare but {plan['mem_available_bytes'] / 2**30:.1f} GiB are available",
              file=sys.stderr)
        return 2
    print(f"model {model}; memory: {plan['arithmetic']} of {plan['mem_available_bytes'] / 2**30:.1f} GiB available",
          flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        conf["dir"] = tmp
        saves = common.spawn(save_worker, 2, conf, timeout=3600)
        resumes = {}
        for fmt in formats:  # each checkpoint removed once resumed (disk)
            resumes[fmt] = common.spawn(resume_worker, 2, conf, fmt, timeout=3600)
            shutil.rmtree(os.path.join(tmp, fmt), ignore_errors=True)
    rows = []
    for r in saves:
        for fmt in formats:
            rows.append(_row(fmt, r[fmt], next(x for x in resumes[fmt] if x["rank"] == r["rank"]), r))
    half = args.dtype == "bf16"
    out = {"model": model, "d": 2, "schedule": args.schedule,
           "precision": "bf16 weights, fp32 master" if half else "fp32", "optimizer": args.optimizer,
           "sgd_momentum": args.sgd_momentum, "grads": "bf16" if args.bf16_grads and half else "fp32",
           "micro_batch_size": 1, "num_microbatches": 2,
           "memory_plan": plan, "definitions": DEFINITIONS, "machine": common.machine_info(),
           "ranks": [{k: r[k] for k in ("rank", "build_s", "runtime_anon_bytes", "state", "step_s", "step")}
                     for r in saves],
           "rows": rows}
    for row in rows:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        common.write_json(args.json, out)
    bad = [f"rank {r['rank']} {r['format']}" for r in rows if not r["resume_matches_save"]]
    if bad:
        print(f"error: the resumed state differs from the saved one ({', '.join(bad)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
