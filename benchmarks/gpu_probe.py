"""The one-GPU probes of ``gpu_check.py`` that the engine rows cannot show: the questions only the device answers.

- ``environment``: torch / CUDA / NCCL versions, device, SM count, free memory, SDPA flags, the environment
  variables that change the CUDA path (``CUDA_DEVICE_MAX_CONNECTIONS``, ``PYTORCH_CUDA_ALLOC_CONF``, ``NCCL_*``),
  whether the peak table knows the device.
- ``queue``: does a stream wait on unfinished work block *other* streams (one hardware queue)? Two
  subprocesses, ``CUDA_DEVICE_MAX_CONNECTIONS`` unset and ``=1``, each an NCCL world of one: a side stream
  sleeps 0.5 s; the waiting stream waits for it; a worker thread then issues an NCCL all-reduce (or a
  kernel) on a third stream and times how long it takes to complete. About 0 s: independent queues;
  about 0.5 s: a false dependency, the premise of the 2BW hazard the engine avoids by settling its
  transfers on the host while the reducer has links to run (``GradReducer.busy``).
- ``sdpa``: the attention kernel SDPA runs for each GPT (MHA) and Llama (GQA) shape, with and without a
  mask, bf16 and fp32, under each ``--attention-backend`` (read from the profiler's aten op), forward and
  backward, with the peak memory; a cell that fails must be one the configuration refuses at start-up.
- ``trainer stage``: a GPT-1.3B stage (d = 1) in the trainer's configuration (bf16 weights, fp32 gradient
  accumulation, saved-tensor hooks on) under Flush and 2BW: tokens/s, MFU, ``max_memory_allocated`` and
  ``max_memory_reserved`` against the planner's ``stage_memory`` for the same candidate.
- ``split backward``: a GPT and a Llama stage's layers, BACKWARD_INPUT + BACKWARD_WEIGHT into fp32 main gradients
  against the whole backward, and which first-use node types took the fused weight-gradient path (CUDA's
  node types are not the CPU's).
- ``trainer torch_dist async save and resume``: ``pretrain_gpt.py`` itself on this device (GPT-355M bf16, 30
  iterations, an ``--async-save`` torch_dist checkpoint at 15 and evaluation there), resumed from iteration
  15: the resumed losses equal the uninterrupted run's bitwise.
- ``async staging``: ``--async-save``'s host buffers are page-locked at their exact size (``is_pinned``, the
  caching host allocator's statistics unchanged where this torch has them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PASS, FAIL, NEEDS_GPU, INFO = "pass", "FAIL", "needs GPU", "info"
SLEEP_S = 0.5  # the blocking kernel's length in the queue probe
RESUME_RTOL = 1e-2  # losses after the first past a resume: bf16 rounding of nondeterministic attention backward


def _row(name: str, status: str, detail: str = "", **numbers) -> dict:
    return dict(check=name, status=status, detail=detail, **numbers)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:200]


# ------------------------------------------------------------------ environment
def environment_row(device) -> dict:
    import torch

    from megatron_2bw.training.log_format import peak_tflops_of

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "env": {k: v for k, v in os.environ.items()
                    if k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF") or k.startswith("NCCL_")}}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(device=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    free_GiB=free / 2**30, total_GiB=total / 2**30,
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
                    sdpa={k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                          for k in ("flash", "mem_efficient", "math", "cudnn")
                          if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")},
                    peak_bf16_tflops=peak_tflops_of(p.name, "bf16"),
                    host_memory_stats=hasattr(torch.cuda, "host_memory_stats"))
    detail = f"torch {info['torch']}, CUDA {info['cuda']}" + (f", NCCL {info.get('nccl')}, {info.get('device')}"
                                                             if device.type == "cuda" else "")
    return _row("environment", INFO, detail, **info)


# ------------------------------------------------------------------ queue probe (child process)
def _queue_child(port: int) -> dict:
    """In a fresh process (the variable is read at CUDA initialisation): the probe's trials."""
    import threading

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0),
                            init_method=f"tcp://127.0.0.1:{port}")
    g = dist.new_group([0])
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    cycles = int(10_000_000 * SLEEP_S / max(time.perf_counter() - t0, 1e-6))
    blocker, side = torch.cuda.Stream(), torch.cuda.Stream()

    def trial(waiter, nccl: bool) -> float:
        with torch.cuda.stream(blocker):
            torch.cuda._sleep(cycles)
        e = torch.cuda.Event()
        e.record(blocker)
        waiter.wait_event(e)  # the training stream's wait on a transfer not matched yet
        with torch.cuda.stream(waiter):
            torch.cuda._sleep(1000)
        start, out = time.perf_counter(), {}

        def worker() -> None:  # the reducer's worker issuing its next link on its own stream
            with torch.cuda.device(0), torch.cuda.stream(side):
                w = dist.all_reduce(x, group=g, async_op=True) if nccl else None
                ev = torch.cuda.Event()
                if not nccl:
                    x.add_(1)
                ev.record(side)
                while not (w.is_completed() if nccl else ev.query()):
                    time.sleep(1e-4)
            out["s"] = time.perf_counter() - start

        th = threading.Thread(target=worker)
        th.start()
        th.join()
        torch.cuda.synchronize()
        return out["s"]

    rows = {"default stream waits -> worker NCCL": trial(torch.cuda.current_stream(), True),
            "default stream waits -> side-stream kernel": trial(torch.cuda.current_stream(), False)}
    pool = [trial(torch.cuda.Stream(), True) for _ in range(12)]
    rows["pool stream waits -> worker NCCL (max of 12)"] = max(pool)
    dist.destroy_process_group()
    return rows


def env_with(name: str, value: str | None) -> dict[str, str]:
    """This process's environment with ``name`` set to ``value`` (None: unset), for a probe's child."""
    env = {k: v for k, v in os.environ.items() if k != name}
    if value:
        env[name] = value
    return env


def queue_rows(device, timeout_s: float = 60.0) -> list[dict]:
    """The queue probe with ``CUDA_DEVICE_MAX_CONNECTIONS`` unset and ``=1``, each in its own process."""
    from megatron_2bw.local_workers import free_port

    rows = []
    for conn in (None, "1"):
        name = f"queue probe CUDA_DEVICE_MAX_CONNECTIONS={conn or 'unset'}"
        if device.type != "cuda":
            rows.append(_row(name, NEEDS_GPU, "CUDA streams and NCCL"))
            continue
        env = env_with("CUDA_DEVICE_MAX_CONNECTIONS", conn)
        cmd = [sys.executable, os.path.abspath(__file__), "--queue-child", str(free_port())]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            delays = json.loads(done.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            rows.append(_row(name, INFO, f"no answer within {timeout_s:.0f} s: a stream wait blocked the worker"))
            continue
        except Exception as e:  # noqa: BLE001 - the probe's own failure is its row
            rows.append(_row(name, FAIL, _first_line(e)))
            continue
        blocked = {k: v for k, v in delays.items() if v > SLEEP_S / 2}
        detail = ("a stream wait delays other streams: " + ", ".join(f"{k} {v:.2f} s" for k, v in blocked.items())
                  if blocked else "independent queues (every delay < 0.25 s)")
        rows.append(_row(name, INFO, detail, delays_s=delays, false_dependency=bool(blocked)))
    return rows


# ------------------------------------------------------------------ trainer-configuration stage
def _planner_bytes(cfg, b: int, m: int, schedule: str, precision: str) -> int:
    """The planner's bytes for this stage (d = 1, the analytic costs of an H200 node): stage_memory's total."""
    from megatron_2bw.planner.hardware import load_cluster
    from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
    from megatron_2bw.planner.memory_model import Candidate, ParamBytes, stage_memory

    costs = analytic_microbatch_costs(cfg, load_cluster("dgx-h200"), precision, 1, b)
    cand = Candidate(1, 1, 1, b, m, False, schedule)
    return stage_memory(costs, cand, cfg.num_layers, 0, ParamBytes.for_precision(precision)).total


def _trainer_stage(cfg, spec, b: int, m: int, steps: int, warmup: int, dtype: str, schedule: str, device) -> dict:
    """One engine stage as the trainer configures it: fp32 gradient accumulation in bf16 (the precision's
    default), saved-tensor hooks on (``track_memory``), global-norm clipping."""
    import gpu
    import torch

    from megatron_2bw.config import OptimizerConfig, PipelineConfig
    from megatron_2bw.parallel_state import ParallelState
    from megatron_2bw.pipeline.build import build_stage

    pipe = PipelineConfig(schedule, b, m, recompute=False, track_memory=True)
    opt = OptimizerConfig("adam", lr=1e-4, dtype=dtype, clip_grad=1.0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), ParallelState.single(device), pipe, opt,
                        (b, cfg.seq_length, cfg.hidden_size))
    batches = gpu._batches(spec, cfg, b, 2 * m, device)
    get = lambda mb: batches[mb % len(batches)]  # noqa: E731
    stage.train(warmup, get, lambda t: 1e-4)
    gpu._sync(device)
    t0 = time.perf_counter()
    res = stage.train(steps, get, lambda t: 1e-4)
    gpu._sync(device)
    out = dict(seconds=time.perf_counter() - t0, steps=steps, last_loss=res[-1].loss,
               grads=str(stage.opt.grad_dtype).replace("torch.", ""), **gpu.memory_stats(device))
    del stage
    return out


def trainer_stage_rows(device, steps: int, warmup: int, deadline: float) -> list[dict]:
    """GPT-1.3B (CPU: gpt-tiny) in the trainer's configuration: MFU and memory against the planner."""
    import gc
    import math

    import gpu
    import torch

    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.fused import select_kernels
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.training.log_format import peak_tflops_of

    cuda = device.type == "cuda"
    model, dtype, b, m = ("gpt-1.3b", "bf16", 4, 4) if cuda else ("gpt-tiny", "fp32", 2, 2)
    cfg = get_preset(model)
    peak = peak_tflops_of(torch.cuda.get_device_name(device), dtype) if cuda else None
    rows = []
    for schedule in ("flush", "2bw"):
        name = f"trainer stage {model} {dtype} {schedule}"
        if time.perf_counter() > deadline:
            rows.append(_row(name, INFO, "skipped: the script's time budget is spent"))
            continue
        spec = ModelSpec(cfg, ModelGroups(), 1234, kernels=select_kernels("auto", device.type))
        try:
            r = _trainer_stage(cfg, spec, b, m, steps, warmup, dtype, schedule, device)
        except Exception as e:  # noqa: BLE001 - out of memory or a crash is this row's failure
            rows.append(_row(name, FAIL, _first_line(e)))
            continue
        finally:
            gc.collect()
        tflops = r["steps"] * gpu.flops_per_step(cfg, b, m) / r["seconds"] / 1e12
        planned = _planner_bytes(cfg, b, m, schedule, dtype)
        alloc = r.get("peak_memory_GiB")
        numbers = dict(tokens_per_sec=r["steps"] * b * m * cfg.seq_length / r["seconds"], tflops_per_device=tflops,
                       mfu=tflops / peak if peak else None, max_allocated_GiB=alloc,
                       max_reserved_GiB=r.get("peak_reserved_GiB"), planner_GiB=planned / 2**30,
                       allocated_over_planner=alloc * 2**30 / planned if alloc else None, grads=r["grads"])
        ok = math.isfinite(r["last_loss"]) and (alloc is None or alloc * 2**30 <= planned)
        rows.append(_row(name, PASS if ok else FAIL, f"b={b} m={m} grads {r['grads']}, saved-tensor hooks on"
                         + ("" if ok else ": non-finite loss or more memory than the planner counts"), **numbers))
    return rows


# ------------------------------------------------------------------ split backward
def _split_case(model: str, dtype: str, device) -> dict:
    """A stage's middle layers: the whole backward against backward_input + backward_weight into fp32 main
    gradients (the trainer's accumulation), and which first-use nodes took the fused weight-gradient path."""
    import torch

    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.fused import select_kernels
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.pipeline import wgrad_fusion
    from megatron_2bw.pipeline.split_backward import accumulator, backward_input, backward_weight

    cfg = get_preset(model)
    if cfg.seq_length > 2048:  # llama-1b's 8192: the node types, not the length, are the point
        cfg = get_preset(model, seq_length=2048)
    spec = ModelSpec(cfg, ModelGroups(), 1234, kernels=select_kernels("auto", device.type))
    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    layers = torch.nn.ModuleList(spec.build_stage(1, 0)).to(device=device, dtype=tdt)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))
    batch = {k: v.to(device) for k, v in spec.make_batch(tokens).items()}
    body = layers[1:-1]
    params = [p for p in body.parameters()]
    x = layers[0](None, batch).detach().requires_grad_(True)

    def run():
        h = x
        for layer in body:
            h = layer(h, batch)
        return h

    out = run()
    g = torch.randn_like(out)
    whole = torch.autograd.grad(out, params, g)
    for p in params:
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    before = dict(wgrad_fusion.TALLY)
    out = run()
    index = {accumulator(p): i for i, p in enumerate(params)}
    _, deferred = backward_input(out, g, x, index)
    backward_weight(deferred, params, index, main_grads=True)
    tally = {f"{k[0]} {'fused' if k[1] else 'autograd'}": n - before.get(k, 0)
             for k, n in wgrad_fusion.TALLY.items() if n != before.get(k, 0)}
    rel = max(((p.main_grad - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item()
              for p, w in zip(params, whole, strict=False))
    return {"max_rel_diff": rel, "tally": tally}


def split_backward_rows(device) -> list[dict]:
    """GPT and Llama (RMSNorm, SwiGLU, GQA) shapes: split backward against the whole one, fused-path tally."""
    cuda = device.type == "cuda"
    rows = []
    for model in (("gpt-355m", "llama-1b") if cuda else ("gpt-tiny", "llama-tiny")):
        dtype = "bf16" if cuda else "fp32"
        name = f"split backward {model} {dtype}"
        try:
            r = _split_case(model, dtype, device)
        except Exception as e:  # noqa: BLE001
            rows.append(_row(name, FAIL, _first_line(e)))
            continue
        ok = r["max_rel_diff"] <= (2e-2 if dtype == "bf16" else 1e-5)
        fused = sum(n for k, n in r["tally"].items() if k.endswith("fused"))
        rows.append(_row(name, PASS if ok else FAIL, f"I + W vs whole: max rel diff {r['max_rel_diff']:.2e}; fused "
                         f"{fused} of {sum(r['tally'].values())} groups", **r))
    return rows


# ------------------------------------------------------------------ the trainer, saved and resumed
def _trainer(args: list[str], timeout_s: float) -> tuple[dict[int, float], float, str]:
    """``pretrain_gpt.py`` in one process; its train losses by iteration (metrics file), seconds, output tail."""
    import tempfile

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        metrics = f.name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.join(repo, "pretrain_gpt.py"), *args, "--metrics-file", metrics],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.perf_counter() - t0
    with open(metrics, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    os.unlink(metrics)
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] if done.returncode else []
    if done.returncode:
        raise RuntimeError(f"pretrain_gpt.py exited {done.returncode}: {tail[0] if tail else ''}"[:200])
    return {r["iteration"]: r["loss"] for r in recs if r["type"] == "train"}, seconds, ""


def trainer_resume_row(device, deadline: float) -> dict:
    """The trainer's own path on this device (one process): a torch_dist ``--async-save`` at the middle
    iteration (pinned staging, the writer thread, DCP), evaluation, then a resume from that checkpoint whose
    losses must equal the uninterrupted run's bitwise (DCP's load into device buffers, the RNG restore)."""
    import shutil
    import tempfile

    from megatron_2bw.checkpoint.layout import TRACKER, iteration_dir

    name = "trainer torch_dist async save and resume"
    cuda = device.type == "cuda"
    if time.perf_counter() > deadline - (120 if cuda else 0):  # two runs of about a minute in all on an H200
        return _row(name, INFO, "skipped: the script's time budget is spent")
    n, half = (30, 15) if cuda else (4, 2)
    model = (["--model-preset", "gpt-355m", "--bf16", "--micro-batch-size", "8", "--global-batch-size", "32",
              "--vocab-size", "50257"] if cuda else
             ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size",
              "100", "--device", "cpu"])
    common = [*model, "--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--train-iters", str(n),
              "--log-interval", "1", "--eval-interval", str(half), "--eval-iters", "1", "--ckpt-format", "torch_dist",
              "--async-save", "--save-interval", str(half)]
    if cuda:  # the trainer processes share the GPU with this one: hand back what its allocator caches
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    root = tempfile.mkdtemp(prefix="gpu_check_ckpt_")
    try:
        first, s1, _ = _trainer([*common, "--save", os.path.join(root, "a")], 300)
        shutil.copytree(iteration_dir(os.path.join(root, "a"), half), iteration_dir(os.path.join(root, "b"), half))
        with open(os.path.join(root, "b", TRACKER), "w", encoding="utf-8") as f:
            f.write(str(half))
        second, s2, _ = _trainer([*common, "--load", os.path.join(root, "b"), "--save", os.path.join(root, "b")], 300)
    except Exception as e:  # noqa: BLE001 - a crash, an out of memory or a hang of the trainer is this row's failure
        return _row(name, FAIL, _first_line(e))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # the first loss after the resume is a forward on the restored weights: bitwise; later ones went through
    # backward passes whose flash/efficient kernels use atomics (not deterministic): a bf16 tolerance (G10)
    after = {i: v for i, v in first.items() if i > half}
    first_ok = bool(after) and second.get(min(after)) == after[min(after)]
    same = first_ok and all(i in second and abs(second[i] - v) <= RESUME_RTOL * abs(v) for i, v in after.items())
    return _row(name, PASS if same else FAIL, f"loss {half + 1} after the resume "
                + ("equals the uninterrupted run's bitwise, the later ones within "
                   f"{RESUME_RTOL:g}" if same else f"differ: {after} vs {second}"), run_s=s1, resume_s=s2)


# ------------------------------------------------------------------ async-save staging
def staging_row(device) -> dict:
    """``--async-save``'s staging buffer: page-locked at its exact size, outside torch's caching host allocator."""
    import torch

    from megatron_2bw.checkpoint.dist_checkpoint.async_writer import _Staging
    from megatron_2bw.checkpoint.dist_checkpoint.shard_map import Chunk

    if device.type != "cuda":
        return _row("async staging pinned exact", NEEDS_GPU, "page-locking needs CUDA")
    n = 3 * 2**24 + 5  # 48 Mi + 5 elements: the caching allocator would round it up to 64 Mi
    src = torch.randn(n, device=device)
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.current", 0) if stats() else None
    st = _Staging()
    try:
        t0 = time.perf_counter()
        out = st.stage([Chunk("x", (0,), (n,), src)])
        staged_s = time.perf_counter() - t0
        host = out[0].tensor
        after = stats().get("allocated_bytes.current", 0) if stats() else None
        ok = host.is_pinned() and torch.equal(host, src.cpu()) and st.pinned_bytes() == 4 * n
        return _row("async staging pinned exact", PASS if ok else FAIL,
                    f"pinned {st.pinned_bytes()} B for {4 * n} B staged, is_pinned {host.is_pinned()}, {staged_s:.2f} "
                    f"s",
                    pinned_bytes=st.pinned_bytes(), staged_bytes=4 * n, stage_s=staged_s,
                    caching_host_allocator_delta=None if before is None else after - before)
    except Exception as e:  # noqa: BLE001
        return _row("async staging pinned exact", FAIL, _first_line(e))
    finally:
        for dtype in list(st.pinned):
            from megatron_2bw.checkpoint.dist_checkpoint.async_writer import _unpin

            _unpin(st.buffers[dtype])


if __name__ == "__main__":  # the queue probe's child process (gpu_check.py runs it; not a command of its own)
    import argparse

    parser = argparse.ArgumentParser(description="gpu_check.py's probes; run directly only as the queue probe's child")
    parser.add_argument("--queue-child", type=int, required=True, metavar="PORT",
                        help="run the stream-wait probe's trials (the store on PORT) and print their JSON")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(json.dumps(_queue_child(args.queue_child)))
