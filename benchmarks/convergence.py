"""Convergence on CPU: PipeDream-2BW against PipeDream-Flush (vanilla semantics) at d = 2, equal steps.

Both runs are the real trainer (``pretrain_gpt.py`` under ``torch.distributed.run``, 2 processes,
d = 2, w = 1, one torch thread each) with the same seed, data order, global batch, learning-rate
schedule and model (preset ``gpt-demo`` at sequence length 64, the flags of ``scripts/demo.sh``),
on the demo corpus (the Python documentation; built and cached under ``demo_data/`` exactly as
``scripts/demo.sh`` does). Only ``--pipeline-schedule`` differs. Flush computes every batch on
the newest weights, ``W(t+1) = W(t) - lr * grad f_t(W(t))``; 2BW uses the 1-stale gradient
``grad f_t(W(t-1))``, so the two curves are not identical, and the question is whether 2BW's
validation loss stays within 1% of Flush's after the same number of steps.

The pair runs once per ``--seeds`` value (default two seeds; the seed sets the initialization,
the training data order and which validation sequences are drawn). Each seed's 2BW/Flush ratio
is a paired comparison; the headline ratio is their mean, and the Flush-vs-Flush difference
between seeds is the noise floor a 2BW gap must exceed to mean anything. Defaults (``DEFAULTS``):
global batch 8 (b = 2, m = 4), 500 steps, Adam lr 1e-3 with a linear warm-up over 10% of the
steps (50) and cosine decay to 1e-4, validation every 50 steps over 25 global batches (200
sequences); each run trains for 2-3 min on 2 cores (3-4 min wall). See ``benchmarks/README.md`` and
``docs/benchmarks.md`` for the settings tried before these.

Outputs:

- ``--png``: loss against step and against training wall time; the training loss raw (faint)
  and smoothed (trailing mean over ``--smooth`` steps), the validation loss as markers.
- ``--json``: ``{"runs": [{"schedule", "seed", "final_valid_loss", "final_train_loss", "steps", "seconds",
  "time_to_loss": {"target", "seconds", "step"}, ...}] (every seed's pair), "valid_loss_ratio_2bw_over_flush"
  (mean over seeds), "valid_loss_ratio_per_seed", "flush_seed_spread", "seed_noise" (see ``seed_summary``),
  "lr_sweep", "exploration" (with ``--exploration``), "config", "machine", ...}``.

Definitions:

- ``final_valid_loss``: the last validation evaluation (after the last step, ``--eval-iters``
  global batches of the validation split, forward only on the newest weights); both runs
  evaluate the same samples at the same steps, so the ratio is a paired comparison.
- ``final_train_loss``: the smoothed training loss at the last step.
- ``seconds``: training wall time, the sum of the trainer's ``step_time_s`` over all steps
  (each segment's wall time including its pipeline fill and drain; evaluations, start-up and
  process launch excluded). ``wall_seconds`` is the whole subprocess, launch included.
- ``time_to_loss``: ``target`` = ``--target-factor`` (1.05) x the same seed's Flush final smoothed
  training loss; ``step`` is the first step at which a run's smoothed training loss is <= target and
  ``seconds`` its training wall time up to and including that step (step times inside a logging
  segment are the segment's mean, so resolution is one ``--log-interval``'s mean step time).
  ``null`` when a run never reaches the target.
- ``--sweep-lr LR ...`` repeats the pair (first seed only) at other peak learning rates (min lr scaled alike) and
  adds ``lr_sweep`` (final losses and ratio per learning rate) to the JSON; ``--sweep-png`` plots it.

Timings on a shared 2-core machine are noisy; losses are deterministic up to float reduction
order (gloo, fp32).

``--regimes aggressive paper`` (issue 15) runs the settings of ``REGIMES`` instead of the flags
above: Flush and one 2BW run per ``--compensations`` mode (``--2bw-compensation``) per seed,
``--parallel-runs`` at a time, at pipeline depth ``--depth`` (2BW's rule does not depend on d, so
d = 1 gives the same losses with one process per run). ``--json`` then writes ``{"results":
[{"regime", "schedule", "compensation", "seed", "final_valid_loss", "steps_to_target", ...}],
"regimes": {name: {"runs", "config", "modes", "flush_seed_spread", "measured_speedup"}},
"complete"}``, rewritten after every run. ``steps_to_target``: first step whose smoothed training
loss is at or under the same seed's Flush final smoothed training loss (None: never);
time-to-loss uses the 2BW/Flush throughput ratio measured by ``pipeline_throughput.py``
(``docs/data/throughput.json``, d = 2, nearest m). ``--resume-from`` reuses finished runs (earlier
output, or a single-regime JSON with a regime's settings), ``--merge-only`` runs nothing.

``--optimizers adamw muon`` (issue 24) runs every schedule and mode once per optimizer (``muon``:
``--optimizer muon`` at ``--muon-lr``, default 0.02, scheduled like the regime's lr; ``predict`` is
skipped for it); each run's ratio is against the Flush run of its own optimizer and seed
(``valid_loss_ratio_vs_flush``) and against the best Flush run of any optimizer of that seed
(``valid_loss_ratio_vs_best_flush``); ``modes`` keys are the compensation for AdamW (as before) and
``muon/<compensation>`` for Muon. Runs of older files count as AdamW.
"""

from __future__ import annotations

import argparse
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
    out_dir = os.path.join(args.out_dir, f"seed_{seed}") if lr is None else os.path.join(args.out_dir, f"lr_{lr:g}_seed_{seed}")
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
    run.update(schedule=schedule, seed=seed, lr=args.lr if lr is None else lr, wall_seconds=wall, metrics_file=os.path.relpath(metrics, ROOT), log_file=os.path.relpath(log, ROOT),
               foreign_load_cpus=max(0.0, busy - own) / wall if busy > 0 else None, compensation=compensation,
               d=getattr(args, "depth", 2), optimizer=optimizer,
               muon_lr=getattr(args, "muon_lr", MUON_LR) * run_lr / args.lr if optimizer == "muon" else None)
    print(f"{tag} (lr {run['lr']:g}, seed {seed}): {run['steps']} steps, {run['seconds']:.1f} s training ({wall:.1f} s wall); final valid loss "
          f"{common.fmt(run['final_valid_loss'], '.4f')}, smoothed train loss {common.fmt(run['final_train_loss'], '.4f')}",
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
    t_of_step = dict(zip(steps, elapsed))
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
    for step, sec, loss in zip(c["step"], c["seconds"], c["train_loss_smoothed"]):
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


# ---------------------------------------------------------------------------------------- plot
def plot_sweep(sweep: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.4))
    cmap = plt.get_cmap("viridis")
    lo = []
    for i, e in enumerate(sweep):
        color = cmap(i / max(1, len(sweep) - 1) * 0.85)
        for r in e["runs"]:
            ls = "-" if r["schedule"] == "2bw" else "--"
            ax.plot(r["curve"]["step"], r["curve"]["train_loss_smoothed"], ls, color=color, lw=1.4,
                    label=f"lr {e['lr']:g} {LABELS.get(r['schedule'], r['schedule'])}")
            ax.plot(r["valid"]["step"], r["valid"]["loss"], "o" if r["schedule"] == "2bw" else "s", color=color, ms=4,
                    mfc="none" if r["schedule"] == "flush" else color)
            lo += [x for x in r["curve"]["train_loss_smoothed"] if x == x]
    if lo:
        a, b = min(lo), max(lo)
        ax.set_ylim(a - 0.1 * (b - a) - 0.05, min(b, a + 0.6 * (b - a) + 0.5))
    ax.set_xlabel("training step")
    ax.set_ylabel("LM loss (smoothed train: lines; validation: markers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


COLORS = {"2bw": "tab:blue", "flush": "tab:orange"}
LABELS = {"2bw": "PipeDream-2BW", "flush": "PipeDream-Flush"}


def plot(runs: list[dict], path: str, title: str) -> None:
    """Loss against step (left) and training wall time (right). With several seeds the first
    seed's runs are drawn in full (raw and smoothed training loss, validation markers, time-to-loss
    lines) and every further seed's as a thinner smoothed line with hollow validation markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(dict.fromkeys(r.get("seed") for r in runs))
    styles = ["-", "--", "-.", ":"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, xkey, xlabel in ((axes[0], "step", "training step"), (axes[1], "seconds", "training wall time (s)")):
        for r in runs:
            s, c, v = r["schedule"], r["curve"], r["valid"]
            k = seeds.index(r.get("seed"))
            tag = f"{LABELS.get(s, s)}" + (f" seed {r.get('seed')}" if len(seeds) > 1 else "")
            color = COLORS.get(s)
            if k == 0:
                ax.plot(c[xkey], c["train_loss"], color=color, alpha=0.2, lw=0.8)
            ax.plot(c[xkey], c["train_loss_smoothed"], styles[k % len(styles)], color=color, lw=1.6 if k == 0 else 1.1,
                    label=f"{tag} train (smoothed)")
            vx = [x for x in v[xkey] if x is not None]
            ax.plot(vx, v["loss"][: len(vx)], "o" if k == 0 else "s", ls="--" if k == 0 else "none", color=color, ms=5, lw=1,
                    mfc=color if k == 0 else "none", label=f"{tag} validation")
            t = r.get("time_to_loss") or {}
            if k == 0 and t.get(xkey) is not None:
                ax.axvline(t[xkey], color=color, ls=":", lw=1)
        tgt = (runs[0].get("time_to_loss") or {}).get("target")
        if tgt is not None:
            ax.axhline(tgt, color="gray", ls=":", lw=1, label="time-to-loss target" + (f" (seed {seeds[0]})" if len(seeds) > 1 else ""))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("LM loss (nats/token)")
    all_losses = [x for r in runs for x in r["curve"]["train_loss_smoothed"] if x == x]
    if all_losses:  # hide the first steps' ~9.0 so the end of the curves is readable
        lo, hi = min(all_losses), max(all_losses)
        axes[0].set_ylim(lo - 0.1 * (hi - lo) - 0.05, min(hi, lo + 0.6 * (hi - lo) + 0.5))
    fig.suptitle(title, fontsize=10)
    if len(seeds) > 1:  # many entries: one legend under both panels, clear of the curves
        handles, labels = axes[1].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3, frameon=False)
        fig.set_size_inches(11, 5.4)
        fig.tight_layout(rect=(0, 0.14, 1, 1))
    else:
        axes[1].legend(fontsize=8, loc="upper right")
        fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------- seeds
def seed_summary(runs: list[dict]) -> dict:
    """Per-seed paired ratios and the seed-to-seed noise floor of the final validation loss.

    - ``per_seed``: ``[{"seed", "final_valid_loss": {schedule: loss}, "valid_loss_ratio_2bw_over_flush"}]``; each
      ratio is paired (both schedules of a seed see the same initialization, data order and validation samples).
    - ``valid_loss_ratio_mean``: mean of the per-seed ratios (the headline number).
    - ``flush_seed_spread``: (max - min) / mean of Flush's final validation losses over the seeds, i.e.
      ``|flush(s1) - flush(s2)| / flush`` for two seeds: how much the loss moves when only the seed changes
      (initialization, data order, which validation sequences are drawn). ``2bw_seed_spread`` likewise.
    - ``ratio_spread``: max - min of the per-seed ratios.
    - ``gap_above_noise``: ``mean ratio - 1 > flush_seed_spread`` (None with one seed).
    """
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    per_seed = []
    for sd in seeds:
        fin = {r["schedule"]: r["final_valid_loss"] for r in runs if r["seed"] == sd}
        v2, vf = fin.get("2bw"), fin.get("flush")
        per_seed.append({"seed": sd, "final_valid_loss": fin,
                         "valid_loss_ratio_2bw_over_flush": v2 / vf if v2 and vf else None})
    ratios = [e["valid_loss_ratio_2bw_over_flush"] for e in per_seed if e["valid_loss_ratio_2bw_over_flush"] is not None]

    def spread(schedule):
        xs = [e["final_valid_loss"].get(schedule) for e in per_seed]
        xs = [x for x in xs if x]
        return (max(xs) - min(xs)) / (sum(xs) / len(xs)) if len(xs) > 1 else None

    def mean_of(schedule):
        xs = [e["final_valid_loss"].get(schedule) for e in per_seed if e["final_valid_loss"].get(schedule)]
        return sum(xs) / len(xs) if xs else None

    mean_ratio = sum(ratios) / len(ratios) if ratios else None
    fs = spread("flush")
    return {
        "seeds": seeds,
        "per_seed": per_seed,
        "valid_loss_ratio_mean": mean_ratio,
        "ratio_spread": max(ratios) - min(ratios) if len(ratios) > 1 else None,
        "mean_final_valid_loss": {s: mean_of(s) for s in SCHEDULES if mean_of(s) is not None},
        "flush_seed_spread": fs,
        "2bw_seed_spread": spread("2bw"),
        "gap_above_noise": (mean_ratio - 1 > fs) if mean_ratio is not None and fs is not None else None,
    }


# ---------------------------------------------------------------------------------------- main
DEFAULTS = dict(iters=500, warmup=50, lr=1e-3, min_lr=1e-4, micro_batch=2, m=4, eval_iters=25, eval_interval=50)
# The two regimes of ``--regimes`` (issue 15). aggressive: the single-regime defaults above (small
# global batch, high lr). paper: the paper's recipe scaled to a shared 2-core machine -- twice the
# global batch through twice the microbatches, linear warm-up over 10% of the steps, peak lr 3e-4
# (the top of the paper's 1e-4..3e-4 range), cosine decay to 10%.
REGIMES = {
    "aggressive": dict(DEFAULTS, log_interval=50),
    "paper": dict(iters=300, warmup=30, lr=3e-4, min_lr=3e-5, micro_batch=2, m=8, eval_iters=12, eval_interval=50,
                  log_interval=50),
}
THROUGHPUT_JSON = os.path.join(ROOT, "docs", "data", "throughput.json")


def measured_speedup(m: int, path: str = THROUGHPUT_JSON) -> dict:
    """2BW / Flush samples per second at d = 2 from the throughput benchmark, at the nearest measured m."""
    try:
        with open(path) as f:
            rows = json.load(f)["results"]
    except (OSError, ValueError, KeyError):
        return {"ratio": None, "m": None, "source": None}
    by = {(r["system"], r["m"]): r["samples_per_sec"] for r in rows if r.get("d") == 2 and r["system"] in SCHEDULES}
    ms = sorted({k[1] for k in by if ("2bw", k[1]) in by and ("flush", k[1]) in by})
    if not ms:
        return {"ratio": None, "m": None, "source": None}
    near = min(ms, key=lambda x: (abs(x - m), x))
    return {"ratio": by["2bw", near] / by["flush", near], "m": near, "source": os.path.relpath(path, ROOT)}


def steps_to_target(run: dict, target: float) -> int | None:
    """First step whose smoothed training loss is <= ``target`` (None: never)."""
    c = run["curve"]
    return next((st for st, loss in zip(c["step"], c["train_loss_smoothed"]) if loss <= target), None)


def regime_args(args, name: str):
    """``args`` with the regime's settings; ``--max-iters`` shortens it (warm-up, intervals scaled alike)."""
    r = argparse.Namespace(**vars(args))
    for k, v in REGIMES[name].items():
        setattr(r, k, v)
    if args.max_iters and args.max_iters < r.iters:
        f = args.max_iters / r.iters
        r.iters, r.warmup = args.max_iters, max(1, round(r.warmup * f))
        r.eval_interval = r.log_interval = max(1, round(r.eval_interval * f))
    r.out_dir = os.path.join(args.out_dir, name)
    return r


def summarize_regime(ra, name: str, runs: list[dict]) -> dict:
    """Result rows and per-mode summary of the finished runs of regime ``name`` (partial runs allowed)."""
    speed = measured_speedup(ra.m)
    results = []
    for r in runs:
        r.setdefault("optimizer", "adamw")
    best_flush = {}  # per seed: the lowest Flush final validation loss of any optimizer
    for r in runs:
        if r["schedule"] == "flush" and r["final_valid_loss"] is not None:
            best_flush[r["seed"]] = min(best_flush.get(r["seed"], math.inf), r["final_valid_loss"])
    for r in runs:
        flush = next((x for x in runs if x["seed"] == r["seed"] and x["schedule"] == "flush"
                      and x["optimizer"] == r["optimizer"]), None)
        target = flush["final_train_loss"] if flush else None
        st = steps_to_target(r, target) if flush else None
        st_f = steps_to_target(flush, target) if flush else None
        ttl = None
        if r["schedule"] == "2bw" and st is not None and st_f and speed["ratio"]:
            ttl = (st / st_f) / speed["ratio"]  # 2BW's time to Flush's final loss, in units of Flush's
        # the other way round: when Flush first reached this run's final loss, and the wall-time ratio there
        back = steps_to_target(flush, r["final_train_loss"]) if flush and r["schedule"] == "2bw" else None
        back_t = (r["steps"] / back) / speed["ratio"] if back and speed["ratio"] else None
        best = best_flush.get(r["seed"])
        r.update(regime=name, steps_to_target=st, target_train_loss=target, time_to_target_vs_flush=ttl,
                 valid_loss_ratio_vs_flush=r["final_valid_loss"] / flush["final_valid_loss"] if flush else None,
                 valid_loss_ratio_vs_best_flush=r["final_valid_loss"] / best if best else None,
                 flush_steps_to_this_loss=back, time_vs_flush_at_this_loss=back_t)
        results.append({k: r.get(k) for k in ("regime", "optimizer", "schedule", "compensation", "seed", "final_valid_loss",
                                               "valid_loss_ratio_vs_best_flush", "muon_lr",
                                               "steps_to_target", "final_train_loss", "valid_loss_ratio_vs_flush",
                                               "time_to_target_vs_flush", "flush_steps_to_this_loss",
                                               "time_vs_flush_at_this_loss", "steps", "seconds", "d", "reused_from")})
    spreads = {}  # per optimizer: Flush's seed-to-seed spread (another optimizer's Flush is no seed noise)
    for opt in dict.fromkeys(r["optimizer"] for r in runs):
        flush_v = [r["final_valid_loss"] for r in runs if r["schedule"] == "flush" and r["optimizer"] == opt]
        spreads[opt] = (max(flush_v) - min(flush_v)) / (sum(flush_v) / len(flush_v)) if len(flush_v) > 1 else None
    spread = spreads.get("adamw")
    modes = {}
    for opt in getattr(ra, "optimizers", ["adamw"]):
        for c in ra.compensations:
            rs = sorted((r for r in runs if r["schedule"] == "2bw" and r["compensation"] == c and r["optimizer"] == opt
                         and r["valid_loss_ratio_vs_flush"] is not None), key=lambda r: r["seed"])
            if not rs:
                continue
            ratios = [r["valid_loss_ratio_vs_flush"] for r in rs]
            best = [r["valid_loss_ratio_vs_best_flush"] for r in rs]
            # adamw keeps the mode's bare name (the older files' key); another optimizer's is "optimizer/mode"
            modes[c if opt == "adamw" else f"{opt}/{c}"] = {
                "optimizer": opt, "compensation": c, "seeds": [r["seed"] for r in rs],
                "valid_loss_ratio_per_seed": ratios,
                "valid_loss_ratio_mean": sum(ratios) / len(ratios) if ratios else None,
                "valid_loss_ratio_vs_best_flush_per_seed": best,
                "valid_loss_ratio_vs_best_flush_mean": sum(best) / len(best) if best else None,
                "steps_to_target_per_seed": [r["steps_to_target"] for r in rs],
                "time_to_target_vs_flush_per_seed": [r["time_to_target_vs_flush"] for r in rs]}
    gb = ra.micro_batch * ra.m
    config = dict(preset=ra.preset, seq=ra.seq, d=sorted({r.get("d", ra.depth) for r in runs}) or [ra.depth], w=1, micro_batch=ra.micro_batch, m=ra.m, global_batch=gb,
                  iters=ra.iters, warmup=ra.warmup, lr=ra.lr, min_lr=ra.min_lr, lr_decay="cosine", weight_decay=0.01,
                  clip_grad=1.0, optimizer="adam (betas 0.9, 0.999)", precision="fp32", eval_interval=ra.eval_interval,
                  optimizers=getattr(ra, "optimizers", ["adamw"]),
                  muon="torch.optim.Muon's rule (momentum 0.95, Nesterov, 5 Newton-Schulz steps, shape scale "
                       "'original') on the linear weights at --muon-lr, AdamW as above on the rest",
                  muon_lr=getattr(ra, "muon_lr", MUON_LR),
                  eval_iters=ra.eval_iters, valid_sequences=ra.eval_iters * gb, seeds=ra.seeds, smooth_window=ra.smooth,
                  dc_lambda=ra.dc_lambda, compensations=ra.compensations)
    return {"results": results, "runs": sorted(runs, key=lambda r: (r["seed"], r["schedule"] != "flush", r["compensation"])),
            "config": config, "flush_seed_spread": spread, "flush_seed_spread_by_optimizer": spreads, "modes": modes,
            "measured_speedup": speed}


REGIME_KEYS = ("preset", "seq", "micro_batch", "m", "iters", "warmup", "lr", "min_lr", "eval_iters", "eval_interval")


def reused_runs(paths: list[str], ras: dict) -> dict[str, list[dict]]:
    """Finished runs to reuse, by regime: from earlier ``--regimes`` JSONs, or from a single-regime JSON
    (``runs`` + ``config``) whose settings equal a regime's (its runs are plain 2BW and Flush). A run
    matching no regime's settings, or already taken from an earlier file, is left out."""
    done: dict[str, list[dict]] = {name: [] for name in ras}
    seen = set()

    def take(name: str, r: dict, source: str, d) -> None:
        key = (name, r["seed"], r["schedule"], r.get("compensation", "none"), r.get("optimizer", "adamw"))
        if name in done and key not in seen:
            seen.add(key)
            done[name].append(dict(r, compensation=r.get("compensation", "none"), optimizer=r.get("optimizer", "adamw"),
                                   reused_from=r.get("reused_from") or source))
            d = d[0] if isinstance(d, list) and len(d) == 1 else d
            done[name][-1].setdefault("d", d)

    for path in paths:
        with open(path) as f:
            data = json.load(f)
        src = os.path.relpath(path, ROOT)
        for name, reg in (data.get("regimes") or {}).items():
            for r in reg["runs"]:
                take(name, r, src, reg["config"].get("d"))
        cfg = data.get("config") if "regimes" not in data else None
        for name, ra in ras.items():
            if cfg and all(cfg.get(k) == getattr(ra, k) for k in REGIME_KEYS):
                for r in data.get("runs") or []:
                    take(name, r, src, cfg.get("d"))
    return done


def main_regimes(args) -> int:
    """``--regimes``: every regime, Flush and each 2BW compensation mode, every seed; one JSON, rewritten
    after every finished run (seed by seed, so a partial file holds complete pairs first)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    machine = common.machine_info()
    t0 = time.time()
    data_dir = args.data_dir or os.path.join(ROOT, "demo_data")
    data_prefix, tok_model = ensure_data(data_dir, args.vocab or 8000, args.corpus_mb or 4)
    ras = {name: regime_args(args, name) for name in args.regimes}
    opts = args.optimizers
    jobs = [(name, sd, "flush", "none", o) for sd in args.seeds for name in args.regimes for o in opts
            if "flush" in args.schedules]
    jobs += [(name, sd, "2bw", c, o) for sd in args.seeds for name in args.regimes for o in opts for c in args.compensations
             if (c not in args.first_seed_only or sd == args.seeds[0]) and not (o == "muon" and c == "predict")
             and "2bw" in args.schedules]
    # seed by seed (each seed's Flush first), the first-seed-only modes last
    jobs.sort(key=lambda j: (j[3] in args.first_seed_only, args.seeds.index(j[1])))
    done = reused_runs(args.resume_from or [], ras)
    have = {(n, r["seed"], r["schedule"], r["compensation"], r["optimizer"]) for n, runs in done.items() for r in runs}
    jobs = [j for j in jobs if j not in have]
    missing = len(jobs) if args.merge_only else 0
    if args.merge_only:
        print(f"--merge-only: {missing} planned run(s) missing, not run", flush=True)
        jobs = []

    def write(complete: bool) -> dict:
        out = {"results": [], "regimes": {}, "machine": machine, "complete": complete}
        for name, runs in done.items():
            reg = summarize_regime(ras[name], name, runs)
            out["results"] += reg.pop("results")
            out["regimes"][name] = reg
        machine["elapsed_s"] = round(time.time() - t0, 1)
        common.write_json(args.json, out)  # rewritten after every run: a partial file survives an interruption
        return out

    with ThreadPoolExecutor(max_workers=max(1, args.parallel_runs)) as pool:
        futs = {pool.submit(run_one, ras[n], sch, data_prefix, tok_model, None, sd, c, o): n for n, sd, sch, c, o in jobs}
        for fut in as_completed(futs):
            done[futs[fut]].append(fut.result())
            write(False)
    out = write(missing == 0)
    for name, reg in out["regimes"].items():
        flushes = {(r["optimizer"], r["seed"]): round(r["final_valid_loss"], 4) for r in reg["runs"] if r["schedule"] == "flush"}
        print(f"\n{name}: Flush final valid loss by (optimizer, seed) {flushes}")
        print(f"{name}: Flush seed spread {common.fmt(reg['flush_seed_spread'], '.4f')}; speedup 2BW/Flush "
              f"{common.fmt(reg['measured_speedup']['ratio'], '.3f')} (m={reg['measured_speedup']['m']})")
        for c, mo in reg["modes"].items():
            print(f"  2bw {c:8s} valid ratio per seed {[round(x, 4) for x in mo['valid_loss_ratio_per_seed']]} mean "
                  f"{common.fmt(mo['valid_loss_ratio_mean'], '.4f')} (vs the best Flush: "
                  f"{common.fmt(mo.get('valid_loss_ratio_vs_best_flush_mean'), '.4f')}); steps to Flush's final loss "
                  f"{mo['steps_to_target_per_seed']}", flush=True)
    if args.png:
        plot_regimes(out, args.png)
    return 0


MODE_STYLE = {("flush", "none"): ("tab:orange", "PipeDream-Flush"), ("2bw", "none"): ("tab:blue", "2BW"),
              ("2bw", "predict"): ("tab:green", "2BW + predict"), ("2bw", "dc"): ("tab:red", "2BW + dc"),
              ("2bw", "ef"): ("tab:purple", "2BW + ef"), ("2bw", "extrapolate"): ("tab:brown", "2BW + extrapolate")}


def plot_regimes(data: dict, path: str) -> None:
    """One panel per regime: smoothed training loss per (schedule, compensation), seeds as line styles;
    validation losses as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regs = data["regimes"]
    fig, axes = plt.subplots(1, len(regs), figsize=(6 * len(regs), 4.6), squeeze=False)
    for ax, (name, reg) in zip(axes[0], regs.items()):
        seeds = list(dict.fromkeys(r["seed"] for r in reg["runs"]))
        lo = []
        for r in sorted(reg["runs"], key=lambda r: r["compensation"] == "dc"):  # dc (often on plain 2BW's) on top
            color, label = MODE_STYLE.get((r["schedule"], r["compensation"]), ("gray", r["schedule"]))
            if r.get("optimizer", "adamw") != "adamw":
                label = f"{r['optimizer']} {label}"
            k = seeds.index(r["seed"])
            c = r["curve"]
            dotted = r["compensation"] == "dc"  # dotted: visible where it lies on plain 2BW's curve
            muon = r.get("optimizer") == "muon"  # Muon: dash-dotted lines
            ax.plot(c["step"], c["train_loss_smoothed"], "-." if muon else (":" if dotted else "-") if k == 0 else "--", color=color,
                    lw=2.0 if dotted else 1.3, label=f"{label} seed {r['seed']}" + (f" (d={r['d']})" if r.get("d") else ""))
            ax.plot(r["valid"]["step"], r["valid"]["loss"], "o" if k == 0 else "s", color=color, ms=3.5,
                    mfc=color if k == 0 else "none")
            lo += [x for x in c["train_loss_smoothed"] if x == x]
        if lo:
            a, b = min(lo), max(lo)
            ax.set_ylim(a - 0.05 * (b - a) - 0.05, min(b, a + 0.5 * (b - a) + 0.5))
        cfg = reg["config"]
        ax.set_title(f"{name}: global batch {cfg['global_batch']} (b={cfg['micro_batch']}, m={cfg['m']}), "
                     f"lr {cfg['lr']:g}, warm-up {cfg['warmup']}, {cfg['iters']} steps", fontsize=8.5)
        ax.set_xlabel("training step")
        ax.set_ylabel("LM loss (smoothed train: lines; validation: markers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"], help="training steps of each run")
    p.add_argument("--eval-interval", type=int, default=DEFAULTS["eval_interval"])
    p.add_argument("--eval-iters", type=int, default=DEFAULTS["eval_iters"],
                   help="global batches per validation evaluation (x global batch = validation sequences)")
    p.add_argument("--log-interval", type=int, default=50, help="segment length (2BW drains only at segment ends)")
    p.add_argument("--micro-batch", type=int, default=DEFAULTS["micro_batch"], help="b")
    p.add_argument("--m", type=int, default=DEFAULTS["m"], help="microbatches per step (>= d = 2); global batch = b * m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--preset", default="gpt-demo")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--min-lr", type=float, default=DEFAULTS["min_lr"])
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="linear warm-up steps (default 10%% of --iters)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 5678],
                   help="run both schedules once per seed (initialization, data order and validation draw); the spread "
                        "of Flush over the seeds is the noise floor of the comparison")
    p.add_argument("--seed", type=int, default=None, help="shorthand for --seeds SEED (one seed, no noise floor)")
    p.add_argument("--smooth", type=int, default=20, help="training-loss smoothing window (steps)")
    p.add_argument("--target-factor", type=float, default=1.05, help="time-to-loss target = this x Flush's final smoothed train loss")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--data-dir", default=None, help="cached corpus/tokenizer/dataset (default demo_data, quick: demo_data/quick)")
    p.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (default 8000, quick: 500)")
    p.add_argument("--corpus-mb", type=float, default=None, help="corpus size when it is built (default 4, quick: 0.3)")
    p.add_argument("--out-dir", default=None, help="metrics files and logs (default runs/convergence[_quick])")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run before it is killed")
    p.add_argument("--sweep-lr", type=float, nargs="*", default=[], metavar="LR",
                   help="also run both schedules at these peak learning rates (min lr scaled alike; first seed only): "
                        "a sensitivity table")
    p.add_argument("--sweep-png", help="write the learning-rate sweep's curves here (with --sweep-lr)")
    p.add_argument("--exploration", metavar="FILE",
                   help="a JSON list of earlier measured settings (see docs/data/convergence.json's 'exploration') "
                        "copied into the output JSON so the report can show how the defaults were chosen")
    p.add_argument("--quick", action="store_true", help="tiny model, 10 steps, small corpus: a smoke run (~30 s per seed)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write the loss curves here")
    p.add_argument("--regimes", nargs="+", choices=tuple(REGIMES), default=None,
                   help="run these regimes' settings (REGIMES) instead of the flags above, every --compensations mode, "
                        "and write {'results': [...], 'regimes': {...}} (see main_regimes)")
    p.add_argument("--optimizers", nargs="+", choices=("adamw", "muon"), default=["adamw"],
                   help="--regimes: optimizers to run (muon: --optimizer muon, Muon on the linear weights at --muon-lr; "
                        "its Flush run is its own reference; predict is AdamW/SGD only and skipped for muon)")
    p.add_argument("--muon-lr", type=float, default=MUON_LR, help="--regimes: peak lr of Muon's matrices")
    p.add_argument("--compensations", nargs="+", choices=("none", "predict", "dc", "ef", "extrapolate"), default=["none"],
                   help="2BW's --2bw-compensation modes to run (one 2BW run per mode and seed)")
    p.add_argument("--dc-lambda", type=float, default=0.04, help="--2bw-dc-lambda of the dc runs")
    p.add_argument("--depth", type=int, default=2, help="pipeline depth d (2BW's update rule does not depend on it)")
    p.add_argument("--parallel-runs", type=int, default=1, help="--regimes: trainer runs at a time")
    p.add_argument("--max-iters", type=int, default=None, help="--regimes: cap each regime's steps (a short check)")
    p.add_argument("--resume-from", nargs="*", default=[], metavar="FILE",
                   help="--regimes: reuse the finished runs of these JSONs (earlier --regimes output, or a single-regime "
                        "JSON whose settings equal a regime's) and run only what is missing")
    p.add_argument("--merge-only", action="store_true",
                   help="--regimes: run nothing; write the JSON (and plot) from the --resume-from runs")
    p.add_argument("--first-seed-only", nargs="*", default=[], metavar="MODE",
                   help="--regimes: run these compensation modes on the first seed only, after everything else")
    args = p.parse_args(argv)
    if args.regimes:
        args.seeds = [args.seed] if args.seed is not None else list(dict.fromkeys(args.seeds))
        args.model_flags = []
        args.out_dir = common.out_dir(args.out_dir, "convergence") if args.out_dir else \
            os.path.join(ROOT, "runs", "convergence_regimes")
        return main_regimes(args)
    if args.seed is not None:
        args.seeds = [args.seed]
    args.seeds = list(dict.fromkeys(args.seeds))
    args.model_flags = []
    if args.quick:
        args.iters, args.eval_interval, args.eval_iters, args.log_interval = 10, 5, 2, 5
        args.seq, args.micro_batch, args.m, args.smooth, args.warmup = 32, 2, 2, 3, 2
        args.lr, args.min_lr = 2e-3, 2e-4
        args.preset = "gpt-tiny"
        args.model_flags = ["--max-position-embeddings", str(args.seq)]
        args.timeout = min(args.timeout, 120.0)
    data_dir = args.data_dir or os.path.join(ROOT, "demo_data", "quick" if args.quick else "")
    vocab = args.vocab or (500 if args.quick else 8000)
    corpus_mb = args.corpus_mb or (0.3 if args.quick else 4)
    args.out_dir = common.out_dir(args.out_dir, "convergence") if args.out_dir else \
        os.path.join(ROOT, "runs", "convergence_quick" if args.quick else "convergence")
    if args.m < 2:
        p.error("2BW needs m >= d = 2")
    if "flush" not in args.schedules:
        p.error("the comparison needs the flush run (it defines the target)")
    exploration = None
    if args.exploration:
        with open(args.exploration) as f:
            exploration = json.load(f)

    machine = common.machine_info()
    t0 = time.time()
    data_prefix, tok_model = ensure_data(data_dir, vocab, corpus_mb)
    data_s = time.time() - t0
    runs = [run_one(args, s, data_prefix, tok_model, seed=sd) for sd in args.seeds for s in args.schedules]
    for sd in args.seeds:  # the time-to-loss target is per seed: Flush's own final smoothed training loss
        pair = [r for r in runs if r["seed"] == sd]
        target = args.target_factor * next(r for r in pair if r["schedule"] == "flush")["final_train_loss"]
        for r in pair:
            r["time_to_loss"] = time_to_loss(r, target)
    noise = seed_summary(runs)
    ratio = noise["valid_loss_ratio_mean"]

    def mean_ratio(num_of, den_of):  # mean over seeds of num(2bw)/num(flush) style ratios
        xs = []
        for sd in args.seeds:
            by = {r["schedule"]: r for r in runs if r["seed"] == sd}
            a, b = num_of(by), den_of(by)
            if a and b:
                xs.append(a / b)
        return sum(xs) / len(xs) if xs else None

    speed = mean_ratio(lambda by: by["flush"]["seconds"], lambda by: (by.get("2bw") or {}).get("seconds"))
    ttl = mean_ratio(lambda by: by["flush"]["time_to_loss"]["seconds"],
                     lambda by: ((by.get("2bw") or {}).get("time_to_loss") or {}).get("seconds"))
    first = [r for r in runs if r["seed"] == args.seeds[0]]
    sweep = [sweep_entry(args.lr, args.min_lr, first)]
    for lr in args.sweep_lr:
        if lr == args.lr:
            continue
        pair = [run_one(args, sched, data_prefix, tok_model, lr) for sched in args.schedules]
        sweep.append(sweep_entry(lr, args.min_lr * lr / args.lr, pair))
    sweep.sort(key=lambda e: e["lr"])
    machine["elapsed_s"] = round(time.time() - t0, 1)

    cols = [("schedule", "schedule", ""), ("seed", "seed", ""), ("steps", "steps", ""), ("final_valid_loss", "valid loss", ".4f"),
            ("final_train_loss", "train loss (sm)", ".4f"), ("seconds", "train s", ".1f"), ("wall_seconds", "wall s", ".1f"),
            ("samples_per_sec_median", "samples/s", ".2f"), ("ttl_step", "ttl step", ""), ("ttl_s", "ttl s", ".1f"),
            ("foreign_load_cpus", "other load", ".2f")]
    show = [dict(r, ttl_step=r["time_to_loss"]["step"], ttl_s=r["time_to_loss"]["seconds"]) for r in runs]
    gb = args.micro_batch * args.m
    print()
    print(f"{args.preset}, seq {args.seq}, d=2 w=1, b={args.micro_batch} m={args.m} (global batch {gb}), {args.iters} steps, "
          f"warm-up {args.warmup}, lr {args.lr:g} -> {args.min_lr:g}; validation {args.eval_iters * gb} sequences; "
          f"seeds {args.seeds}")
    print(common.table(show, cols))
    print(common.table([dict(seed=e["seed"], v2=e["final_valid_loss"].get("2bw"), vf=e["final_valid_loss"].get("flush"),
                             ratio=e["valid_loss_ratio_2bw_over_flush"]) for e in noise["per_seed"]],
                       [("seed", "seed", ""), ("v2", "2BW valid", ".4f"), ("vf", "Flush valid", ".4f"), ("ratio", "2BW/Flush", ".4f")]))
    print(f"valid loss ratio 2BW / Flush, mean over seeds: {common.fmt(ratio, '.4f')} (target <= 1.01); Flush seed-to-seed "
          f"spread {common.fmt(noise['flush_seed_spread'], '.4f')}; 2BW gap above noise: {noise['gap_above_noise']}; "
          f"training-time speedup Flush/2BW: {common.fmt(speed, '.3f')}")
    if len(sweep) > 1:
        print(f"\nlearning-rate sweep (final valid loss, seed {args.seeds[0]}):")
        print(common.table([dict(lr=e["lr"], **{f"v_{r['schedule']}": r["final_valid_loss"] for r in e["runs"]},
                                 ratio=e["valid_loss_ratio_2bw_over_flush"]) for e in sweep],
                           [("lr", "peak lr", "g"), ("v_2bw", "2BW", ".4f"), ("v_flush", "Flush", ".4f"), ("ratio", "2BW/Flush", ".4f")]))
        if args.sweep_png:
            plot_sweep(sweep, args.sweep_png, f"{args.preset} (seq {args.seq}), d=2, b={args.micro_batch}, m={args.m}, "
                                              f"{args.iters} steps, seed {args.seeds[0]}: smoothed training loss per peak learning rate")
    title = (f"{args.preset} (seq {args.seq}), d=2, b={args.micro_batch}, m={args.m}, {args.iters} steps, "
             f"{len(args.seeds)} seed(s) on {machine['cpus_usable']} CPUs; valid loss 2BW/Flush = {common.fmt(ratio, '.4f')}")
    if args.png:
        plot(runs, args.png, title)
    out = {
        "runs": runs,
        "valid_loss_ratio_2bw_over_flush": ratio,
        "valid_loss_ratio_per_seed": [e["valid_loss_ratio_2bw_over_flush"] for e in noise["per_seed"]],
        "seed_noise": noise,
        "flush_seed_spread": noise["flush_seed_spread"],
        "lr_sweep": sweep,
        "valid_loss_target_ratio": 1.01,
        "valid_loss_within_target": (ratio <= 1.01) if ratio is not None else None,
        "train_time_speedup_2bw_vs_flush": speed,
        "time_to_loss_speedup_2bw_vs_flush": ttl,
        "machine": machine,
        "config": dict(preset=args.preset, seq=args.seq, d=2, w=1, micro_batch=args.micro_batch, m=args.m,
                       global_batch=gb, iters=args.iters, eval_interval=args.eval_interval,
                       eval_iters=args.eval_iters, valid_sequences=args.eval_iters * gb, log_interval=args.log_interval,
                       lr=args.lr, min_lr=args.min_lr, lr_decay="cosine", warmup=args.warmup, weight_decay=0.01,
                       clip_grad=1.0, seed=args.seeds[0], seeds=args.seeds, optimizer="adam (betas 0.9, 0.999)",
                       precision="fp32", smooth_window=args.smooth, target_factor=args.target_factor,
                       target_definition="target_factor x flush final smoothed training loss of the same seed; first step "
                                         "whose smoothed training loss <= target",
                       ratio_definition="mean over seeds of (2BW final valid loss / Flush final valid loss of the same seed)",
                       seconds_definition="sum of step_time_s (segment wall time incl. fill/drain; evals excluded)",
                       data=os.path.relpath(data_prefix, ROOT), vocab=vocab, data_prep_s=round(data_s, 1),
                       quick=args.quick),
    }
    if exploration is not None:
        out["exploration"] = exploration
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
