"""Measured memory per stage (weight versions, stashed activations) against the paper and the planner.

For each depth d, each m, each schedule (2bw, flush, gpipe) and recomputation off/on, the engine
trains a few steps with ``track_memory`` on and every stage reports (``PipelineStage.stats``):

- ``weight_bytes``: all weight versions held (2BW: 2, others: 1), fp32 here;
- ``peak_stashed_bytes``: the most activation bytes autograd kept for backward at once, counted
  by saved-tensor hooks (each storage once, weights and gradients excluded). With recomputation
  it is the stashed stage inputs plus the full activations of the microbatch being recomputed.

They are compared, stage by stage, with:

- ``paper``: the formulas of the PipeDream-2BW paper, with per-stage terms
  ``|W|/d`` -> this stage's measured version bytes ``W_r``, ``|A_total|/d`` -> this stage's
  measured per-microbatch activations ``A_r`` (the flush no-recompute run's peak divided by its
  in-flight count), ``|A_input|`` = ``b*s*h*bytes``:
  2BW ``2W_r + A_r + d*A_in`` (recompute) and ``2W_r + d*A_r + d*A_in`` (no recompute);
  GPipe ``W_r + A_r + m*A_in`` (recompute; ``m*A_r`` without); Flush ``W_r`` + up to ``d``
  stashes (``d*A_r``; ``A_r + d*A_in`` with recompute).
- ``exact``: the same with stage r's true in-flight count n_r (``min(d-r, m)`` for 1F1B, ``m`` for
  GPipe) instead of the paper's worst case d, and without the paper's separate ``d*A_in`` when
  activations are not recomputed (the stage input is one of the tensors ``A_r`` already counts).
  Stage 0's input is token ids, which the engine does not count as stashed activations.
- ``planner``: ``megatron_2bw.planner.memory_model.stage_memory`` (analytic layer costs), when
  that module is importable; its ``weights + second_weights`` and ``activations``.
"""

from __future__ import annotations

import argparse
import sys

import common

SCHEDULES = ("2bw", "flush", "gpipe")
MiB = 2**20


def worker(conf: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import build_state
    from megatron_2bw.pipeline.executor import PipelineStage
    from megatron_2bw.tensor_parallel.group import TPGroup

    d = dist.get_world_size()
    state = build_state(1, d, 1, torch.device("cpu"))
    cfg = ModelConfig(**conf["model"])
    b = conf["micro_batch"]
    torch.manual_seed(1234)
    spec = ModelSpec(cfg, TPGroup(), 1234)
    tokens = common.token_pool(cfg, 32, b)
    batches = [spec.make_batch(t) for t in tokens]
    out = []
    for m in conf["ms"]:
        for schedule in SCHEDULES:
            if schedule == "2bw" and m < d:
                continue
            for recompute in (False, True):
                pipe = PipelineConfig(schedule, b, m, recompute=recompute, track_memory=True)
                opt = OptimizerConfig("adam", lr=1e-4, dtype="fp32")
                stage = PipelineStage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state, pipe, opt,
                                      (b, cfg.seq_length, cfg.hidden_size))
                stage.train(conf["steps"], lambda mb: batches[mb % len(batches)], lambda t: 1e-4)
                st = stage.stats.as_dict()
                w = stage.weights
                out.append(dict(d=d, m=m, schedule=schedule, recompute=recompute, stage=state.pp_rank,
                                version_bytes=w.numel * w.flat[0].element_size(), stats=st))
                del stage
                dist.barrier()
    return out


def _planner(cfg_dict: dict, b: int):
    """(stage_memory function, costs, ParamBytes) from the planner, or (None, reason)."""
    try:
        from megatron_2bw.config import ModelConfig
        from megatron_2bw.planner.hardware import load_cluster
        from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
        from megatron_2bw.planner.memory_model import Candidate, ParamBytes, stage_memory
    except Exception as exc:  # noqa: BLE001 - the planner is optional here
        return None, f"planner memory model not importable: {exc}"
    try:
        cluster = load_cluster("dgx-h100")  # only its speed enters the costs; memory terms do not use it
        costs = analytic_microbatch_costs(ModelConfig(**cfg_dict), cluster, "fp32", 1, b)
        return (stage_memory, Candidate, costs, ParamBytes.for_precision("fp32")), None
    except Exception as exc:  # noqa: BLE001
        return None, f"planner memory model failed: {exc}"


def summarize(raw: list[dict], conf: dict) -> tuple[list[dict], str | None]:
    from megatron_2bw.config import ModelConfig

    cfg = ModelConfig(**conf["model"])
    b, e = conf["micro_batch"], 4  # fp32
    a_in = b * cfg.seq_length * cfg.hidden_size * e
    planner, why = _planner(conf["model"], b)
    # A_r: per-microbatch activations of stage r, from the flush no-recompute run (peak / in flight)
    a_stage = {}
    for r in raw:
        if r["schedule"] == "flush" and not r["recompute"]:
            st = r["stats"]
            a_stage[r["d"], r["m"], r["stage"]] = st["peak_stashed_bytes"] / max(st["max_inflight"], 1)
    rows = []
    for r in raw:
        d, m, s, rc, k = r["d"], r["m"], r["schedule"], r["recompute"], r["stage"]
        st = r["stats"]
        W, A = r["version_bytes"], a_stage.get((d, m, k))
        n = m if s == "gpipe" else min(d - k, m)
        a_in_k = 0 if k == 0 else a_in  # stage 0's input is token ids (not counted by the engine)
        versions = 2 if s == "2bw" else 1
        if s == "2bw":
            paper_act = A + d * a_in if rc else d * A + d * a_in
        elif s == "gpipe":
            paper_act = A + m * a_in if rc else m * A
        else:
            paper_act = A + d * a_in if rc else d * A
        exact_act = (A + n * a_in_k) if rc else n * A
        row = dict(
            d=d, m=m, schedule=s, recompute=rc, stage=k, weight_versions=st["weight_versions"],
            max_inflight=st["max_inflight"], expected_inflight=n,
            measured_weight_bytes=st["weight_bytes"], paper_weight_bytes=versions * W,
            measured_stash_bytes=st["peak_stashed_bytes"], paper_activation_bytes=paper_act,
            exact_activation_bytes=exact_act, A_input_bytes=a_in, A_stage_bytes=A, W_version_bytes=W,
            measured_over_exact=st["peak_stashed_bytes"] / exact_act if exact_act else None,
            measured_over_paper=st["peak_stashed_bytes"] / paper_act if paper_act else None,
        )
        if planner is not None:
            stage_memory, Candidate, costs, pb = planner
            try:
                cand = Candidate(1, d, 1, b, m, rc, s)
                sm = stage_memory(costs, cand, cfg.num_layers, k, pb)
                row["planner_weight_bytes"] = sm.weights + sm.second_weights
                row["planner_activation_bytes"] = sm.activations
                row["measured_over_planner"] = st["peak_stashed_bytes"] / sm.activations if sm.activations else None
            except Exception as exc:  # noqa: BLE001
                why = f"planner stage_memory failed: {exc}"
        rows.append(row)
    return rows, why


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    p.add_argument("--d", type=int, nargs="+", default=[2, 4])
    p.add_argument("--m", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny model, d=2, m=4, 2 steps (a smoke run)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 4, 64, 4, 32, 2, 256
        args.d, args.m, args.steps = [2], [4], 2
    for d in args.d:
        if args.layers % d:
            p.error(f"--layers {args.layers} is not divisible by d={d}")
    conf = dict(model=common.model_dict(args), micro_batch=args.micro_batch, ms=args.m, steps=args.steps)
    raw = []
    for d in args.d:
        for rank_rows in common.spawn(worker, d, conf, timeout=1800):
            raw += rank_rows
    rows, why = summarize(raw, conf)
    rows.sort(key=lambda r: (r["d"], r["m"], r["schedule"], r["recompute"], r["stage"]))
    show = []
    for r in rows:
        x = dict(r)
        for k in ("measured_weight_bytes", "paper_weight_bytes", "planner_weight_bytes", "measured_stash_bytes",
                  "paper_activation_bytes", "exact_activation_bytes", "planner_activation_bytes"):
            if x.get(k) is not None:
                x[k] = x[k] / MiB
        x["recompute"] = "yes" if r["recompute"] else "no"
        show.append(x)
    cols = [("d", "d", ""), ("m", "m", ""), ("schedule", "schedule", ""), ("recompute", "recomp", ""),
            ("stage", "stage", ""), ("weight_versions", "vers", ""), ("max_inflight", "inflight", ""),
            ("measured_weight_bytes", "W meas MiB", ".2f"), ("paper_weight_bytes", "W paper", ".2f"),
            ("planner_weight_bytes", "W planner", ".2f"),
            ("measured_stash_bytes", "A meas MiB", ".2f"), ("exact_activation_bytes", "A exact", ".2f"),
            ("paper_activation_bytes", "A paper", ".2f"), ("planner_activation_bytes", "A planner", ".2f"),
            ("measured_over_exact", "meas/exact", ".3f")]
    cfg = conf["model"]
    print(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, seq {cfg['seq_length']}, b {args.micro_batch}, "
          f"vocab {cfg['vocab_size']}, fp32; A_input = {rows[0]['A_input_bytes'] / MiB:.2f} MiB")
    print(common.table(show, cols))
    if why:
        print(f"planner: {why}")
    common.write_json(args.json, {"results": rows, "machine": common.machine_info(),
                                  "config": dict(conf, precision="fp32", planner_note=why)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
