"""MoE pipeline throughput on CPU: PipeDream-2BW vs PipeDream-Flush vs one process, with experts, beside the dense
GPT of the same active size, at pipeline depth d and expert-parallel size EP (issues 42 and 43, "Speed").

Every cell (d, EP) runs in d x EP gloo processes (EP folds inside the data ranks, as Megatron-Core's: w = EP
data ranks per stage, each holding num_experts / EP experts; the ``alltoall`` token dispatcher). In each round
the systems run one after the other, the MoE model and the dense one side by side:

- ``single``: rank 0 alone trains the whole model (experts unsplit) on the same global batch (w x m
  microbatches per step) in a plain loop with ``AdamW(fused=True)`` (``throughput_runners.SingleRunner``);
- ``2bw``, ``flush``: our engine at depth d, w data ranks, the trainer's MoE hooks (the balancing losses'
  gradient per microbatch) (``throughput_runners.EngineRunner``).

Per (cell, variant, system), medians over rounds of: samples/s and tokens/s (steady state, stage 0's first
forward of step 1 to that of step K-1, as ``pipeline_throughput.py``); ``speedup_vs_single`` (over the
variant's single process of the same round); ``moe_vs_dense`` (MoE tokens/s over the dense model's, same
system, same round); the all-to-all's share of a step (each process's seconds inside ``all_to_all_single``
over its steady window, the mean and the max over processes); the stage-balance ceiling (sum of the stages'
forward+backward per microbatch over the largest, each stage timed alone at each round's start); the
bubble-limited ideal; and the planner's prediction of the same run (its simulator on block times it profiles
here). The planner prices experts only from published hardware numbers (a measured profile has no expert terms,
docs/planner.md section 12): on this CPU its prediction is the dense model of the same active size's
(``planner_source``), printed beside both variants.

The machine has 2 cores: d x EP processes above 2 share them (d = 4, EP = 2 is 8 processes), so the absolute
speed-ups are capped by the cores; the ratios taken inside one round (MoE vs dense, 2BW vs Flush) are what
the table is for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import common
from moe_throughput_worker import SYSTEMS, VARIANTS, worker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p, layers=4, hidden=128, heads=4, seq=64, micro_batch=2, vocab=256)
    g = p.add_argument_group("experts (Megatron-Core's flags)")
    g.add_argument("--num-experts", type=int, default=8)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=256,
                   help="each expert's FFN; the dense model's FFN is topk x this (the same active size)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    g.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall")
    p.add_argument("--d", type=int, nargs="+", default=[2, 4], help="pipeline depths")
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2], help="expert-parallel sizes (= data ranks)")
    p.add_argument("--m", type=int, default=8, help="microbatches per step and data rank")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (medians of per-round ratios)")
    p.add_argument("--steps", type=int, default=0, help="steps K per pipeline segment (default: 2 + enough for "
                                                        "--window-microbatches); one process runs K-1")
    p.add_argument("--window-microbatches", type=int, default=40, help="microbatches per data rank in a steady window")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--quiet-cpus", type=float, default=0.3, help="other jobs' load under which a segment is quiet")
    p.add_argument("--quick", action="store_true", help="the smallest cell (d = 2, EP = 1), one tiny round")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--from-json", metavar="JSON", help="summarize a saved run's records again (its flags); no run")
    p.add_argument("--markdown", metavar="JSON", help="print docs/benchmarks.md's table of a saved run; no run")
    return p


def models(args: argparse.Namespace, ep: int) -> dict[str, dict[str, dict]]:
    """ModelConfig fields per variant: the pipeline's (expert-parallel size ``ep``) and the single process's."""
    base = {**common.model_dict(args), "ffn_hidden_size": args.moe_router_topk * args.moe_ffn_hidden_size}
    moe = dict(num_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
               moe_router_topk=args.moe_router_topk, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
               moe_token_dispatcher_type=args.moe_token_dispatcher_type)
    return {"moe": {"pipeline": {**base, "moe": {**moe, "expert_model_parallel_size": ep}},
                    "single": {**base, "moe": {**moe, "expert_model_parallel_size": 1}}},
            "dense": {"pipeline": base, "single": base}}


def _conf(args: argparse.Namespace, ep: int) -> dict:
    """What every worker of one cell reads (``throughput_worker``'s keys, profiler and retries off)."""
    return dict(models=models(args, ep), ep=ep, micro_batch=args.micro_batch, ms=[args.m], rounds=args.rounds,
                steps=args.steps, window_microbatches=args.window_microbatches, warmup_steps=args.warmup_steps,
                systems=list(args.systems), track_memory=False, pool=64, sync_sends=False, p2p_mode="prefetch",
                quiet_cpus=args.quiet_cpus, retry_noisy=0, wait_quiet_s=0.0, balance_reps=1 if args.quick else 3,
                profile_system=None, clip=1.0, cpus=common.machine_info()["cpus_usable"])


# ---------------------------------------------------------------------------------------- the planner
def planner_steps(args: argparse.Namespace, cells: list[tuple[int, int]]) -> dict:
    """The planner's simulated step seconds for every (system, d, EP) and the single process, from block times
    and an AdamW cost it profiles on this process (one thread): the dense model of the same active size (the
    planner's expert costs are analytic, for GPU clusters; a measured profile has none); free transfers, no
    data-parallel reduction time."""
    import torch

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.planner.layer_costs import layer_costs_from_json
    from megatron_2bw.planner.memory_model import Candidate, stage_params
    from megatron_2bw.planner.profiler import OptimizerCost, profile_model
    from megatron_2bw.planner.simulator import simulate, stage_costs

    torch.set_num_threads(1)
    cfg = ModelConfig(**models(args, 1)["dense"]["pipeline"])
    b, L, k = args.micro_batch, args.layers, max(3, args.steps or 2 + -(-args.window_microbatches // args.m))
    prof = profile_model(cfg, [b], warmup=1, reps=3 if args.quick else 7).to_json()
    costs, opt = layer_costs_from_json(prof, "moe_throughput").at(1, b), OptimizerCost(**prof["optimizer"])

    def step_s(schedule: str, d: int, w: int, m: int) -> float:
        cand = Candidate(1, d, w, b, m, False, schedule)
        upd = [opt.seconds(stage_params(costs, L, d, r)) for r in range(d)]
        return simulate(schedule, d, m, stage_costs(costs, cand, L, update_s=upd), num_steps=k).step_time_s

    out = {}
    for d, ep in cells:
        out[f"single ep={ep}"] = step_s("flush", 1, 1, args.m * ep)
        for s in args.systems:
            if s != "single":
                out[f"{s} d={d} ep={ep}"] = step_s(s, d, ep, args.m)
    return out


# ---------------------------------------------------------------------------------------- the summary
def _sps(r: dict | None, per_step: int) -> float | None:
    """Samples/s of a record over its steady window (``per_step`` samples a step)."""
    return r["steady_steps"] * per_step / r["steady_s"] if r else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def _mean(xs) -> float | None:
    xs = [x for x in xs or [] if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ceiling(balance: list[dict], variant: str, pick=min) -> tuple[float | None, list[float]]:
    """(sum over max of the stages' forward+backward ms per microbatch, those ms) for one variant: each stage's
    ``pick`` over the rounds (``min``: the least-disturbed timing; other jobs only ever slow a stage down)."""
    per = [r[variant] for r in balance if variant in r]
    if not per:
        return None, []
    ms = [pick([x[i] for x in per]) for i in range(len(per[0]))]
    return sum(ms) / max(ms), ms


def _ideal(s: str, d: int, w: int, m: int) -> float:
    """Bubble-limited speed-up over one process (balanced stages, free transfers, a processor each)."""
    return 1.0 if s == "single" else w * (d if s == "2bw" else d * m / (m + d - 1))


def summarize_cell(d: int, ep: int, conf: dict, out: dict, plan: dict | None) -> list[dict]:
    """Per (variant, system) of one cell: medians over rounds; every ratio from records of the same round."""
    by = {(r["round"], r["system"], r["split"]): r for r in out["records"]}
    m, b, seq = conf["ms"][0], conf["micro_batch"], conf["models"]["dense"]["pipeline"]["seq_length"]
    per_step = ep * m * b
    rows = []
    for v in VARIANTS:
        ceiling, stage_ms = _ceiling(out["balance_ms"], v)
        ceiling_median = _ceiling(out["balance_ms"], v, common.median)[0]
        for s in conf["systems"]:
            rounds = [rnd for rnd in range(conf["rounds"]) if (rnd, s, v) in by]
            sps = [_sps(by[rnd, s, v], per_step) for rnd in rounds]
            single = [_sps(by.get((rnd, "single", v)), per_step) for rnd in rounds]
            dense = [_sps(by.get((rnd, s, "dense")), per_step) for rnd in rounds]
            flush = [_sps(by.get((rnd, "flush", v)), per_step) for rnd in rounds]
            recs = [by[rnd, s, v] for rnd in rounds]
            vs_single = [_ratio(x, y) for x, y in zip(sps, single, strict=True)]
            vs_dense = [_ratio(x, y) for x, y in zip(sps, dense, strict=True)]
            vs_flush = [_ratio(x, y) for x, y in zip(sps, flush, strict=True)]
            pred, pred_single = (plan or {}).get(f"{s} d={d} ep={ep}"), (plan or {}).get(f"single ep={ep}")
            if s == "single":
                pred = pred_single
            rows.append({
                "d": 1 if s == "single" else d, "ep": ep, "cell": f"d={d} ep={ep}", "processes": d * ep,
                "variant": v, "system": s, "m": m, "microbatches_per_step": ep * m,
                "samples_per_sec": common.median(sps), "tokens_per_sec": common.median(x * seq for x in sps),
                "speedup_vs_single": common.median(vs_single), "moe_vs_dense": common.median(vs_dense),
                "samples_per_sec_per_round": sps, "single_samples_per_sec_per_round": single,
                "dense_samples_per_sec_per_round": dense, "speedup_vs_single_per_round": vs_single,
                "moe_vs_dense_per_round": vs_dense, "ratio_vs_flush": common.median(vs_flush),
                "ratio_vs_flush_per_round": vs_flush, "rounds": rounds,
                "a2a_share": common.median(_mean(r.get("a2a_share")) for r in recs),
                "a2a_share_max": common.median(max(r["a2a_share"]) for r in recs if r.get("a2a_share")),
                "a2a_ms_per_step": common.median(_mean(r.get("a2a_ms_per_step")) for r in recs),
                "balance_ceiling": 1.0 if s == "single" else ceiling,
                "balance_ceiling_median": 1.0 if s == "single" else ceiling_median,
                "stage_compute_ms_per_microbatch": None if s == "single" else stage_ms,
                "ideal_vs_single": _ideal(s, d, ep, m),
                "ideal_vs_single_on_cores": min(_ideal(s, d, ep, m), conf["cpus"]),
                "bubble_per_process": _per_process(recs, "bubble", d * ep),
                "compute_ms_per_microbatch_per_process": _per_process(recs, "compute_ms_per_microbatch", d * ep),
                "foreign_load_cpus": common.median(r.get("foreign_cpus") for r in recs),
                "planner_step_s": pred, "planner_speedup_vs_single": _ratio(pred_single, pred),
                "planner_ratio_vs_flush": None if s == "single" else _ratio((plan or {}).get(f"flush d={d} ep={ep}"),
                                                                            pred),
                "planner_tokens_per_sec": per_step * seq / pred if pred else None,
                "planner_source": "dense model of the same active size (the planner's expert costs are for GPU "
                                  "clusters: a measured profile has no expert terms)",
            })
    return rows


def _per_process(recs: list[dict], key: str, world: int) -> list | None:
    rows = [r[key] for r in recs if r.get(key)]
    return [common.median(x[i] for x in rows) for i in range(world)] if rows else None


# ---------------------------------------------------------------------------------------- the run
COLUMNS = [("cell", "cell", ""), ("variant", "model", ""), ("system", "system", ""),
           ("tokens_per_sec", "tokens/s", ".0f"), ("speedup_vs_single", "x single", ".3f"),
           ("balance_ceiling", "ceiling", ".3f"), ("ideal_vs_single_on_cores", "ideal (cores)", ".2f"),
           ("moe_vs_dense", "MoE/dense", ".3f"), ("ratio_vs_flush", "x flush", ".3f"),
           ("a2a_share", "a2a share", ".3f"),
           ("a2a_share_max", "a2a max", ".3f"), ("a2a_ms_per_step", "a2a ms/step", ".1f"),
           ("planner_speedup_vs_single", "planner x single", ".3f"), ("planner_tokens_per_sec", "planner tok/s", ".0f"),
           ("foreign_load_cpus", "other load", ".2f")]


def _x(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(data: dict) -> str:
    """The table of ``docs/benchmarks.md`` from a saved run: per cell and system, MoE beside dense."""
    by = {(r["cell"], r["system"], r["variant"]): r for r in data["results"]}
    lines = ["| cell | system | processes | MoE tokens/s | dense tokens/s | MoE/dense | MoE x single | "
             "dense x single | vs Flush MoE / dense | ceiling MoE / dense | ideal (2 cores) | a2a share (max) | "
             "a2a ms/step | planner x single | planner vs Flush | planner tokens/s |", "|" + "---|" * 16]
    for cell in dict.fromkeys(r["cell"] for r in data["results"]):
        for s in dict.fromkeys(r["system"] for r in data["results"]):
            moe, dense = by.get((cell, s, "moe")), by.get((cell, s, "dense"))
            if moe is None or dense is None:
                continue
            pipe = s != "single"
            lines.append(" | ".join([
                "", cell.replace("ep", "EP"), s, str(moe["processes"]) if pipe else "1",
                _x(moe["tokens_per_sec"], ".0f"), _x(dense["tokens_per_sec"], ".0f"), _x(moe["moe_vs_dense"], ".3f"),
                _x(moe["speedup_vs_single"], ".3f"), _x(dense["speedup_vs_single"], ".3f"),
                f"{_x(moe['ratio_vs_flush'], '.3f')} / {_x(dense['ratio_vs_flush'], '.3f')}" if pipe else "-",
                f"{_x(moe['balance_ceiling'])} / {_x(dense['balance_ceiling'])}" if pipe else "-",
                _x(moe["ideal_vs_single_on_cores"]) if pipe else "-",
                f"{_x(moe['a2a_share'], '.3f')} ({_x(moe['a2a_share_max'], '.3f')})" if pipe else "-",
                _x(moe["a2a_ms_per_step"], ".1f") if pipe else "-",
                _x(moe["planner_speedup_vs_single"], ".3f"), _x(moe["planner_ratio_vs_flush"], ".3f"),
                _x(moe["planner_tokens_per_sec"], ".0f"), ""]).strip())
    return "\n".join(lines)


def _measure(args: argparse.Namespace) -> dict:
    """Every cell in its own d x EP processes; the planner's steps first (in this process)."""
    cells = [(d, ep) for d in args.d for ep in args.ep]
    machine, t0 = common.machine_info(), time.time()
    plan = planner_steps(args, cells)
    per_cell = {}
    for d, ep in cells:
        outs = common.spawn(worker, d * ep, _conf(args, ep), timeout=1800)
        per_cell[f"d={d} ep={ep}"] = {k: outs[0][k] for k in ("balance_ms", "records", "skipped")}
        print(f"cell d={d} ep={ep} done ({time.time() - t0:.0f} s)", flush=True)
    machine["elapsed_s"] = round(time.time() - t0, 1)
    return {"machine": machine, "per_cell": per_cell, "planner_step_s": plan}


def summarize(args: argparse.Namespace, data: dict) -> list[dict]:
    """The results of a run's raw records (``--from-json``: of a saved run, with the code of today)."""
    out = []
    for cell, raw in data["per_cell"].items():
        d, ep = (int(x.split("=")[1]) for x in cell.split())
        out += summarize_cell(d, ep, {**_conf(args, ep), "cpus": data["machine"]["cpus_usable"]}, raw,
                              data["planner_step_s"])
    return out


def _config(args: argparse.Namespace, argv: list[str]) -> dict:
    return dict(argv=argv, models={f"ep={ep}": models(args, ep) for ep in args.ep}, d=args.d, ep=args.ep, m=args.m,
                micro_batch=args.micro_batch, rounds=args.rounds, steps=args.steps or "auto",
                window_microbatches=args.window_microbatches, warmup_steps=args.warmup_steps,
                systems=list(args.systems), quick=args.quick, optimizer="adamw lr 1e-4 wd 0.01, clip 1, fp32",
                throughput="steady state: stage 0, first forward of step 1 to first forward of step K-1",
                a2a="seconds inside all_to_all_single (the alltoall dispatcher's collectives) over each process's "
                    "steady window",
                ceiling="sum / max of the stages' forward+backward ms per microbatch, each stage's minimum over the "
                        "rounds (balance_ceiling_median: the medians)",
                order="each round: (system, variant) in order, reversed in odd rounds")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    saved, out = None, args.json
    if args.from_json:  # a saved run's records summarized again, under the flags it ran with
        with open(args.from_json) as f:
            saved = json.load(f)
        argv = saved["config"].get("argv", [])
        args = p.parse_args(argv)
    if args.quick:
        args.d, args.ep, args.m, args.rounds, args.steps, args.warmup_steps = [2], [1], 2, 1, 3, 2
        args.layers, args.hidden, args.seq, args.moe_ffn_hidden_size = 2, 32, 16, 32
    for d in args.d:
        if args.layers % d or args.m < d:
            p.error(f"d={d} needs layers divisible by it and m >= d (layers {args.layers}, m {args.m})")
    for ep in args.ep:
        if args.num_experts % ep:
            p.error(f"--num-experts {args.num_experts} is not divisible by EP {ep}")
    data = saved or _measure(args)
    data["results"] = summarize(args, data)
    data["config"] = _config(args, argv)
    print(f"\nMoE GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, b {args.micro_batch}, "
          f"{args.num_experts} experts top-{args.moe_router_topk} (expert FFN {args.moe_ffn_hidden_size}, dense FFN "
          f"{args.moe_router_topk * args.moe_ffn_hidden_size}), m {args.m} per data rank; medians of {args.rounds} "
          f"rounds; {data['machine']['cpus_usable']} CPUs, 1 thread/process")
    print(common.table(data["results"], COLUMNS))
    common.write_json(out, {k: data[k] for k in ("results", "machine", "per_cell", "planner_step_s", "config")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
