"""Pipeline throughput on CPU: our 2BW / Flush / GPipe against one process and torch.distributed.pipelining.

Every system trains the same GPT layers (``ModelSpec``), split into the same stages
(``stage_range``), on the same microbatches, with the same update work (AdamW with weight
decay, global-norm clipping at 1.0, tied word-embedding gradient all-reduced between the first
and last stage), one torch thread per process and no core pinning:

- ``single``: one process, the whole model, a plain loop: m forward/backward passes
  accumulating gradients, ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` (the fastest
  torch CPU optimizer; a strong baseline).
- ``engine_d1``: our engine with d = 1 (PipeDream-Flush) on the same model: executor overhead.
- ``2bw``, ``flush``, ``gpipe``: our engine at depth d.
- ``torch_1f1b``, ``torch_gpipe``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` and
  ``ScheduleGPipe`` over ``PipelineRank``s wrapping the very same stage layer lists, plus an
  AdamW(fused) step after the same tied-embedding and clipping all-reduces.

Fairness: the d processes are spawned once and every round of every system runs inside that
process group. ``single`` and ``engine_d1`` run on rank 0 while the other ranks wait in a gloo
barrier (blocking, not spinning: the waiting ranks' CPU time is measured and reported), so the
one-process baseline has a whole core, exactly like one stage of the pipelines.

Stage splits: our schedules run each model twice, with the ``uniform`` split (L/d layers per
stage, Megatron's) and the ``balanced`` one (``planner/split.py``'s minimum-bottleneck split of
the per-block forward+backward times measured here on rank 0: embedding, one layer, head and loss).
Each result names its ``model`` (``gpt-4x256``: 4 layers, hidden 256; ``head-heavy``: 8 layers,
hidden 256, vocabulary 32k, where the head outweighs several layers), its ``split`` and
``layers_per_stage``, and ``ideal_speedup`` = sum of the stages' times / the slowest stage's (the
split's ceiling over one process, measured per round).

Measurement: the machine's speed drifts (other jobs, turbo), so systems run in alternating
rounds (round k: single, engine_d1, 2bw, flush, torch_1f1b, gpipe, torch_gpipe, ..., each a segment
of K steps, each of our schedules next to torch's counterpart, before it in even rounds and after it in
odd ones: ``paired_order``, ``round_order``); every ratio
is taken inside one round and the medians over rounds are reported.
Throughput is steady state: on stage 0 the time from the first forward of step 1 to the first
forward of step K-1 of a segment, so it covers K-2 whole steps (bubbles, reductions and updates
included) and excludes only the fill before and the drain after the segment, which a long 2BW
run pays once. The wall-clock throughput of the whole segment is reported next to it. Python's garbage
collector runs before each segment and is off inside it (as Megatron-LM's ``--manual-gc``), for every
system alike: one full collection of these processes takes about a tenth of a steady window.
"""

from __future__ import annotations

import argparse
import sys
import time

import common
from throughput_summary import summarize
from throughput_systems import CLIP, MODELS, SPLITS, SYSTEMS
from throughput_worker import worker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--d", type=int, nargs="+", default=[2], help="pipeline depths (one process each; d=4 on 2 cores "
                                                                 "oversubscribes)")
    p.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="microbatches per step")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians of per-round ratios)")
    p.add_argument("--steps", type=int, default=0, help="steps K per segment of a pipeline, >= 3 (default: 2 + enough "
                                                        "steps for --window-microbatches); one process runs K-1")
    p.add_argument("--window-microbatches", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--quiet-cpus", type=float, default=0.3,
                   help="a round of one m is 'quiet' when other jobs used less than this many CPUs in each of its "
                        "segments")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each segment, wait up to S seconds (<= 240) for the other jobs' load to drop under "
                        "--quiet-cpus")
    p.add_argument("--retry-noisy", type=int, default=0, metavar="N",
                   help="re-run a segment up to N times while other jobs' load exceeded --quiet-cpus during it "
                        "(the same rule for every system; the last attempt is kept)")
    p.add_argument("--p2p-mode", choices=("prefetch", "grouped"), default="prefetch",
                   help="engine transfers: receives posted ahead (gloo's default) or batch_isend_irecv groups (NCCL's)")
    p.add_argument("--sync-sends", action="store_true",
                   help="engine: issue sends from the training thread (as before the transport's send thread), for A/B "
                        "runs")
    p.add_argument("--clip", type=float, default=CLIP,
                   help="global-norm clipping of every system (Megatron's 1.0; clips every step on these random "
                        "tokens, whose norms run 1.3-2.6; a larger value is the stable-training regime where it never "
                        "does, which post-validation (zb-h2+pv) assumes)")
    p.add_argument("--track-memory", action="store_true", help="engine: count stashed bytes with saved-tensor hooks "
                                                               "(off: pure speed)")
    p.add_argument("--models", nargs="+", choices=(*MODELS, "custom"), default=list(MODELS),
                   help="named models (custom: the --layers/--hidden/... flags)")
    p.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS),
                   help="stage splits for our schedules (balanced: chosen from block times measured on rank 0)")
    p.add_argument("--quick", action="store_true", help="tiny model, m=4, one round: a smoke run (< 30 s)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile-system", choices=SYSTEMS, help="cProfile this system on every rank")
    p.add_argument("--profile-dir", default="benchmarks/results/profile")
    return p


def _models(args: argparse.Namespace) -> dict[str, dict]:
    """The named models asked for (``custom``: the model flags), as ModelConfig fields."""
    models = {name: MODELS.get(name) or common.model_dict(args) for name in args.models}
    for name, fields in models.items():
        models[name] = {"kind": "gpt", "max_position_embeddings": fields["seq_length"], **fields}
    return models


def _conf(args: argparse.Namespace) -> dict:
    """What every worker reads (the model is set per model)."""
    return dict(model=None, model_name=None, splits=list(args.splits), micro_batch=args.micro_batch, ms=args.m,
                rounds=args.rounds,
                steps=args.steps, window_microbatches=args.window_microbatches, warmup_steps=args.warmup_steps,
                systems=list(args.systems), track_memory=args.track_memory, pool=64, sync_sends=args.sync_sends,
                cpus=common.machine_info()["cpus_usable"], p2p_mode=args.p2p_mode, quiet_cpus=args.quiet_cpus,
                retry_noisy=max(args.retry_noisy, 0), wait_quiet_s=min(args.wait_quiet, 240.0),
                balance_reps=1 if args.quick else 3, profile_system=args.profile_system, profile_dir=args.profile_dir,
                clip=args.clip)


def _measure(models: dict, conf: dict, args: argparse.Namespace) -> tuple[list[dict], dict, dict]:
    """Every model at every d, each in its own d processes: (results, per model and d, machine)."""
    machine = common.machine_info()
    t0 = time.time()
    all_results, per_model = [], {}
    for name, fields in models.items():
        mconf = {**conf, "model": fields, "model_name": name}
        per_model[name] = {}
        for d in args.d:
            outs = common.spawn(worker, d, mconf, timeout=3600)
            results, extra = summarize(d, mconf, outs[0])
            idle = [x for o in outs[1:] for x in o["idle_cpu"]]
            extra["waiting_ranks_cpu_share"] = common.median(idle)
            per_model[name][str(d)] = extra
            all_results += results
    machine["elapsed_s"] = round(time.time() - t0, 1)
    return all_results, per_model, machine


# (result key, column head, format) of the printed table
COLUMNS = [
        ("system", "system", ""), ("split", "split", ""), ("layers_text", "layers", ""), ("d", "d", ""), ("m", "m", ""),
        ("samples_per_sec", "samples/s", ".2f"), ("speedup_vs_single", "x single", ".3f"),
        ("ideal_speedup", "split ideal", ".3f"), ("ideal_vs_single_with_split", "ideal w/ split", ".3f"),
        ("ideal_vs_single", "ideal", ".3f"),
        ("ratio_vs_torch_1f1b", "x torch1F1B", ".3f"), ("ideal_vs_torch_1f1b", "ideal", ".3f"),
        ("wall_speedup_vs_single", "wall x single", ".3f"),
        ("speedup_vs_single_min", "min", ".3f"), ("speedup_vs_single_max", "max", ".3f"),
        ("ratio_vs_torch_counterpart", "x torch twin", ".3f"), ("ratio_vs_2bw", "x 2bw", ".3f"),
        ("ceiling_vs_2bw", "ceiling x 2bw", ".3f"),
        ("ideal_bubble", "ideal bubble", ".3f"), ("bubble_text", "bubble per stage", ""),
        ("idle_text", "waits per stage", ""), ("compute_text", "compute ms/mb", ""),
        ("foreign_load_cpus", "other load", ".2f"), ("quiet_rounds", "quiet", ""),
        ("quiet_speedup_vs_single", "q x single", ".3f"), ("quiet_ratio_vs_torch_1f1b", "q x t1F1B", ".3f")]


def _print(models: dict, all_results: list[dict], per_model: dict, machine: dict, args: argparse.Namespace,
           overhead: dict) -> dict:
    """The tables on stdout; returns what each (model, d) skipped."""
    def stages_text(xs):
        return " ".join(f"{x:.3f}" if x is not None else "-" for x in xs) if xs else ""

    for r in all_results:
        r_text = ",".join(map(str, r["layers_per_stage"]))
        r["layers_text"] = r_text
        r["bubble_text"] = stages_text(r.get("bubble_per_stage"))
        r["idle_text"] = stages_text(r.get("idle_wait_per_stage"))
        r["compute_text"] = " ".join(f"{x:.1f}" for x in r.get("compute_ms_per_microbatch_per_stage") or []
                                     if x is not None)
    for name, fields in models.items():
        print()
        print(f"{name}: GPT {fields['num_layers']} layers, hidden {fields['hidden_size']}, seq {fields['seq_length']}, "
              f"b {args.micro_batch}, vocab {fields['vocab_size']}; medians of {args.rounds} rounds; "
              f"{machine['cpus_usable']} CPUs, 1 thread/process")
        for d in args.d:
            e = per_model[name][str(d)]
            ms = {sp: [round(x, 1) for x in v] for sp, v in e["stage_compute_ms_per_microbatch_by_split"].items()}
            print(f"\nd = {d}: splits {e['splits']}; stage fwd+bwd ms/microbatch {ms}; ideal (sum/max) "
                  f"{ {sp: round(v, 3) for sp, v in e['ideal_speedup_by_split'].items()} }; "
                  f"waiting ranks' CPU share {common.fmt(e['waiting_ranks_cpu_share'], '.3f')}; "
                  f"other jobs' load per round (CPUs) "
                  f"{[common.fmt(x, '.2f') for x in e['foreign_load_cpus_per_round']]}")
            print(common.table([r for r in all_results if r["compared_in_world_d"] == d and r["model"] == name],
                               COLUMNS))
    for r in all_results:
        del r["layers_text"], r["bubble_text"], r["idle_text"], r["compute_text"]
    skipped = {f"{name} d={d}": e["skipped"] for name, pm in per_model.items() for d, e in pm.items() if e["skipped"]}
    for where, what in skipped.items():
        print(f"\nskipped ({where}): " + "; ".join(f"{k}: {v}" for k, v in what.items()))
    print("\nexecutor overhead at d=1 (engine flush vs plain loop), % step time: "
          + ", ".join(f"m={m}: {common.fmt(v, '+.1f')}" for m, v in overhead.items()))
    return skipped


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 4, 64, 4, 32, 2, 256
        args.m, args.rounds, args.steps, args.warmup_steps = [4], 1, 3, 2
        args.models = ["custom"]
    models = _models(args)
    conf = _conf(args)
    for d in args.d:
        for name, fields in models.items():
            if fields["num_layers"] % d:
                p.error(f"model {name}: {fields['num_layers']} layers are not divisible by d={d}")
        if d > min(args.m) and "2bw" in args.systems:
            p.error(f"2BW needs m >= d: m={min(args.m)} < d={d}")
    all_results, per_model, machine = _measure(models, conf, args)
    first = next(iter(models))
    per_d = per_model[first]
    overhead = {str(r["m"]): r.get("overhead_vs_single_pct") for r in all_results
                if r["system"] == "engine_d1" and r["compared_in_world_d"] == args.d[0] and r["model"] == first}

    skipped = _print(models, all_results, per_model, machine, args, overhead)
    common.write_json(args.json, {
        "results": all_results, "machine": machine, "per_model": per_model,
        "config": dict(model=models[first], models=models, splits=list(args.splits), micro_batch=args.micro_batch,
                       d=args.d, m=args.m, rounds=args.rounds,
                       steps=args.steps or "auto", window_microbatches=args.window_microbatches,
                       warmup_steps=args.warmup_steps, optimizer=f"adamw lr 1e-4 wd 0.01, clip {args.clip:g}, fp32",
                       clip=args.clip,
                       track_memory=args.track_memory, quick=args.quick, p2p_mode=args.p2p_mode,
                       sync_sends=args.sync_sends,
                       quiet_cpus=args.quiet_cpus, wait_quiet_s=args.wait_quiet, retry_noisy=args.retry_noisy,
                       throughput="steady state: stage 0, first forward of step 1 to first forward of step K-1",
                       gc="collected before each segment, disabled inside it (every system alike)"),
        "per_d": per_d, "executor_overhead_d1_pct": overhead, "skipped": skipped,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
