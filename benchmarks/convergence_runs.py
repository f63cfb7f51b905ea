"""One convergence run: the demo corpus it trains on, the trainer command, the run in its own process
group with a timeout, and its metrics file read back into a curve (``convergence.py``, ``log_interval.py``)."""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import time

import common

ROOT = common.ROOT
SCHEDULES = ("2bw", "flush")
MUON_LR = 0.02  # --optimizers muon: peak lr of the matrices (Keller Jordan's Muon default)


# ---------------------------------------------------------------------------------------- data
def ensure_data(data_dir: str, vocab: int, max_mb: float, python: str = sys.executable) -> tuple[str, str]:
    """The three cached steps of ``scripts/demo.sh``: corpus, SentencePiece model, indexed dataset.

    Returns (data prefix, tokenizer model). Each step runs only when its output is missing, so
    with the default paths it reuses what ``scripts/demo.sh`` built (and the other way round).
    """
    os.makedirs(data_dir, exist_ok=True)
    corpus = os.path.join(data_dir, "corpus.jsonl")
    tok = os.path.join(data_dir, f"tok_{vocab}")
    prefix = os.path.join(data_dir, f"demo_{vocab}")
    tools = os.path.join(ROOT, "tools")

    def run(cmd):
        subprocess.run([python, *cmd], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)

    if not _nonempty(corpus):
        run([os.path.join(tools, "build_demo_corpus.py"), "--output", corpus + ".tmp", "--max-mb", str(max_mb)])
        os.replace(corpus + ".tmp", corpus)
    if not _nonempty(tok + ".model"):
        run([os.path.join(tools, "train_tokenizer.py"), "--input", corpus, "--vocab-size", str(vocab),
             "--model-prefix", tok])
    if not _nonempty(prefix + "_text_document.idx"):
        run([os.path.join(tools, "preprocess_data.py"), "--input", corpus, "--output-prefix", prefix,
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok + ".model", "--append-eod"])
    return prefix + "_text_document", tok + ".model"


def _nonempty(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) > 0


# ---------------------------------------------------------------------------------------- one run
def trainer_command(args, schedule: str, data_prefix: str, tok_model: str, metrics: str, lr: float | None = None,
                    seed: int | None = None, compensation: str = "none", optimizer: str = "adamw") -> list[str]:
    global_batch = args.micro_batch * args.m  # w = 1
    lr = args.lr if lr is None else lr
    min_lr = args.min_lr * lr / args.lr  # the same decay ratio at every learning rate
    d = str(getattr(args, "depth", 2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", d,
           os.path.join(ROOT, "pretrain_gpt.py"),
           "--model-preset", args.preset, "--seq-length", str(args.seq), "--device", "cpu",
           "--pipeline-model-parallel-size", d, "--pipeline-schedule", schedule,
           "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(global_batch),
           "--train-iters", str(args.iters),
           "--lr", str(lr), "--min-lr", str(min_lr), "--lr-decay-style", "cosine",
           "--lr-warmup-iters", str(args.warmup), "--weight-decay", "0.01", "--clip-grad", "1.0",
           "--seed", str(args.seeds[0] if seed is None else seed),
           "--data-path", data_prefix, "--split", "98,2,0",
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok_model,
           "--log-interval", str(args.log_interval), "--eval-interval", str(args.eval_interval),
           "--eval-iters", str(args.eval_iters), "--metrics-file", metrics]
    if args.model_flags:
        cmd += args.model_flags
    if schedule == "2bw":  # explicit, "none" too: the trainer's default (auto) picks a mode by optimizer and precision
        cmd += ["--2bw-compensation", compensation, "--2bw-dc-lambda", str(args.dc_lambda)]
    if optimizer == "muon":  # the matrices' peak lr, scheduled like --lr (warm-up, cosine, the same min ratio)
        cmd += ["--optimizer", "muon", "--muon-lr", str(getattr(args, "muon_lr", MUON_LR) * lr / args.lr)]
    return cmd


def run_one(args, schedule: str, data_prefix: str, tok_model: str, lr: float | None = None, seed: int | None = None,
            compensation: str = "none", optimizer: str = "adamw") -> dict:
    seed = args.seeds[0] if seed is None else seed
    out_dir = (os.path.join(args.out_dir, f"seed_{seed}") if lr is None
               else os.path.join(args.out_dir, f"lr_{lr:g}_seed_{seed}"))
    os.makedirs(out_dir, exist_ok=True)
    tag = schedule if compensation == "none" else f"{schedule}_{compensation}"
    tag = tag if optimizer == "adamw" else f"{optimizer}_{tag}"
    metrics = os.path.join(out_dir, f"metrics_{tag}.jsonl")
    log = os.path.join(out_dir, f"log_{tag}.txt")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = trainer_command(args, schedule, data_prefix, tok_model, metrics, lr, seed, compensation, optimizer)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MEGATRON_2BW_FAULT_KILL_RANK", None)
    busy0, own0 = common.cpu_busy_seconds(), _children_cpu()
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = run_group(cmd, args.timeout, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc is None:
        raise RuntimeError(f"{schedule}: training did not finish within {args.timeout:.0f} s (log: {log})")
    wall = time.time() - t0
    own = _children_cpu() - own0
    busy = common.cpu_busy_seconds() - busy0
    if rc != 0:
        with open(log) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"{schedule}: trainer exited with status {rc} (log: {log}):\n{tail}")
    run = parse_metrics(metrics, args.smooth)
    run_lr = args.lr if lr is None else lr
    run.update(schedule=schedule, seed=seed, lr=args.lr if lr is None else lr, wall_seconds=wall,
               metrics_file=os.path.relpath(metrics, ROOT), log_file=os.path.relpath(log, ROOT),
               foreign_load_cpus=max(0.0, busy - own) / wall if busy > 0 else None, compensation=compensation,
               d=getattr(args, "depth", 2), optimizer=optimizer,
               muon_lr=getattr(args, "muon_lr", MUON_LR) * run_lr / args.lr if optimizer == "muon" else None)
    print(f"{tag} (lr {run['lr']:g}, seed {seed}): {run['steps']} steps, {run['seconds']:.1f} s training ({wall:.1f} s "
          f"wall); final valid loss {common.fmt(run['final_valid_loss'], '.4f')}, smoothed train loss "
          f"{common.fmt(run['final_train_loss'], '.4f')}",
          flush=True)
    return run


def run_group(cmd: list[str], timeout: float, **kw) -> int | None:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (torchrun and its
    workers) and return None, else the exit status."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        return None
    except BaseException:  # Ctrl-C: take the workers down too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def parse_metrics(path: str, window: int) -> dict:
    """Train/eval curves of a metrics file (the last line per (type, iteration, split) wins)."""
    rows: dict[tuple, dict] = {}
    start = end = None
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["type"] == "start":
                start = r
            elif r["type"] == "end":
                end = r
            elif r["type"] in ("train", "eval"):
                rows[r["type"], r["iteration"], r.get("split")] = r
    train = sorted((r for (t, _, _), r in rows.items() if t == "train"), key=lambda r: r["iteration"])
    valid = sorted((r for (t, _, s), r in rows.items() if t == "eval" and s == "valid"), key=lambda r: r["iteration"])
    steps = [r["iteration"] + 1 for r in train]  # completed steps after that train line
    losses = [r["loss"] if r["loss"] is not None else math.nan for r in train]
    elapsed, acc = [], 0.0
    for r in train:
        acc += r["step_time_s"]
        elapsed.append(acc)
    sm = smooth(losses, window)
    t_of_step = dict(zip(steps, elapsed, strict=False))
    return {
        "steps": len(train),
        "seconds": elapsed[-1] if elapsed else None,
        "final_train_loss": sm[-1] if sm else None,
        "final_train_loss_raw": losses[-1] if losses else None,
        "final_valid_loss": valid[-1]["loss"] if valid else None,
        "samples_per_sec_median": common.median(r["samples_per_sec"] for r in train),
        "skipped_steps": sum(1 for r in train if r.get("skipped")),
        "parameters": start.get("parameters") if start else None,
        "global_batch_size": start.get("global_batch_size") if start else None,
        "num_microbatches": start.get("num_microbatches") if start else None,
        "trainer_seconds": end.get("seconds") if end else None,
        "curve": {"step": steps, "seconds": elapsed, "train_loss": losses, "train_loss_smoothed": sm},
        "valid": {"step": [r["iteration"] + 1 for r in valid], "loss": [r["loss"] for r in valid],
                  "seconds": [t_of_step.get(r["iteration"] + 1) for r in valid]},
    }


def time_to_loss(run: dict, target: float) -> dict:
    c = run["curve"]
    for step, sec, loss in zip(c["step"], c["seconds"], c["train_loss_smoothed"], strict=False):
        if loss <= target:
            return {"target": target, "step": step, "seconds": sec}
    return {"target": target, "step": None, "seconds": None}


def sweep_entry(lr: float, min_lr: float, runs: list[dict]) -> dict:
    """One learning rate of the sweep: final losses and the (compact) curves of both schedules."""
    by = {r["schedule"]: r for r in runs}
    v2, vf = (by.get("2bw") or {}).get("final_valid_loss"), (by.get("flush") or {}).get("final_valid_loss")
    return {"lr": lr, "min_lr": min_lr, "valid_loss_ratio_2bw_over_flush": v2 / vf if v2 and vf else None,
            "runs": [{"schedule": r["schedule"], "final_valid_loss": r["final_valid_loss"],
                      "final_train_loss": r["final_train_loss"], "seconds": r["seconds"], "steps": r["steps"],
                      "curve": {"step": r["curve"]["step"], "train_loss_smoothed": r["curve"]["train_loss_smoothed"]},
                      "valid": r["valid"]} for r in runs]}
