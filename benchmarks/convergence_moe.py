"""Convergence of a tiny mixture of experts under 2BW (issue 43): MoE against the dense model of the same active
size, AdamW and Muon, Flush / 2BW / 2BW + ``ef``, both learning-rate regimes, two seeds.

Every run is the real trainer (``pretrain_gpt.py`` through ``convergence_runs.run_one``, one process, d = 1:
2BW's update rule does not depend on the pipeline depth, so a d = 1 run is the exact reference of any d) on the
demo corpus (``demo_data/``, built as ``scripts/demo.sh`` builds it). Only the model flags, the optimizer and the
pipeline differ inside a (regime, seed): each run's final validation loss is divided by the Flush run of the
same model, optimizer, regime and seed (same initialization, data order and validation samples).

Model (``MODEL``): 2 layers, hidden 64, 4 heads, sequence 64, the demo tokenizer's 8000-token vocabulary. The
MoE has 8 experts per layer of FFN size 128, top-2, the softmax router with Megatron's aux-loss load balancing
(``--moe-aux-loss-coeff 1e-2``), ``--moe-grouped-gemm``, dropless, no expert bias; the dense model's FFN is
top-k x 128 = 256 (= 4 x hidden), so both have the same active parameters (the router's 8 x 64 per layer
aside). Regimes (``MOE_REGIMES``): ``convergence_regimes.REGIMES``' batch, learning rates and 10% warm-up,
with fewer steps (aggressive 300, paper 200) so one run takes 17-40 s alone on 2 cores (the 48 runs of
``docs/data/convergence_moe.json``: 17-145 s each, 41 min in all, with other work beside them).

Output (``--json``, rewritten after every run, so a partial file is usable): ``{"rows": [{"model", "optimizer",
"pipeline", "regime", "seed", "final_valid_loss", "flush_final_valid_loss", "valid_loss_ratio_vs_flush",
"expert_load": {"step": [...], "max_over_mean": {layer: [...]}} (MoE), ...}], "summary": [...] (per model,
optimizer, pipeline and regime: the ratio per seed, its mean and spread), "flush_seed_spread", "signs" (per model
and regime: AdamW's and Muon's 2BW gap, the share of it ``ef`` recovers), "aim", "config", "machine",
"complete"}``. ``expert_load`` is parsed from the trainer's ``moe:`` lines (``tokens_per_expert_max_over_mean
layer N``, every ``--log-interval`` steps, averaged over the forward calls since the last line; the metrics file
does not carry it).

    python benchmarks/convergence_moe.py --json docs/data/convergence_moe.json     # the study, 20-40 min
    python benchmarks/report.py --from-json docs/data --convergence-only          # its part of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import common
from convergence_regimes import REGIMES
from convergence_runs import MUON_LR, ROOT, ensure_data, run_one

MODEL = dict(layers=2, hidden=64, heads=4, seq=64, num_experts=8, topk=2, expert_ffn=128, aux_loss_coeff=1e-2)
MOE_REGIMES = {
    "aggressive": dict(REGIMES["aggressive"], iters=300, warmup=30, eval_interval=50, log_interval=10),
    "paper": dict(REGIMES["paper"], iters=200, warmup=20, eval_interval=50, log_interval=10),
}
PIPELINES = {"flush": ("flush", "none"), "2bw": ("2bw", "none"), "2bw-ef": ("2bw", "ef")}
MODELS = ("dense", "moe")
OPTIMIZERS = ("adamw", "muon")
AIM = dict(model="moe", optimizer="muon", pipeline="2bw-ef", max_ratio=1.005)  # stated before the runs
KEY = ("model", "optimizer", "pipeline", "regime", "seed")
LOAD_RE = re.compile(r"tokens_per_expert_max_over_mean layer (\d+): ([0-9.eE+-]+|nan|inf)")


def model_flags(model: str, shape: dict = MODEL) -> list[str]:
    """Trainer flags of ``model`` on top of the ``gpt-demo`` preset: the dense FFN is top-k x the expert's."""
    h = shape["hidden"]
    flags = ["--num-layers", str(shape["layers"]), "--hidden-size", str(h), "--num-attention-heads",
             str(shape["heads"]), "--max-position-embeddings", str(shape["seq"]),
             "--ffn-hidden-size", str(shape["topk"] * shape["expert_ffn"])]
    if model == "moe":
        flags += ["--num-experts", str(shape["num_experts"]), "--moe-ffn-hidden-size", str(shape["expert_ffn"]),
                  "--moe-router-topk", str(shape["topk"]), "--moe-router-score-function", "softmax",
                  "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff",
                  str(shape["aux_loss_coeff"]), "--moe-grouped-gemm"]
    return flags


def parse_expert_load(log_path: str) -> dict | None:
    """``{"step": [...], "max_over_mean": {"0": [...], ...}}`` from the trainer's ``moe:`` lines (None: none).
    A line ``moe: iteration N`` is printed when step N starts and covers the steps since the previous line."""
    steps, per_layer = [], {}
    with open(log_path, errors="replace") as fh:
        for line in fh:
            if not line.startswith("moe: iteration "):
                continue
            steps.append(int(line.split()[2]))
            for layer, value in LOAD_RE.findall(line):
                per_layer.setdefault(layer, []).append(float(value))
    if not steps:
        return None
    return {"step": steps, "max_over_mean": per_layer}


def run_args(args: argparse.Namespace, regime: str, model: str) -> argparse.Namespace:
    """The namespace ``convergence_runs.run_one`` reads, for one (regime, model); ``--max-iters`` shortens the
    regime (warm-up and intervals scaled alike)."""
    r = argparse.Namespace(preset="gpt-demo", seq=MODEL["seq"], depth=1, dc_lambda=0.04, seeds=args.seeds,
                           smooth=args.smooth, timeout=args.timeout, muon_lr=args.muon_lr,
                           model_flags=model_flags(model), out_dir=os.path.join(args.out_dir, regime, model))
    for k, v in MOE_REGIMES[regime].items():
        setattr(r, k, v)
    if args.max_iters and args.max_iters < r.iters:
        f = args.max_iters / r.iters
        r.iters, r.warmup = args.max_iters, max(1, round(r.warmup * f))
        r.eval_interval = max(1, round(r.eval_interval * f))
        r.log_interval = max(1, round(r.log_interval * f))
    if args.eval_iters:
        r.eval_iters = args.eval_iters
    return r


def plan(args: argparse.Namespace) -> list[dict]:
    """Every run, seed by seed (so a partial file holds whole seeds first), each cell's Flush first."""
    return [dict(model=m, optimizer=o, pipeline=p, regime=g, seed=s)
            for s in args.seeds for g in args.regimes for m in args.models for o in args.optimizers
            for p in args.pipelines]


def one_run(args: argparse.Namespace, job: dict, data: tuple[str, str]) -> dict:
    """Train one cell and return its row (ratio fields filled in by :func:`summarize`)."""
    ra = run_args(args, job["regime"], job["model"])
    schedule, compensation = PIPELINES[job["pipeline"]]
    run = run_one(ra, schedule, data[0], data[1], None, job["seed"], compensation, job["optimizer"])
    load = parse_expert_load(os.path.join(ROOT, run["log_file"])) if job["model"] == "moe" else None
    idle = MODEL["layers"] * (MODEL["num_experts"] - MODEL["topk"]) * 2 * MODEL["hidden"] * MODEL["expert_ffn"]
    active = run["parameters"] - idle if job["model"] == "moe" and run["parameters"] else run["parameters"]
    return dict(job, final_valid_loss=run["final_valid_loss"], final_train_loss=run["final_train_loss"],
                steps=run["steps"], seconds=run["seconds"], wall_seconds=round(run["wall_seconds"], 2),
                parameters=run["parameters"], active_parameters=active, skipped_steps=run["skipped_steps"],
                d=run["d"], lr=run["lr"],
                muon_lr=run["muon_lr"], iters=ra.iters, foreign_load_cpus=run["foreign_load_cpus"],
                valid=run["valid"], expert_load=load, log_file=run["log_file"], metrics_file=run["metrics_file"])


def flush_of(rows: list[dict], row: dict) -> dict | None:
    """The Flush row ``row`` is paired with: same model, optimizer, regime and seed."""
    return next((r for r in rows if r["pipeline"] == "flush" and r["final_valid_loss"] is not None
                 and all(r[k] == row[k] for k in ("model", "optimizer", "regime", "seed"))), None)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict]) -> dict:
    """Rows with their ratio to the paired Flush, and per (model, optimizer, pipeline, regime) the ratio per
    seed, its mean and its seed spread (max - min); Flush's seed-to-seed spread of the loss itself."""
    for r in rows:
        fl = flush_of(rows, r)
        r["flush_final_valid_loss"] = fl["final_valid_loss"] if fl else None
        ok = fl is not None and r["final_valid_loss"] is not None
        r["valid_loss_ratio_vs_flush"] = r["final_valid_loss"] / fl["final_valid_loss"] if ok else None
    cells = list(dict.fromkeys((r["model"], r["optimizer"], r["pipeline"], r["regime"]) for r in rows))
    summary, spread = [], {}
    for m, o, p, g in cells:
        rs = sorted((r for r in rows if (r["model"], r["optimizer"], r["pipeline"], r["regime"]) == (m, o, p, g)),
                    key=lambda r: r["seed"])
        ratios = [r["valid_loss_ratio_vs_flush"] for r in rs if r["valid_loss_ratio_vs_flush"] is not None]
        losses = [r["final_valid_loss"] for r in rs if r["final_valid_loss"] is not None]
        summary.append(dict(model=m, optimizer=o, pipeline=p, regime=g, seeds=[r["seed"] for r in rs],
                            final_valid_loss_per_seed=losses, valid_loss_ratio_per_seed=ratios,
                            valid_loss_ratio_mean=_mean(ratios),
                            valid_loss_ratio_spread=max(ratios) - min(ratios) if len(ratios) > 1 else None))
        if p == "flush" and len(losses) > 1:
            spread[f"{m}/{o}/{g}"] = (max(losses) - min(losses)) / _mean(losses)
    return {"summary": summary, "flush_seed_spread": spread}


def signs(summary: list[dict]) -> list[dict]:
    """Per (model, regime): each optimizer's 2BW gap (mean ratio - 1), its 2BW + ef gap and the share of the
    2BW gap that ef recovers ((gap_2bw - gap_ef) / gap_2bw; None when 2BW shows no gap)."""
    by = {(s["model"], s["optimizer"], s["pipeline"], s["regime"]): s["valid_loss_ratio_mean"] for s in summary}
    out = []
    for m, g in dict.fromkeys((s["model"], s["regime"]) for s in summary):
        e = {"model": m, "regime": g}
        for o in OPTIMIZERS:
            gap, gap_ef = by.get((m, o, "2bw", g)), by.get((m, o, "2bw-ef", g))
            gap = gap - 1 if gap is not None else None
            gap_ef = gap_ef - 1 if gap_ef is not None else None
            e[f"{o}_2bw_gap"], e[f"{o}_ef_gap"] = gap, gap_ef
            e[f"{o}_ef_recovered"] = (gap - gap_ef) / gap if gap and gap > 0 and gap_ef is not None else None
        a, mu = e["adamw_2bw_gap"], e["muon_2bw_gap"]
        e["muon_gap_smaller"] = abs(mu) < abs(a) if a is not None and mu is not None else None
        out.append(e)
    return out


def aim(summary: list[dict], regimes: list[str]) -> dict:
    """The issue's aim, stated before the runs: MoE + Muon + 2BW + ef within 0.5% of Flush in every regime."""
    got = {s["regime"]: s for s in summary
           if (s["model"], s["optimizer"], s["pipeline"]) == (AIM["model"], AIM["optimizer"], AIM["pipeline"])}
    per = {g: (got[g]["valid_loss_ratio_mean"] if g in got else None) for g in regimes}
    seeds = {g: (got[g]["valid_loss_ratio_per_seed"] if g in got else []) for g in regimes}
    met = None if any(v is None for v in per.values()) else all(v <= AIM["max_ratio"] for v in per.values())
    every = None if met is None else all(x <= AIM["max_ratio"] for g in regimes for x in seeds[g])
    return dict(AIM, mean_ratio=per, ratio_per_seed=seeds, met=met, met_by_every_seed=every)


def config(args: argparse.Namespace) -> dict:
    """The settings every row shares, as the report prints them."""
    regs = {g: {k: v for k, v in vars(run_args(args, g, "dense")).items()
                if k in ("iters", "warmup", "lr", "min_lr", "micro_batch", "m", "eval_iters", "eval_interval",
                         "log_interval")} for g in args.regimes}
    for c in regs.values():
        c["global_batch"] = c["micro_batch"] * c["m"]
        c["valid_sequences"] = c["eval_iters"] * c["global_batch"]
    return dict(model=MODEL, flags={m: model_flags(m) for m in args.models}, preset="gpt-demo", d=1, w=1,
                regimes=regs, seeds=args.seeds, models=args.models, optimizers=args.optimizers,
                pipelines=args.pipelines, lr_decay="cosine", weight_decay=0.01, clip_grad=1.0, precision="fp32",
                adam="betas 0.9, 0.999", muon_lr=args.muon_lr,
                muon="Muon on the linear weights (experts' included) at --muon-lr, scheduled like --lr; AdamW on "
                     "the rest", data=os.path.relpath(args.data_prefix, ROOT), vocab=args.vocab,
                ratio_definition="final validation loss / the Flush run's of the same model, optimizer, regime and "
                                 "seed")


def write(args: argparse.Namespace, rows: list[dict], machine: dict, complete: bool) -> dict:
    s = summarize(rows)
    out = {"rows": rows, "summary": s["summary"], "flush_seed_spread": s["flush_seed_spread"],
           "signs": signs(s["summary"]), "aim": aim(s["summary"], args.regimes), "config": config(args),
           "machine": machine, "complete": complete}
    common.write_json(args.json, out)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regimes", nargs="+", choices=tuple(MOE_REGIMES), default=list(MOE_REGIMES))
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--pipelines", nargs="+", choices=tuple(PIPELINES), default=list(PIPELINES))
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 5678])
    p.add_argument("--muon-lr", type=float, default=MUON_LR, help="Muon's peak lr (matrices)")
    p.add_argument("--max-iters", type=int, default=None, help="cap each regime's steps (a smoke run)")
    p.add_argument("--eval-iters", type=int, default=None, help="override the regimes' validation batches")
    p.add_argument("--smooth", type=int, default=20, help="training-loss smoothing window (steps)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "demo_data"))
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "convergence_moe"))
    p.add_argument("--resume", action="store_true", help="keep the finished rows of --json and run the rest")
    p.add_argument("--json", help="results (rewritten after every run)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.seeds = list(dict.fromkeys(args.seeds))
    args.out_dir = common.out_dir(args.out_dir, "convergence_moe")
    data = ensure_data(args.data_dir, args.vocab, args.corpus_mb)
    args.data_prefix = data[0]
    rows = []
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            rows = [r for r in json.load(fh)["rows"] if r["regime"] in args.regimes]
    done = {tuple(r[k] for k in KEY) for r in rows}
    jobs = [j for j in plan(args) if tuple(j[k] for k in KEY) not in done]
    machine, t0 = common.machine_info(), time.time()
    for i, job in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}] {job}", flush=True)
        rows.append(one_run(args, job, data))
        machine["elapsed_s"] = round(time.time() - t0, 1)
        write(args, rows, machine, complete=False)
    out = write(args, rows, machine, complete=True)
    for s in out["summary"]:
        print(f"{s['model']:5s} {s['optimizer']:5s} {s['pipeline']:6s} {s['regime']:10s} ratio per seed "
              f"{[round(x, 4) for x in s['valid_loss_ratio_per_seed']]} mean "
              f"{common.fmt(s['valid_loss_ratio_mean'], '.4f')}")
    print(f"aim {out['aim']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
