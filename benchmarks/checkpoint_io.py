"""Checkpoint I/O at size (issue 21): save and resume time and peak host memory, torch vs torch_dist.

    python benchmarks/checkpoint_io.py --size 150 --json out.json     # ~150M parameters, d = 2 on CPU
    python benchmarks/checkpoint_io.py --size 1000 --hidden 2048 --dir SCRATCH --json out.json
        # the issue's 1.01B (18 layers): about 64 GiB of RAM and 60 GB of disk under SCRATCH

A GPT of about ``--size`` million parameters (hidden 768 or ``--hidden``, 50257-token vocabulary,
as many layers as the size allows) runs as a d = 2 pipeline (2 processes, 2BW, bf16 weights,
Adam, fp32 gradients). For each format, in the same processes: one training step (its time), then
a save (``torch``, ``torch_dist``, ``torch_dist --async-save``) with its pause of training, its
background write (async), and one step trained while the write runs; then, in fresh processes, a
resume (read + restore). Peak RSS is reset before each operation (``/proc/self/clear_refs``) and
the peak added is reported relative to the stage's state bytes (both weight versions, the fp32
master, the Adam moments: what a checkpoint holds). The issue's targets: a save adds at most 10%
of the state bytes (beyond the async copy's host buffer, which is the state itself); a resume's
peak is at most 1.1x the rank's own state (the stage as built plus what the restore adds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import common

FORMATS = ("torch", "torch_dist", "torch_dist_async")


def _kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS (Linux clear_refs 5); returns the current RSS."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return _kib("VmRSS")


class _AnonPeak:
    """The peak of anonymous RSS (``RssAnon``: the heap, not the pages of a memory-mapped file, which the
    kernel can drop) sampled every millisecond by a thread while a block runs; VmHWM counts both."""

    def __enter__(self) -> "_AnonPeak":
        import threading

        self.start = self.peak = _kib("RssAnon")
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, _kib("RssAnon"))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _kib("RssAnon"))


def _build(conf: dict):
    import torch

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.export.names import WORD
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import build_state
    from megatron_2bw.pipeline.executor import PipelineStage
    from megatron_2bw.pipeline.weights import GlobalNames
    from megatron_2bw.tensor_parallel.group import TPGroup
    from megatron_2bw.tensor_parallel.random import RNGTracker

    d = conf["d"]
    state = build_state(1, d, 1, torch.device("cpu"))
    cfg = ModelConfig(**conf["model"])
    tracker = RNGTracker(1234, 0)
    spec = ModelSpec(cfg, TPGroup(), 1234, rng=tracker)
    opt = OptimizerConfig("adam", lr=1e-4, dtype="bf16")
    stage = PipelineStage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state,
                          PipelineConfig("2bw", 1, d), opt, (1, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker,
                          names=GlobalNames(spec.stage_range(d, state.pp_rank)[0], tied=WORD))
    batches = [spec.make_batch(t) for t in common.token_pool(cfg, 4, 1)]
    return stage, tracker, spec, cfg, opt, state, (lambda mb: batches[mb % len(batches)])


def _state_bytes(stage) -> int:
    return stage.weights.weight_bytes + stage.updater.master_bytes + stage.updater.state_bytes


def _config(cfg, opt) -> dict:
    from dataclasses import asdict

    return {"model": asdict(cfg), "optimizer": asdict(opt), "pipeline": {"layer_split": None}}


def save_worker(conf: dict) -> dict:
    import torch.distributed as dist

    from megatron_2bw.training import checkpointing as ck
    from megatron_2bw.training import dist_checkpoint as dc

    stage, tracker, spec, cfg, opt, state, batch = _build(conf)
    step = lambda: stage.train(1, batch, lambda t: 1e-4)  # noqa: E731
    step()
    t0 = time.perf_counter()
    step()
    step_s = time.perf_counter() - t0
    out = {"rank": state.rank, "numel": stage.weights.numel, "state_bytes": _state_bytes(stage), "step_s": step_s}
    config = _config(cfg, opt)
    for fmt in FORMATS:
        root = os.path.join(conf["dir"], fmt)
        it = stage.step
        dist.barrier()
        rss0 = _reset_peak()
        t0 = time.perf_counter()
        if fmt == "torch":
            def make():
                return ck.payload(stage, iteration=it, tracker=tracker, consumed_samples=0, global_batch=d_batch,
                                  config=config, args={})
            d_batch = conf["d"]
            ck.save(root, it, state, make)
        else:
            common_ = dc.common_state(stage, iteration=it, config=config, args={}, consumed_samples=0, global_batch=1)
            writer = dc.AsyncWriter() if fmt.endswith("async") else None
            dc.save(root, it, stage, tracker, common_, writer)
        pause = time.perf_counter() - t0
        row = {"pause_s": pause}
        if fmt.endswith("async"):
            t1 = time.perf_counter()
            step()  # trained while the write runs
            row["overlapped_step_s"] = time.perf_counter() - t1
            row["write_busy_after_step"] = writer.busy
            writer.wait()
            row["write_s"] = time.perf_counter() - t0
            row["staging_bytes"] = sum(b.numel() * b.element_size() for b in writer.staging.buffers.values())
        dist.barrier()
        row["total_s"] = time.perf_counter() - t0
        row["peak_added_bytes"] = _kib("VmHWM") - rss0
        out[fmt] = row
    return out


def resume_worker(conf: dict, fmt: str) -> dict:
    from megatron_2bw.training import checkpointing as ck
    from megatron_2bw.training import dist_checkpoint as dc

    stage, tracker, spec, cfg, opt, state, batch = _build(conf)
    root = os.path.join(conf["dir"], fmt)
    it = ck.read_tracker(root)
    rss0 = _reset_peak()
    t0 = time.perf_counter()
    with _AnonPeak() as anon:
        if fmt == "torch":
            sd = ck.load_rank_file(root, it, 1, conf["d"], 0, state.pp_rank)
        else:
            sd = dc.read_checkpoint(root, it, state.rank, state.world_size, (1, conf["d"], 1, None))
        ck.restore(sd, stage, tracker, state.device)
        peak = _kib("VmHWM")
        del sd
    dt = time.perf_counter() - t0
    return {"rank": state.rank, "resume_s": dt, "rss_before": rss0, "peak_added_bytes": peak - rss0,
            "peak_bytes": peak, "anon_peak_added_bytes": anon.peak - anon.start, "state_bytes": _state_bytes(stage),
            "step": stage.step}


def model_for(size_m: float, hidden: int, vocab: int = 50257, seq: int = 128) -> dict:
    """A GPT of about ``size_m`` million parameters at ``hidden``: an even number of layers (d = 2)."""
    h, vp = hidden, -(-vocab // 128) * 128
    per_layer = 12 * h * h + 13 * h
    layers = max(2, round((size_m * 1e6 - vp * h - seq * h) / per_layer / 2) * 2)
    return dict(kind="gpt", num_layers=layers, hidden_size=h, num_attention_heads=max(1, h // 64), seq_length=seq,
                max_position_embeddings=seq, vocab_size=vocab)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=150, help="millions of parameters (the issue's target is ~1000)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder, removed)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    model = model_for(args.size, args.hidden)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        conf = {"model": model, "d": 2, "dir": tmp}
        saves = common.spawn(save_worker, 2, conf)
        resumes = {fmt: common.spawn(resume_worker, 2, conf, fmt) for fmt in FORMATS}
    rows = []
    for r in saves:
        state = r["state_bytes"]
        for fmt in FORMATS:
            s, res = r[fmt], next(x for x in resumes[fmt] if x["rank"] == r["rank"])
            row = {"rank": r["rank"], "format": fmt, "params": r["numel"], "state_GiB": state / 2**30,
                   "step_s": r["step_s"], "save_pause_s": s["pause_s"], "save_total_s": s["total_s"],
                   "steps_lost": s["pause_s"] / r["step_s"],
                   "save_peak_added_over_state": s["peak_added_bytes"] / state,
                   "resume_s": res["resume_s"], "resume_peak_added_over_state": res["peak_added_bytes"] / state,
                   "resume_anon_peak_added_over_state": res["anon_peak_added_bytes"] / state,
                   "resume_peak_over_state": res["peak_bytes"] / state}
            if "write_s" in s:
                row.update(write_s=s["write_s"], overlapped_step_s=s["overlapped_step_s"],
                           write_still_busy_after_a_step=s["write_busy_after_step"],
                           save_peak_added_beyond_staging_over_state=(s["peak_added_bytes"] - s["staging_bytes"]) / state,
                           steps_lost=(s["pause_s"] + max(s["overlapped_step_s"] - r["step_s"], 0)) / r["step_s"])
            rows.append(row)
    out = {"model": model, "d": 2, "machine": common.machine_info(), "rows": rows}
    for row in rows:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
