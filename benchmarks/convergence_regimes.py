"""``convergence.py --regimes``: each regime's settings, every 2BW compensation mode against Flush per seed,
runs reused from earlier files, and the per-mode summary the report reads."""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import common
from convergence_plots import plot_regimes
from convergence_runs import MUON_LR, ROOT, SCHEDULES, ensure_data, run_one

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
    return next((st for st, loss in zip(c["step"], c["train_loss_smoothed"], strict=False) if loss <= target), None)


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


def _modes(ra, runs: list[dict]) -> dict:
    """Per (optimizer, compensation) of 2BW: its ratios to Flush per seed, and their means."""
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
    return modes


def _regime_config(ra, runs: list[dict]) -> dict:
    """The settings the regime's runs share, as the report prints them."""
    gb = ra.micro_batch * ra.m
    return dict(preset=ra.preset, seq=ra.seq, d=sorted({r.get("d", ra.depth) for r in runs}) or [ra.depth], w=1,
                  micro_batch=ra.micro_batch, m=ra.m, global_batch=gb,
                  iters=ra.iters, warmup=ra.warmup, lr=ra.lr, min_lr=ra.min_lr, lr_decay="cosine", weight_decay=0.01,
                  clip_grad=1.0, optimizer="adam (betas 0.9, 0.999)", precision="fp32", eval_interval=ra.eval_interval,
                  optimizers=getattr(ra, "optimizers", ["adamw"]),
                  muon="torch.optim.Muon's rule (momentum 0.95, Nesterov, 5 Newton-Schulz steps, shape scale "
                       "'original') on the linear weights at --muon-lr, AdamW as above on the rest",
                  muon_lr=getattr(ra, "muon_lr", MUON_LR),
                  eval_iters=ra.eval_iters, valid_sequences=ra.eval_iters * gb, seeds=ra.seeds, smooth_window=ra.smooth,
                  dc_lambda=ra.dc_lambda, compensations=ra.compensations)


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
        results.append({k: r.get(k) for k in ("regime", "optimizer", "schedule", "compensation", "seed",
                                               "final_valid_loss",
                                               "valid_loss_ratio_vs_best_flush", "muon_lr",
                                               "steps_to_target", "final_train_loss", "valid_loss_ratio_vs_flush",
                                               "time_to_target_vs_flush", "flush_steps_to_this_loss",
                                               "time_vs_flush_at_this_loss", "steps", "seconds", "d", "reused_from")})
    spreads = {}  # per optimizer: Flush's seed-to-seed spread (another optimizer's Flush is no seed noise)
    for opt in dict.fromkeys(r["optimizer"] for r in runs):
        flush_v = [r["final_valid_loss"] for r in runs if r["schedule"] == "flush" and r["optimizer"] == opt]
        spreads[opt] = (max(flush_v) - min(flush_v)) / (sum(flush_v) / len(flush_v)) if len(flush_v) > 1 else None
    spread = spreads.get("adamw")
    modes = _modes(ra, runs)
    config = _regime_config(ra, runs)
    return {"results": results,
            "runs": sorted(runs, key=lambda r: (r["seed"], r["schedule"] != "flush", r["compensation"])),
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
    jobs += [(name, sd, "2bw", c, o)
             for sd in args.seeds for name in args.regimes for o in opts for c in args.compensations
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
        futs = {pool.submit(run_one, ras[n], sch, data_prefix, tok_model, None, sd, c, o): n
                for n, sd, sch, c, o in jobs}
        for fut in as_completed(futs):
            done[futs[fut]].append(fut.result())
            write(False)
    out = write(missing == 0)
    for name, reg in out["regimes"].items():
        flushes = {(r["optimizer"], r["seed"]): round(r["final_valid_loss"], 4) for r in reg["runs"]
                   if r["schedule"] == "flush"}
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
