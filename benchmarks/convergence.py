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
import os
import sys
import time

import common
from convergence_plots import plot, plot_sweep
from convergence_regimes import DEFAULTS, REGIMES, main_regimes
from convergence_runs import MUON_LR, ROOT, SCHEDULES, ensure_data, run_one, sweep_entry, time_to_loss


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
    ratios = [e["valid_loss_ratio_2bw_over_flush"] for e in per_seed
              if e["valid_loss_ratio_2bw_over_flush"] is not None]

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"], help="training steps of each run")
    p.add_argument("--eval-interval", type=int, default=DEFAULTS["eval_interval"])
    p.add_argument("--eval-iters", type=int, default=DEFAULTS["eval_iters"],
                   help="global batches per validation evaluation (x global batch = validation sequences)")
    p.add_argument("--log-interval", type=int, default=50, help="segment length (2BW drains only at segment ends)")
    p.add_argument("--micro-batch", type=int, default=DEFAULTS["micro_batch"], help="b")
    p.add_argument("--m", type=int, default=DEFAULTS["m"], help="microbatches per step (>= d = 2); global batch = b * "
                                                                "m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--preset", default="gpt-demo")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--min-lr", type=float, default=DEFAULTS["min_lr"])
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="linear warm-up steps (default 10%% of "
                                                                          "--iters)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 5678],
                   help="run both schedules once per seed (initialization, data order and validation draw); the spread "
                        "of Flush over the seeds is the noise floor of the comparison")
    p.add_argument("--seed", type=int, default=None, help="shorthand for --seeds SEED (one seed, no noise floor)")
    p.add_argument("--smooth", type=int, default=20, help="training-loss smoothing window (steps)")
    p.add_argument("--target-factor", type=float, default=1.05, help="time-to-loss target = this x Flush's final "
                                                                     "smoothed train loss")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--data-dir", default=None, help="cached corpus/tokenizer/dataset (default demo_data, quick: "
                                                    "demo_data/quick)")
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
    p.add_argument("--quick", action="store_true", help="tiny model, 10 steps, small corpus: a smoke run (~30 s per "
                                                        "seed)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write the loss curves here")
    _add_regime_flags(p)
    return p


def _add_regime_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``--regimes`` (:func:`convergence_regimes.main_regimes`)."""
    p.add_argument("--regimes", nargs="+", choices=tuple(REGIMES), default=None,
                   help="run these regimes' settings (REGIMES) instead of the flags above, every --compensations mode, "
                        "and write {'results': [...], 'regimes': {...}} (see main_regimes)")
    p.add_argument("--optimizers", nargs="+", choices=("adamw", "muon"), default=["adamw"],
                   help="--regimes: optimizers to run (muon: --optimizer muon, Muon on the linear weights at "
                        "--muon-lr; its Flush run is its own reference; predict is AdamW/SGD only and skipped for "
                        "muon)")
    p.add_argument("--muon-lr", type=float, default=MUON_LR, help="--regimes: peak lr of Muon's matrices")
    p.add_argument("--compensations", nargs="+", choices=("none", "predict", "dc", "ef", "extrapolate"),
                   default=["none"],
                   help="2BW's --2bw-compensation modes to run (one 2BW run per mode and seed)")
    p.add_argument("--dc-lambda", type=float, default=0.04, help="--2bw-dc-lambda of the dc runs")
    p.add_argument("--depth", type=int, default=2, help="pipeline depth d (2BW's update rule does not depend on it)")
    p.add_argument("--parallel-runs", type=int, default=1, help="--regimes: trainer runs at a time")
    p.add_argument("--max-iters", type=int, default=None, help="--regimes: cap each regime's steps (a short check)")
    p.add_argument("--resume-from", nargs="*", default=[], metavar="FILE",
                   help="--regimes: reuse the finished runs of these JSONs (earlier --regimes output, or a "
                        "single-regime JSON whose settings equal a regime's) and run only what is missing")
    p.add_argument("--merge-only", action="store_true",
                   help="--regimes: run nothing; write the JSON (and plot) from the --resume-from runs")
    p.add_argument("--first-seed-only", nargs="*", default=[], metavar="MODE",
                   help="--regimes: run these compensation modes on the first seed only, after everything else")


def _settle(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[str, int, float, list | None]:
    """The single-regime run's settings (``--quick``'s included): (data dir, vocabulary, corpus MB, the
    exploration list to copy)."""
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
    return data_dir, vocab, corpus_mb, exploration


def _mean_ratio(args: argparse.Namespace, runs: list[dict], num_of, den_of) -> float | None:
    """Mean over seeds of num(2bw)/num(flush) style ratios."""
    xs = []
    for sd in args.seeds:
        by = {r["schedule"]: r for r in runs if r["seed"] == sd}
        a, b = num_of(by), den_of(by)
        if a and b:
            xs.append(a / b)
    return sum(xs) / len(xs) if xs else None


def _train(args: argparse.Namespace, data_dir: str, vocab: int, corpus_mb: float) -> dict:
    """Both schedules per seed, the time-to-loss targets, the seed noise and the learning-rate sweep."""
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
    speed = _mean_ratio(args, runs, lambda by: by["flush"]["seconds"], lambda by: (by.get("2bw") or {}).get("seconds"))
    ttl = _mean_ratio(args, runs, lambda by: by["flush"]["time_to_loss"]["seconds"],
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
    return dict(machine=machine, data_prefix=data_prefix, data_s=data_s, runs=runs, noise=noise, ratio=ratio,
                speed=speed, ttl=ttl, sweep=sweep)


def _print(args: argparse.Namespace, runs: list[dict], noise: dict, ratio, speed, sweep: list[dict],
           machine: dict) -> None:
    """The tables on stdout and the plots."""
    cols = [("schedule", "schedule", ""), ("seed", "seed", ""), ("steps", "steps", ""),
            ("final_valid_loss", "valid loss", ".4f"), ("final_train_loss", "train loss (sm)", ".4f"),
            ("seconds", "train s", ".1f"), ("wall_seconds", "wall s", ".1f"),
            ("samples_per_sec_median", "samples/s", ".2f"), ("ttl_step", "ttl step", ""), ("ttl_s", "ttl s", ".1f"),
            ("foreign_load_cpus", "other load", ".2f")]
    show = [dict(r, ttl_step=r["time_to_loss"]["step"], ttl_s=r["time_to_loss"]["seconds"]) for r in runs]
    gb = args.micro_batch * args.m
    print()
    print(f"{args.preset}, seq {args.seq}, d=2 w=1, b={args.micro_batch} m={args.m} (global batch {gb}), {args.iters} "
          f"steps, warm-up {args.warmup}, lr {args.lr:g} -> {args.min_lr:g}; validation {args.eval_iters * gb} "
          f"sequences; seeds {args.seeds}")
    print(common.table(show, cols))
    print(common.table([dict(seed=e["seed"], v2=e["final_valid_loss"].get("2bw"), vf=e["final_valid_loss"].get("flush"),
                             ratio=e["valid_loss_ratio_2bw_over_flush"]) for e in noise["per_seed"]],
                       [("seed", "seed", ""), ("v2", "2BW valid", ".4f"), ("vf", "Flush valid", ".4f"),
                        ("ratio", "2BW/Flush", ".4f")]))
    print(f"valid loss ratio 2BW / Flush, mean over seeds: {common.fmt(ratio, '.4f')} (target <= 1.01); Flush "
          f"seed-to-seed spread {common.fmt(noise['flush_seed_spread'], '.4f')}; 2BW gap above noise: "
          f"{noise['gap_above_noise']}; training-time speedup Flush/2BW: {common.fmt(speed, '.3f')}")
    if len(sweep) > 1:
        print(f"\nlearning-rate sweep (final valid loss, seed {args.seeds[0]}):")
        print(common.table([dict(lr=e["lr"], **{f"v_{r['schedule']}": r["final_valid_loss"] for r in e["runs"]},
                                 ratio=e["valid_loss_ratio_2bw_over_flush"]) for e in sweep],
                           [("lr", "peak lr", "g"), ("v_2bw", "2BW", ".4f"), ("v_flush", "Flush", ".4f"),
                            ("ratio", "2BW/Flush", ".4f")]))
        if args.sweep_png:
            plot_sweep(sweep, args.sweep_png, f"{args.preset} (seq {args.seq}), d=2, b={args.micro_batch}, m={args.m}, "
                                              f"{args.iters} steps, seed {args.seeds[0]}: smoothed training loss per "
                                              f"peak learning rate")
    title = (f"{args.preset} (seq {args.seq}), d=2, b={args.micro_batch}, m={args.m}, {args.iters} steps, "
             f"{len(args.seeds)} seed(s) on {machine['cpus_usable']} CPUs; valid loss 2BW/Flush = "
             f"{common.fmt(ratio, '.4f')}")
    if args.png:
        plot(runs, args.png, title)


def _output(args: argparse.Namespace, vocab: int, t: dict) -> dict:
    """The JSON the report reads."""
    runs, noise, ratio, gb = t["runs"], t["noise"], t["ratio"], args.micro_batch * args.m
    return {
        "runs": runs,
        "valid_loss_ratio_2bw_over_flush": ratio,
        "valid_loss_ratio_per_seed": [e["valid_loss_ratio_2bw_over_flush"] for e in noise["per_seed"]],
        "seed_noise": noise,
        "flush_seed_spread": noise["flush_seed_spread"],
        "lr_sweep": t["sweep"],
        "valid_loss_target_ratio": 1.01,
        "valid_loss_within_target": (ratio <= 1.01) if ratio is not None else None,
        "train_time_speedup_2bw_vs_flush": t["speed"],
        "time_to_loss_speedup_2bw_vs_flush": t["ttl"],
        "machine": t["machine"],
        "config": dict(preset=args.preset, seq=args.seq, d=2, w=1, micro_batch=args.micro_batch, m=args.m,
                       global_batch=gb, iters=args.iters, eval_interval=args.eval_interval,
                       eval_iters=args.eval_iters, valid_sequences=args.eval_iters * gb, log_interval=args.log_interval,
                       lr=args.lr, min_lr=args.min_lr, lr_decay="cosine", warmup=args.warmup, weight_decay=0.01,
                       clip_grad=1.0, seed=args.seeds[0], seeds=args.seeds, optimizer="adam (betas 0.9, 0.999)",
                       precision="fp32", smooth_window=args.smooth, target_factor=args.target_factor,
                       target_definition="target_factor x flush final smoothed training loss of the same seed; first "
                                         "step whose smoothed training loss <= target",
                       ratio_definition="mean over seeds of (2BW final valid loss / Flush final valid loss of the same "
                                        "seed)",
                       seconds_definition="sum of step_time_s (segment wall time incl. fill/drain; evals excluded)",
                       data=os.path.relpath(t["data_prefix"], ROOT), vocab=vocab, data_prep_s=round(t["data_s"], 1),
                       quick=args.quick),
    }


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.regimes:
        args.seeds = [args.seed] if args.seed is not None else list(dict.fromkeys(args.seeds))
        args.model_flags = []
        args.out_dir = common.out_dir(args.out_dir, "convergence") if args.out_dir else \
            os.path.join(ROOT, "runs", "convergence_regimes")
        return main_regimes(args)
    data_dir, vocab, corpus_mb, exploration = _settle(args, p)
    t = _train(args, data_dir, vocab, corpus_mb)
    _print(args, t["runs"], t["noise"], t["ratio"], t["speed"], t["sweep"], t["machine"])
    out = _output(args, vocab, t)
    if exploration is not None:
        out["exploration"] = exploration
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
