"""``gpu_check.py``'s rows of what runs beside a stage's compute: what only a GPU can measure of the batch
prefetch, the update's host wait, the allocator's retry path and the tied embedding's resident all-reduce.

- ``prefetch batches`` / ``prefetch h2d`` (gpu-review-2 P4): the microbatch provider with and without its
  prefetch, fed to a stand-in compute (GEMMs, long enough that the host runs ahead): the batches must be
  equal bitwise; measured, the compute stream's time between asking for a batch and having it (its copies
  without prefetch, the wait for the side stream's event with it) and the wall time per microbatch.
- ``update wait gpu backlog`` (P3): a 2BW stage at d = 1 in the trainer's configuration, with and without a
  GPU sleep injected into every microbatch's forward (a backlog the host runs ahead of): ``update_wait_s``
  per step against the backlog. The update's skip and clip decisions read the reduced norm on the host, so
  the wait contains the GPU's backlog up to the step's REDUCE_GRADS by design.
- ``allocator retry sync PYTORCH_CUDA_ALLOC_CONF=...`` (N2): in a fresh process each, with the allocator
  capped (``set_per_process_memory_fraction``) and a 0.5 s kernel running on another stream (a stand-in
  for a cross-stage all-reduce in flight): how long an allocation served by the cache, one that needs a new
  segment, one that must first free cached blocks (the out-of-memory retry) and ``empty_cache`` block the
  host. About 0.5 s is a device-wide synchronization: with 2BW at d >= 2 the training thread would then wait
  for a collective whose other stage waits for this one's next transfers.
- ``tied embedding d=2 last stage`` (N3, 2 or more GPUs): the last stage's step time of 2BW at d = 2 with the
  tied embedding (its all-reduce resident on the GPU while the stage computes) and with untied output weights.
- ``compute on fewer SMs`` (N3 on one GPU): GEMM time on all SMs and in green contexts without 16 and 32 of
  them: the most a resident NCCL kernel holding one SM per channel could cost the stage's compute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from gpu_probe import FAIL, INFO, NEEDS_GPU, PASS, _first_line, _row, env_with

SLEEP_S = 0.5  # the stand-in collective's length in the allocator probe
GiB = 2**30


def _cycles_per_s() -> float:
    """``torch.cuda._sleep``'s cycles per second on this GPU (one timed sleep)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(20_000_000)
    torch.cuda.synchronize()
    return 20_000_000 / max(time.perf_counter() - t0, 1e-6)


def _child(flag: str, env: dict | None, timeout_s: float) -> dict:
    """This file run as ``flag``'s child process: its JSON answer, or an error naming its last line of output."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), flag], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"{flag} exited {done.returncode}: {tail}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------ P4: the batch prefetch
class _Windows:
    """``n`` GPT samples of ``s + 1`` tokens, made on demand (a corpus read costs host time too)."""

    def __init__(self, n: int, s: int) -> None:
        self.n, self.s = n, s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import numpy as np

        return {"tokens": (np.arange(self.s + 1, dtype=np.int64) * 7 + 13 * i) % 50257}


def _gemms(device, seconds: float):
    """A stand-in for a microbatch's compute: GEMMs on the compute stream for about ``seconds`` (CUDA)."""
    import torch

    if device.type != "cuda":
        x = torch.randn(64, 64)
        return lambda: x @ x
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    x @ x  # cuBLAS's first call sets itself up: not part of the calibration
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(20):
        x @ x
    torch.cuda.synchronize(device)
    n = max(1, int(seconds / max((time.perf_counter() - t0) / 20, 1e-7)))
    return lambda: [x @ x for _ in range(n)]


def _feed(data, b: int, m: int, mbs: int, device, prefetch: bool, work) -> dict:
    """Microbatches 0..mbs-1 through the provider, each followed by ``work``; the batches (cloned on the
    compute stream), the compute stream's ms from asking to having each batch, and the wall ms per microbatch."""
    import torch

    from megatron_2bw.models.gpt import make_batch
    from megatron_2bw.training.data_iter import MicrobatchProvider

    cuda = device.type == "cuda"
    p = MicrobatchProvider(data, make_batch, global_batch=b * m, micro_batch=b, m=m, w=1, dp_rank=0, device=device,
                           prefetch=prefetch)
    kept = [{k: v.clone() for k, v in p(0).items()}]
    work()
    if cuda:
        torch.cuda.synchronize(device)
    marks, t0 = [], time.perf_counter()
    for mb in range(1, mbs):
        e0, e1 = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
        if cuda:
            e0.record()
        batch = p(mb)
        if cuda:
            e1.record()
        kept.append({k: v.clone() for k, v in batch.items()})
        work()
        marks.append((e0, e1))
    if cuda:
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    input_ms = sum(e0.elapsed_time(e1) for e0, e1 in marks) / len(marks) if cuda else None
    return dict(kept=kept, input_ms=input_ms, wall_ms=1e3 * wall / (mbs - 1), served=p.served_ahead)


def prefetch_rows(device) -> list[dict]:
    """The provider with and without prefetch: equal batches; on CUDA the copies' time on the compute stream."""
    import torch

    cuda = device.type == "cuda"
    # (b, s, seconds of GEMMs a microbatch: longer than the host's collate, so the host runs ahead of the GPU)
    sizes = {"gpt b=4 s=2048": (4, 2048, 0.02), "b=4 s=262144": (4, 262144, 0.05)} if cuda else \
        {"gpt-tiny b=2 s=64": (2, 64, 0.0)}
    rows = []
    for label, (b, s, seconds) in sizes.items():
        try:
            work = _gemms(device, seconds)
            data, m, mbs = _Windows(64, s), 4, 12
            off = _feed(data, b, m, mbs, device, False, work)
            on = _feed(data, b, m, mbs, device, True, work)
        except Exception as e:  # noqa: BLE001 - the probe's own failure is its row
            rows.append(_row(f"prefetch batches {label}", FAIL, _first_line(e)))
            continue
        same = len(off["kept"]) == len(on["kept"]) and all(
            x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            for x, y in zip(off["kept"], on["kept"], strict=False))
        ok = same and on["served"] == mbs - 1
        rows.append(_row(f"prefetch batches {label}", PASS if ok else FAIL,
                         f"{mbs} microbatches with prefetch == without (bitwise), {on['served']} served ahead"
                         if ok else f"batches differ or not served ahead ({on['served']} of {mbs - 1})"))
        name = f"prefetch h2d {label}"
        if not cuda:
            rows.append(_row(name, NEEDS_GPU, "a side stream's copy beside the compute stream (the code ran)"))
            continue
        nbytes = sum(v.numel() * v.element_size() for v in on["kept"][0].values())
        rows.append(_row(name, INFO, f"{nbytes / 2**20:.2f} MiB a microbatch: the compute stream spends "
                         f"{off['input_ms']:.3f} ms on its input without prefetch, {on['input_ms']:.3f} ms with; "
                         f"{off['wall_ms']:.2f} -> {on['wall_ms']:.2f} ms a microbatch",
                         batch_MiB=nbytes / 2**20, input_ms_off=off["input_ms"], input_ms_on=on["input_ms"],
                         wall_ms_off=off["wall_ms"], wall_ms_on=on["wall_ms"]))
    return rows


# ------------------------------------------------------------------ P3: the update's wait on the host
def update_wait_row(device, deadline: float) -> dict:
    """2BW at d = 1 (fp32 gradients, saved-tensor hooks, clipping): update_wait_s per step, with and without a
    GPU backlog injected into every forward."""
    import gc

    import gpu
    import torch

    from megatron_2bw.config import OptimizerConfig, PipelineConfig
    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import ParallelState
    from megatron_2bw.pipeline.build import build_stage

    name = "update wait gpu backlog"
    cuda = device.type == "cuda"
    if time.perf_counter() > deadline:
        return _row(name, INFO, "skipped: the script's time budget is spent")
    model, dtype, b, m, steps = ("gpt-355m", "bf16", 4, 4, 4) if cuda else ("gpt-tiny", "fp32", 2, 2, 2)
    backlogs = (0.0, 0.02) if cuda else (0.0,)  # seconds of GPU sleep per microbatch's forward
    cfg = get_preset(model)
    spec = ModelSpec(cfg, ModelGroups(), 1234)
    sleep = {"cycles": 0}

    def layers():
        built = spec.build_stage(1, 0)
        built[-1].register_forward_hook(lambda *_: torch.cuda._sleep(sleep["cycles"]) if sleep["cycles"] else None)
        return built

    try:
        stage = build_stage(layers, spec.loss_fn(), ParallelState.single(device),
                            PipelineConfig("2bw", b, m, track_memory=True),
                            OptimizerConfig("adam", lr=1e-4, dtype=dtype, clip_grad=1.0),
                            (b, cfg.seq_length, cfg.hidden_size))
        batches = gpu._batches(spec, cfg, b, 2 * m, device)
        get = lambda mb: batches[mb % len(batches)]  # noqa: E731
        per_s = _cycles_per_s() if cuda else 0.0
        out = {}
        for backlog in backlogs:
            sleep["cycles"] = int(backlog * per_s)
            stage.train(1, get, lambda t: 1e-4)
            gpu._sync(device)
            w0, t0 = stage.stats.update_wait_s, time.perf_counter()
            stage.train(steps, get, lambda t: 1e-4)
            gpu._sync(device)
            out[backlog] = dict(update_wait_s=(stage.stats.update_wait_s - w0) / steps,
                                step_s=(time.perf_counter() - t0) / steps, injected_s=backlog * m)
    except Exception as e:  # noqa: BLE001
        return _row(name, FAIL, _first_line(e))
    finally:
        gc.collect()
    return _update_wait_verdict(name, cuda, out, backlogs)


def _update_wait_verdict(name: str, cuda: bool, out: dict, backlogs: tuple) -> dict:
    """How much of the injected GPU work per step the update's host wait grew by (off CUDA: it only ran)."""
    base = out[0.0]
    if not cuda:
        return _row(name, NEEDS_GPU, f"a GPU backlog needs CUDA (the code ran: update wait {base['update_wait_s']:.4f} "
                    "s a step on the CPU)", steps=out)
    more = out[backlogs[-1]]
    grown = more["update_wait_s"] - base["update_wait_s"]
    return _row(name, INFO, f"update_wait_s {base['update_wait_s']:.4f} s a step "
                f"({base['update_wait_s'] / base['step_s']:.0%} of the step); with {more['injected_s']:.2f} s of GPU "
                f"work a step added {more['update_wait_s']:.4f} s ({grown / more['injected_s']:.0%} of what was "
                f"added): the host waits for the GPU's backlog there",
                steps={str(k): v for k, v in out.items()}, wait_growth_over_injected=grown / more["injected_s"])


# ------------------------------------------------------------------ N2: the allocator's retry path
def _alloc_child() -> dict:
    """In a fresh process (the allocator's settings are read at start): host seconds of each allocator path
    while a 0.5 s kernel runs on another stream."""
    import torch

    torch.cuda.set_device(0)
    per_s = _cycles_per_s()
    torch.cuda.set_per_process_memory_fraction(4 * GiB / torch.cuda.get_device_properties(0).total_memory, 0)
    side = torch.cuda.Stream()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(SLEEP_S * per_s))  # the stand-in for a collective in flight
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
        return dt

    held: list = []
    out = {"new segment (cudaMalloc)": timed(lambda: held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda")))}
    cached = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    del cached  # 1 GiB held, 2 GiB cached: 3 of the 4 GiB allowed reserved
    out["served by the cache"] = timed(lambda: held.append(torch.empty(GiB // 2, dtype=torch.uint8, device="cuda")))
    held.pop()
    # 2.5 GiB: the cached block is too small and a new segment would pass the cap, so the allocator frees its
    # cached blocks and retries (the out-of-memory path)
    out["retry after freeing the cache"] = timed(
        lambda: held.append(torch.empty(5 * GiB // 2, dtype=torch.uint8, device="cuda")))
    held.pop()
    out["empty_cache"] = timed(torch.cuda.empty_cache)
    return out


def alloc_sync_rows(device, timeout_s: float = 90.0) -> list[dict]:
    """The allocator probe with ``PYTORCH_CUDA_ALLOC_CONF`` unset and ``expandable_segments:True``."""
    rows = []
    for conf in (None, "expandable_segments:True"):
        name = f"allocator retry sync PYTORCH_CUDA_ALLOC_CONF={conf or 'unset'}"
        if device.type != "cuda":
            rows.append(_row(name, NEEDS_GPU, "the CUDA caching allocator"))
            continue
        env = env_with("PYTORCH_CUDA_ALLOC_CONF", conf)
        try:
            delays = _child("--alloc-child", env, timeout_s)
        except Exception as e:  # noqa: BLE001 - the probe's own failure is its row (a measurement, not a check)
            rows.append(_row(name, INFO, f"no measurement: {_first_line(e)}"))
            continue
        blocked = {k: v for k, v in delays.items() if v > SLEEP_S / 2}
        detail = ("waits for a kernel on another stream (a device-wide synchronization): "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in blocked.items())) if blocked else \
            f"no path waits for another stream's kernel (every delay < {SLEEP_S / 2} s)"
        rows.append(_row(name, INFO, detail, delays_s=delays, device_sync=sorted(blocked)))
    return rows


# ------------------------------------------------------------------ N3: the tied embedding's all-reduce
def _tied_worker(untie: bool, steps: int, model: str = "gpt-355m") -> float | None:
    """One rank of 2BW at d = 2 (bf16); the last stage's seconds per step (None on the first stage)."""
    import torch

    from megatron_2bw.checkpoint.names import WORD
    from megatron_2bw.config import OptimizerConfig, PipelineConfig
    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec, stage_range
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage
    from megatron_2bw.pipeline.weights import GlobalNames
    from megatron_2bw.tensor_parallel.random import RNGTracker

    device = torch.device("cuda", torch.cuda.current_device())
    state = build_state(Axes(pipeline=2), device)
    cfg = get_preset(model, untie_embeddings_and_output_weights=untie)
    b, m = 4, 8
    tracker = RNGTracker(1234, state.tp_rank, device)
    spec = ModelSpec(cfg, ModelGroups.of(state), 1234, rng=tracker)
    stage = build_stage(lambda: spec.build_stage(2, state.pp_rank), spec.loss_fn(), state,
                        PipelineConfig("2bw", b, m), OptimizerConfig("adam", lr=1e-4, dtype="bf16"),
                        (b, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker,
                        names=GlobalNames(stage_range(cfg.num_layers, 2, state.pp_rank)[0], tied=WORD))
    tokens = torch.randint(0, cfg.vocab_size, (2 * m, b, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(5))
    batches = [{k: v.to(device) for k, v in spec.make_batch(t).items()} for t in tokens]
    get = lambda mb: batches[mb % len(batches)]  # noqa: E731
    stage.train(2, get, lambda t: 1e-4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stage.train(steps, get, lambda t: 1e-4)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps if state.pp_rank == 1 else None


def tied_d2_row(n_gpus: int, deadline: float, steps: int = 6) -> dict:
    """The last stage's step time at d = 2, tied against untied embeddings (2 GPUs)."""
    from megatron_2bw.local_workers import run_workers

    name = "tied embedding d=2 last stage"
    if n_gpus < 2:
        return _row(name, NEEDS_GPU, "needs 2 or more GPUs")
    if time.perf_counter() > deadline:
        return _row(name, INFO, "skipped: the script's time budget is spent")
    out = {}
    try:
        for untie in (False, True):
            res = run_workers(_tied_worker, 2, untie, steps, timeout=150, pg_timeout=150, backend="nccl")
            out["untied" if untie else "tied"] = next(r for r in res if r is not None)
    except Exception as e:  # noqa: BLE001
        return _row(name, FAIL, _first_line(e))
    cost = out["tied"] / out["untied"] - 1
    return _row(name, INFO, f"last stage {out['tied']:.4f} s a step tied, {out['untied']:.4f} s untied ({cost:+.1%})",
                step_s=out, tied_over_untied=cost)


def _sm_child() -> dict:
    """In a fresh process: ms of a GEMM chain on all SMs, and in green contexts of all but 16 and 32 SMs."""
    import torch
    from torch.cuda.green_contexts import GreenContext

    torch.cuda.set_device(0)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def run(reps: int = 3) -> float:
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                x @ x
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return 1e3 * best / 20

    run(1)
    out = {"sms": total, "all SMs ms": run()}
    for held in (0, 16, 32):
        ctx = GreenContext.create((total - held) // 8 * 8, 0)  # SM groups come in multiples of 8
        ctx.set_context()
        try:
            run(1)
            out[f"green {(total - held) // 8 * 8} SMs ms"] = run()
        finally:
            ctx.pop_context()
    return out


def sm_share_row(device, timeout_s: float = 90.0) -> dict:
    """What a kernel holding 16 or 32 SMs (an all-reduce's channels) could cost a stage's GEMMs at most."""
    name = "compute on fewer SMs"
    if device.type != "cuda":
        return _row(name, NEEDS_GPU, "CUDA green contexts")
    try:
        ms = _child("--sm-child", None, timeout_s)
    except Exception as e:  # noqa: BLE001 - green contexts are beta: no measurement, not a failure
        return _row(name, INFO, f"no measurement: {_first_line(e)}")
    green = {k: v for k, v in ms.items() if k.startswith("green ")}
    base = next(iter(green.values()))
    return _row(name, INFO, "8192^3 bf16 GEMM: " + ", ".join(f"{k.split()[1]} SMs {v:.3f} ms ({v / base - 1:+.1%})"
                                                             for k, v in green.items())
                + f"; all {ms['sms']} SMs outside a green context {ms['all SMs ms']:.3f} ms", ms=ms)


if __name__ == "__main__":  # the probes' child processes (gpu_check.py runs them; not a command of its own)
    import argparse

    parser = argparse.ArgumentParser(description="gpu_check.py's overlap probes; run directly only as their child")
    parser.add_argument("--alloc-child", action="store_true", help="the allocator probe's trials, as JSON")
    parser.add_argument("--sm-child", action="store_true", help="the GEMM timings on fewer SMs, as JSON")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(json.dumps(_alloc_child() if args.alloc_child else _sm_child()))
