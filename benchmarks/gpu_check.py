"""GPU acceptance check: the CUDA path end to end on one GPU within 7 minutes (issues 20, 33 and 44).

Checks, each a row of one printed table and an entry of the JSON written to ``--out``:

- ``kernels``: the kernel choice of ``--fused-kernels auto`` on this device (apex or torch, and
  why not apex), as the trainer logs it.
- ``train <model> <dtype> <system>``: GPT-355M and GPT-1.3B in bf16 and fp16, our engine at
  d = 1 with PipeDream-Flush and PipeDream-2BW (``benchmarks/gpu.py``'s loops) against a plain
  PyTorch loop over the same layers: tokens/s, TFLOP/s and MFU with the trainer's formula
  (``megatron_2bw.config.arith``), ``max_memory_allocated`` / ``max_memory_reserved``. Fails
  on an error (out of memory included), a non-finite loss, every timed step skipped, or a first
  loss off the plain loop's (same weights, same batches) by more than the precision allows.
- ``recompute replay``: a stage's layers with dropout 0.1 under activation recomputation; the
  replay during backward must reproduce the forward output bitwise (same RNG draws, same kernels).
- ``fp16 large gradient``: fp16 gradients whose per-tensor norm exceeds fp16's range (65504) while
  every element is finite: the global norm the update uses must be finite (a skipped step otherwise).
- ``checkpoint save/resume``: the device bytes a checkpoint save and a resume allocate beyond what
  training holds (a save should make no device copies of weights or optimizer state; at most 5 %
  of the weight bytes), and the resumed stage's weights equal the saved ones bitwise.
- ``d=2 2bw+distopt [CUDA_DEVICE_MAX_CONNECTIONS=1]`` (2 or more GPUs): PipeDream-2BW with
  ``--use-distributed-optimizer`` at d = 2 over NCCL, with and without ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
  120 s each: a hang is a failure (the last stage's forward sleeps 10 ms on the GPU so its host runs ahead).

Before those, the probes of ``gpu_probe.py``: the environment, whether a stream wait blocks other streams
(``queue probe``), the SDPA kernel of every GPT/Llama attention configuration, ``--async-save``'s page-locked
staging, and a GPT-1.3B stage in the trainer's configuration (fp32 gradients, saved-tensor hooks) with its
MFU and its memory against the planner's model; and those of ``gpu_probe_overlap.py``: whether the
allocator's out-of-memory retry synchronizes the device (``allocator retry sync``), the batch prefetch
(``prefetch batches`` / ``prefetch h2d``), GEMMs on fewer SMs (``compute on fewer SMs``), the update's host
wait against a GPU backlog (``update wait gpu backlog``) and, with 2 GPUs, the last stage's step time with
the tied embedding against untied (``tied embedding d=2 last stage``); and ``gpu_probe_reserve.py``'s device memory
outside torch's allocator (the context, libraries, one-rank NCCL communicators) against the presets' reserve
(``reserve outside the allocator``, review 3 N14). The JSON is written after every section,
to ``--out`` (default ``$OUT/gpu_check.json``, else the temporary directory); rows that would start after ``--budget-s``
(360 s, checked between sections and between a training row's systems: the whole script within 420 s on one GPU) are
skipped and say so.

Exits 1 if any check fails, else 0. Without CUDA it refuses (exit 2) unless ``--allow-cpu``: then a
CI-sized form runs on the CPU (gpt-tiny in fp32, one timed step; the checkpoint row in bf16) to exercise the code,
and the rows that need a GPU say so (status ``needs GPU``; they do not fail the run).

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out "$OUT/gpu_check.json"   # on a GPU machine
    python benchmarks/gpu_check.py --allow-cpu --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time

import common
import gpu

PASS, FAIL, NEEDS_GPU = "pass", "FAIL", "needs GPU"
GPU_MODELS = ("gpt-355m", "gpt-1.3b")
# never inside the repository: under $OUT where the caller collects results (the device machine), else the temp dir
DEFAULT_OUT = os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "gpu_check.json")
# rows that would start past the budget are skipped, not run: a training system or a section started just before it
# runs on for up to about a minute, so the whole script ends within 420 s (the device's one call, review 3 section 4)
BUDGET_S = 360.0
# the engine's first loss against the plain loop's, same weights and batches: both run the same layers
# in the same precision; the engine's fp32 master only matters after the first update
FIRST_LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
SAVE_EXTRA_FRACTION = 0.05  # device bytes a save/resume may allocate, as a fraction of the weight bytes
D2_TIMEOUT_S = 120.0


def _row(name: str, status: str, detail: str = "", **numbers) -> dict:
    return dict(check=name, status=status, detail=detail, **numbers)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ kernels
def check_kernels(device) -> dict:
    from megatron_2bw.fused import apex_unusable_reason, select_kernels

    k = select_kernels("auto", device.type)
    why = apex_unusable_reason() if device.type == "cuda" else "not CUDA"
    return _row("kernels", PASS, f"{k.describe()}" + (f" (apex not used: {why})" if why else " (apex)"),
                layer_norm=k.layer_norm)


# ------------------------------------------------------------------ training throughput
def check_training(model: str, dtype: str, device, steps: int, warmup: int, m: int, kernels, peak,
                   deadline: float = math.inf) -> list[dict]:
    """Flush and 2BW at d = 1 and the plain loop, on the same layers, weights and batches; a system that would
    start after ``deadline`` is skipped (one info row), so the script ends within a system of its budget."""
    import torch

    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec

    cfg = get_preset(model)
    b = gpu.DEFAULT_MICRO.get(model, 2)
    tokens_per_step = m * b * cfg.seq_length
    fps = gpu.flops_per_step(cfg, b, m)
    rows, plain_first = [], None
    for system in ("plain", "engine_flush_d1", "engine_2bw_d1"):
        name = f"train {model} {dtype} {system}"
        if time.perf_counter() > deadline:
            rows.append(_row(name, "info", "skipped: the script's time budget is spent"))
            continue
        spec = ModelSpec(cfg, ModelGroups(), 1234, kernels=kernels)
        try:
            if system == "plain":
                r = gpu.run_plain(spec, cfg, b, m, steps, warmup, {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                                 "fp16": torch.float16}[dtype], device)
            else:
                r = gpu.run_engine(spec, cfg, b, m, steps, warmup, dtype, device, schedule=system.split("_")[1])
        except Exception as e:  # noqa: BLE001 - out of memory or a crash: this row fails, the others run
            rows.append(_row(name, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]))
            continue
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tflops = r["steps"] * fps / r["seconds"] / 1e12
        numbers = dict(tokens_per_sec=r["steps"] * tokens_per_step / r["seconds"], tflops_per_device=tflops,
                       mfu=tflops / peak if peak else None, max_allocated_GiB=r.get("peak_memory_GiB"),
                       max_reserved_GiB=r.get("peak_reserved_GiB"), first_loss=r["first_loss"],
                       last_loss=r["last_loss"], skipped=r.get("skipped", 0), grads=r.get("grad_dtype"))
        problems = []
        if not (math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])):
            problems.append("non-finite loss")
        if r.get("skipped", 0) >= r["steps"]:
            problems.append(f"every timed step skipped ({r['skipped']})")
        if system == "plain":
            plain_first = r["first_loss"]
        elif plain_first is not None and math.isfinite(plain_first):
            rel = abs(r["first_loss"] - plain_first) / abs(plain_first)
            numbers["first_loss_vs_plain"] = rel
            if rel > FIRST_LOSS_RTOL[dtype]:
                problems.append(f"first loss {r['first_loss']:.5f} vs plain {plain_first:.5f} (rel {rel:.2e})")
        rows.append(_row(name, FAIL if problems else PASS, "; ".join(problems) or f"b={b} m={m} grads "
                                                                                  f"{numbers['grads']}",
                         **numbers))
    return rows


# ------------------------------------------------------------------ recomputation replay
def check_recompute_replay(device, dtype: str, kernels) -> dict:
    """Stage layers with dropout under ``checkpointed``: the backward's replay equals the forward, bitwise."""
    import torch
    from torch import nn

    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.tensor_parallel.random import RNGTracker
    from megatron_2bw.tensor_parallel.recompute import checkpointed

    model = "gpt-355m" if device.type == "cuda" else "gpt-tiny"
    cfg = get_preset(model, hidden_dropout=0.1, attention_dropout=0.1)
    tracker = RNGTracker(1234, 0, device)
    spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker, kernels=kernels)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    layers = nn.ModuleList(spec.build_stage(1, 0)).to(device=device, dtype=tdtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))
    batch = {k: v.to(device) for k, v in spec.make_batch(tokens).items()}
    outputs = []

    def body(h):
        for layer in layers[1:-1]:
            h = layer(h, batch)
        outputs.append(h.detach().clone())
        return h

    x = layers[0](None, batch).detach().requires_grad_(True)
    # torch stops a replay once it has what backward needs; run it to the end, where the output is recorded
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        out = checkpointed(body, x, tracker=tracker)
    out.float().square().mean().backward()
    _sync(device)
    if len(outputs) != 2:
        return _row(f"recompute replay {model} {dtype}", FAIL, f"the body ran {len(outputs)} times, expected 2")
    same = torch.equal(outputs[0], outputs[1])
    diff = (outputs[0].float() - outputs[1].float()).abs().max().item()
    return _row(f"recompute replay {model} {dtype}", PASS if same else FAIL,
                "replay == forward (bitwise), dropout 0.1" if same else f"replay differs by up to {diff:.3e}")


# ------------------------------------------------------------------ fp16 large finite gradients
def check_fp16_large_gradient(device) -> dict:
    """Per-tensor norms above 65504 with finite elements: the update's global norm must be finite."""
    import torch

    from megatron_2bw.pipeline.grad_reducer import grad_sumsq

    views = [torch.full((10000,), 1000.0, dtype=torch.float16, device=device),  # norm 1e5 > 65504
             torch.full((300,), -0.5, dtype=torch.float16, device=device)]
    got = float(grad_sumsq(views, device).item())
    want = float(sum(v.double().square().sum().item() for v in views))
    ok = math.isfinite(got) and abs(got - want) <= 1e-3 * want
    return _row("fp16 large gradient", PASS if ok else FAIL,
                f"global sum of squares {got:.6g} (fp64 reference {want:.6g})"
                + ("" if ok else ": a finite step would be counted as an overflow and skipped"))


# ------------------------------------------------------------------ checkpoint save and resume
def _d2_worker(w: int, steps: int, model: str = "gpt-355m", settle: bool = True,
               sleep: bool = True) -> tuple[list[float], list[float]]:
    """One rank of 2BW + the distributed optimizer at d = 2 (``run_workers`` has set this rank's GPU;
    on a CPU-only gloo world the same code runs on the CPU): the losses and the host time of each update.

    ``settle`` False takes out the rule that settles transfers on the host while the reducer is busy
    (``GradReducer.busy``; review 3 G6 asks what it costs), by unwiring it here, not by a library switch;
    ``sleep`` False drops the last stage's GPU sleep (a step time of the model itself)."""
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

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    state = build_state(Axes(data=w, pipeline=2), device)
    cfg = get_preset(model)
    b, m = 2, 4
    tracker = RNGTracker(1234, state.tp_rank, device)
    spec = ModelSpec(cfg, ModelGroups.of(state), 1234, rng=tracker)

    def layers():
        """The last stage's forward gets a 10 ms GPU sleep, so its host runs ahead of its stream (the case where
        a stream wait on a transfer could sit ahead of the reducer's links); without it a fast GPU may never
        let the host run ahead and a deadlock would not show."""
        built = spec.build_stage(2, state.pp_rank)
        if sleep and device.type == "cuda" and state.pp_rank == 1:
            built[-1].register_forward_hook(lambda *_: torch.cuda._sleep(20_000_000))
        return built

    stage = build_stage(layers, spec.loss_fn(), state,
                          PipelineConfig("2bw", b, m, track_memory=False),
                          OptimizerConfig("adam", lr=1e-4, dtype="bf16", use_distributed_optimizer=True),
                          (b, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker,
                          names=GlobalNames(stage_range(cfg.num_layers, 2, state.pp_rank)[0], tied=WORD))
    g = torch.Generator().manual_seed(11 + state.dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (2 * m, b, cfg.seq_length + 1), generator=g)
    batches = [{k: v.to(device) for k, v in spec.make_batch(t).items()} for t in tokens]
    if not settle:
        stage.transport.settle_while = stage.reducer.before_issue = None
    times: list[float] = []
    res = stage.train(steps, lambda mb: batches[mb % len(batches)], lambda t: 1e-4,
                      on_update=lambda r: times.append(time.perf_counter()))
    _sync(device)
    return [r.loss for r in res if r.loss is not None], times


def check_d2(n_gpus: int, steps: int = 4) -> list[dict]:
    from megatron_2bw.local_workers import run_workers

    rows = []
    w = max(1, n_gpus // 2)
    for one in (False, True):
        name = f"d=2 w={w} 2bw+distopt" + (" CUDA_DEVICE_MAX_CONNECTIONS=1" if one else "")
        if n_gpus < 2:
            rows.append(_row(name, NEEDS_GPU, "needs 2 or more GPUs"))
            continue
        old = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if one:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        else:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        t0 = time.perf_counter()
        try:
            out = run_workers(_d2_worker, 2 * w, w, steps, timeout=D2_TIMEOUT_S, pg_timeout=D2_TIMEOUT_S,
                              backend="nccl")
            losses = [x for r, _ in out for x in r]
            ok = bool(losses) and all(math.isfinite(x) for x in losses)
            rows.append(_row(name, PASS if ok else FAIL, f"{steps} steps in {time.perf_counter() - t0:.0f} s"
                             + ("" if ok else f": losses {losses}")))
        except Exception as e:  # noqa: BLE001 - a hang (TimeoutError) or a crash is this row's failure
            rows.append(_row(name, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]))
        finally:
            if old is None:
                os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
            else:
                os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = old
    return rows


def check_settle_cost(n_gpus: int, deadline: float = math.inf, steps: int = 10) -> list[dict]:
    """Review 3 G6: the step time of 2BW + the distributed optimizer at d = 2 (GPT-355M, b = 2, m = 4: small
    microbatches, where the host settling transfers while the reducer runs would show) with the rule and without it,
    each the median of the steady steps' update-to-update times on the last stage. Measured (info); without the rule
    a hang is the hazard the rule exists for and is reported as such."""
    from megatron_2bw.local_workers import run_workers

    name = "d=2 settle rule cost"
    if n_gpus < 2:
        return [_row(name, NEEDS_GPU, "needs 2 or more GPUs")]
    w, medians = max(1, n_gpus // 2), {}
    for settle in (True, False):
        if time.perf_counter() > deadline:
            return [_row(name, "info", "skipped: the script's time budget is spent")]
        try:
            out = run_workers(_d2_worker, 2 * w, w, steps, "gpt-355m", settle, False, timeout=D2_TIMEOUT_S,
                              pg_timeout=D2_TIMEOUT_S, backend="nccl")
        except Exception as e:  # noqa: BLE001 - a hang without the rule is the hazard, not a fault of the engine
            if settle:
                return [_row(name, FAIL, f"with the rule: {type(e).__name__}: {str(e).splitlines()[0][:160]}")]
            return [_row(name, "info", f"without the rule it did not finish ({type(e).__name__}): the hazard")]
        times = out[-1][1]  # the last rank is on the last stage
        gaps = [b - a for a, b in zip(times[2:], times[3:])]  # the steady steps
        medians[settle] = sorted(gaps)[len(gaps) // 2]
    return [_row(name, "info", f"step {medians[True] * 1e3:.1f} ms with the rule, {medians[False] * 1e3:.1f} ms "
                 f"without: {medians[True] / medians[False]:.3f}x", with_rule_s=medians[True],
                 without_rule_s=medians[False])]


# ------------------------------------------------------------------ main
def _write_atomic(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _setup(args) -> dict:
    """Device, kernels and the sizes of this machine's form (the CPU form: tiny and one step)."""
    import torch

    from megatron_2bw.fused import select_kernels

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dict(cuda=cuda, device=device, name=torch.cuda.get_device_name(device) if cuda else "cpu",
                n_gpus=torch.cuda.device_count() if cuda else 0, kernels=select_kernels("auto", device.type),
                models=GPU_MODELS if cuda else ("gpt-tiny",), dtypes=("bf16", "fp16") if cuda else ("fp32",),
                steps=args.steps if cuda else 1, warmup=args.warmup if cuda else 1, m=args.m if cuda else 2,
                cpu_trainer=args.cpu_trainer)


def _sections(env: dict, deadline: float):
    """Every check, in order of what it tells per second: each yields (its name, a call returning its rows), so
    ``main`` guards each (an exception is one FAIL row, review 3 G12) and skips the ones past the deadline."""
    import gpu_probe
    import gpu_probe_cp as cp
    import gpu_probe_overlap as overlap
    import gpu_probe_reserve as reserve
    import gpu_probe_sdpa
    from gpu_check_memory import check_checkpoint_memory

    from megatron_2bw.training.log_format import peak_tflops_of

    device, kernels = env["device"], env["kernels"]
    small = device.type != "cuda"
    yield "environment", lambda: [gpu_probe.environment_row(device), check_kernels(device)]
    yield "queue probe", lambda: gpu_probe.queue_rows(device)
    yield "allocator retry sync", lambda: overlap.alloc_sync_rows(device)
    yield "prefetch", lambda: overlap.prefetch_rows(device)
    yield "compute on fewer SMs", lambda: [overlap.sm_share_row(device)]
    yield "sdpa", lambda: gpu_probe_sdpa.sdpa_rows(device)
    yield "cp core", lambda: cp.cp_core_rows(device, small)
    yield "cp prefix", lambda: cp.prefix_rows(device, small)
    yield "fp16 large gradient, staging", lambda: [check_fp16_large_gradient(device), gpu_probe.staging_row(device)]
    yield "split backward", lambda: gpu_probe.split_backward_rows(device)
    yield "recompute replay", lambda: [check_recompute_replay(device, dtype, kernels) for dtype in env["dtypes"]]
    yield "checkpoint memory", lambda: check_checkpoint_memory(device, "bf16", kernels)
    yield "update wait", lambda: [overlap.update_wait_row(device, deadline)]
    yield "trainer stage", lambda: gpu_probe.trainer_stage_rows(device, env["steps"], env["warmup"], deadline)
    yield "reserve", lambda: [reserve.reserve_row(device, env["name"])]  # after a training stage: its libraries loaded
    if env["cuda"] or env["cpu_trainer"]:
        yield "trainer resume", lambda: [gpu_probe.trainer_resume_row(device, deadline)]
    else:
        yield "trainer resume", lambda: [_row("trainer torch_dist async save and resume", "info",
                                              "not run in the CPU form (two trainer processes, about 40 s); "
                                              "--cpu-trainer runs it")]
    for model in env["models"]:
        for dtype in env["dtypes"]:
            peak = peak_tflops_of(env["name"], dtype)
            yield f"train {model} {dtype}", lambda model=model, dtype=dtype, peak=peak: check_training(
                model, dtype, device, env["steps"], env["warmup"], env["m"], kernels, peak, deadline)
    yield "d=2", lambda: check_d2(env["n_gpus"])
    yield "d=2 settle rule cost", lambda: check_settle_cost(env["n_gpus"], deadline)
    yield "tied embedding d=2", lambda: [overlap.tied_d2_row(env["n_gpus"], deadline)]


def _run_section(name: str, call, deadline: float) -> list[dict]:
    """A section's rows; one FAIL row if it raised; one info row if the budget was spent before it."""
    if time.perf_counter() > deadline:
        return [_row(name, "info", "skipped: the script's time budget is spent")]
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - an OOM or an API drift fails this section, not the later ones
        return [_row(name, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="the JSON written, after every section ($OUT/gpu_check.json, "
                                                      "else the temp dir; never the repository by default)")
    p.add_argument("--allow-cpu", action="store_true", help="no CUDA: run the CI-sized form on the CPU")
    p.add_argument("--steps", type=int, default=4, help="timed steps per training row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--m", type=int, default=4, help="microbatches per step")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="skip the rows that would start after this")
    p.add_argument("--cpu-trainer", action="store_true", help="the CPU form runs the trainer save/resume row too")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: no CUDA device (give --allow-cpu for the CPU form)", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    env = _setup(args)
    rows: list[dict] = []

    def record(done: bool) -> None:
        failed = [r for r in rows if r["status"] == FAIL]
        _write_atomic(args.out, {
            "device": env["name"], "gpus": env["n_gpus"], "cuda": env["cuda"], "torch": torch.__version__,
            "kernels": env["kernels"].describe(), "elapsed_s": time.perf_counter() - t_start, "complete": done,
            "machine": common.machine_info(), "ok": not failed,
            "config": {"steps": env["steps"], "warmup": env["warmup"], "m": env["m"], "models": list(env["models"]),
                       "dtypes": list(env["dtypes"]), "budget_s": args.budget_s,
                       "flops_per_step": "72 B s L h^2 (1 + s/6h + V/12Lh), padded V (megatron_2bw.config.flops)",
                       "first_loss_rtol": FIRST_LOSS_RTOL, "save_extra_fraction": SAVE_EXTRA_FRACTION,
                       "d2_timeout_s": D2_TIMEOUT_S},
            "checks": rows,
        })

    deadline = t_start + args.budget_s
    for name, call in _sections(env, deadline):
        rows += _run_section(name, call, deadline)
        record(False)
    record(True)
    _report(rows, env, time.perf_counter() - t_start)
    print(f"wrote {args.out}")
    return 1 if any(r["status"] == FAIL for r in rows) else 0


def _report(rows: list[dict], env: dict, elapsed: float) -> None:
    import torch

    failed = [r for r in rows if r["status"] == FAIL]
    cols = [("check", "check", ""), ("status", "status", ""), ("tokens_per_sec", "tokens/s", ".0f"),
            ("tflops_per_device", "TFLOP/s", ".1f"), ("mfu", "MFU", ".3f"),
            ("max_allocated_GiB", "max alloc GiB", ".1f"),
            ("max_reserved_GiB", "max resv GiB", ".1f"), ("detail", "detail", "")]
    print(f"{env['name']} x {max(env['n_gpus'], 1)}, torch {torch.__version__}, kernels {env['kernels'].describe()}, "
          f"{elapsed:.0f} s")
    print(common.table(rows, cols))
    needs = [r["check"] for r in rows if r["status"] == NEEDS_GPU]
    if needs:
        print(f"not checked on this machine (need a GPU): {', '.join(needs)}")
    print(f"{len(rows) - len(failed) - len(needs)} passed or measured, {len(failed)} failed, {len(needs)} need a GPU")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
