"""Measured memory per stage (weight versions, stashed activations) against the paper and the planner.

``--sequence-parallel`` measures instead each stage's peak stash at t = 2 with and without
sequence parallelism (``2 x d`` processes, flush), beside the planner's activations for the attention
kernel the CPU runs, and the saving against the planner's.

``--context-parallel-size C [C ...]`` measures instead each stage's peak stash at each context-parallel size
(``memory_context.py``), beside the planner's, and one layer's attention falling as ``1/c``.

``--states`` measures instead, per GPU, the bytes of weights (every version), gradients (every
buffer), the fp32 master and the Adam state, at data-parallel widths w in {1, 2, 4}, fp32 and bf16,
with and without the distributed optimizer (``PipelineRank.weights.weight_bytes``/``grad_bytes``,
``updater.master_bytes``/``state_bytes``), beside the closed-form formulas (``state_formula``) and the
planner's memory model, with their relative differences.

For each depth d, each m, each schedule (2bw, flush, gpipe) and recomputation off/on, the engine
trains a few steps with ``track_memory`` on and every stage reports (``PipelineRank.stats``):

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
import memory_context
from memory_sp import run_sequence_parallel

SCHEDULES = ("2bw", "flush", "gpipe")
MiB = 2**20


def worker(conf: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage

    d = dist.get_world_size()
    state = build_state(Axes(pipeline=d), torch.device("cpu"))
    cfg = ModelConfig(**conf["model"])
    b = conf["micro_batch"]
    torch.manual_seed(1234)
    spec = ModelSpec(cfg, ModelGroups(), 1234)
    tokens = common.token_pool(cfg, 32, b)
    batches = [spec.make_batch(t) for t in tokens]
    out = []
    from megatron_2bw.schedule.schedules import get_schedule
    from megatron_2bw.schedule.stages import chunk_ranges

    for m in conf["ms"]:
        for schedule in conf.get("schedules", SCHEDULES):
            if m < get_schedule(schedule).min_microbatches(d):
                continue
            for recompute in (False, True):
                pipe = PipelineConfig(schedule, b, m, recompute=recompute, track_memory=True)
                opt = OptimizerConfig("adam", lr=1e-4, dtype="fp32")
                build = lambda: spec.build_stage(d, state.pp_rank)  # noqa: E731
                if pipe.chunks > 1:  # one layer list per chunk (a V: the embedding's rank holds the head)
                    place = get_schedule(schedule).placement(d)
                    ranges = chunk_ranges(cfg.num_layers, place.stages_of(state.pp_rank), place.num_stages)
                    build = lambda: spec.build_chunks(ranges)  # noqa: E731, B023 - built within this iteration
                stage = build_stage(build, spec.loss_fn(), state, pipe, opt, (b, cfg.seq_length, cfg.hidden_size))
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
        if s not in SCHEDULES:  # the paper has no formula for the split-backward schedules: the planner's
            from megatron_2bw.schedule.schedules import get_schedule
            n = get_schedule(s).inflight(d, k, m)
            paper_act = exact_act = None
        elif s == "2bw":
            paper_act = A + d * a_in if rc else d * A + d * a_in
        elif s == "gpipe":
            paper_act = A + m * a_in if rc else m * A
        else:
            paper_act = A + d * a_in if rc else d * A
        if s in SCHEDULES:
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


# ---- weights, gradients, master and optimizer state (``--states``) ------------------------------

STATE_KEYS = ("weights", "grads", "master", "optimizer_state")


def state_worker(conf: dict) -> list[dict]:
    """Build one PipelineRank per (precision, optimizer, schedule), train one step, report its bytes."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage

    d = conf["d"]
    w = dist.get_world_size() // d
    state = build_state(Axes(data=w, pipeline=d), torch.device("cpu"))
    cfg, b, m = ModelConfig(**conf["model"]), conf["micro_batch"], conf["m"]
    torch.manual_seed(1234)
    spec = ModelSpec(cfg, ModelGroups(), 1234)
    batches = [spec.make_batch(t) for t in common.token_pool(cfg, 4, b)]
    out = []
    for precision in conf["precisions"]:
        for zero in (False, True):
            for schedule in conf["schedules"]:
                opt = OptimizerConfig("adam", lr=1e-4, dtype=precision, use_distributed_optimizer=zero)
                stage = build_stage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state,
                                      PipelineConfig(schedule, b, m), opt, (b, cfg.seq_length, cfg.hidden_size))
                stage.train(1, lambda mb: batches[mb % len(batches)], lambda t: 1e-4)
                out.append(dict(d=d, w=w, stage=state.pp_rank, dp_rank=state.dp_rank, precision=precision,
                                distributed_optimizer=zero, schedule=schedule, numel=stage.weights.numel,
                                weights=stage.weights.weight_bytes, grads=stage.weights.grad_bytes,
                                master=stage.updater.master_bytes, optimizer_state=stage.updater.state_bytes))
                del stage
                dist.barrier()
    return out


def stage_numel(cfg, d: int, stage: int) -> int:
    """Parameters of a GPT stage (t = 1), closed form: 12h^2 + 13h per layer, the word and position
    embeddings on the first stage, the final LayerNorm and (d > 1) the tied output copy on the last."""
    h, vp = cfg.hidden_size, -(-cfg.vocab_size // 128) * 128
    n = cfg.num_layers // d * (12 * h * h + 13 * h)
    if stage == 0:
        n += vp * h + cfg.max_position_embeddings * h
    if stage == d - 1:
        n += 2 * h + (vp * h if d > 1 else 0)
    return n


def state_formula(cfg, r: dict) -> dict:
    """Weights x versions, gradients x buffers (fp32 with bf16), and the master (half precision only) and
    Adam's two moments on ceil(N/w) elements with the distributed optimizer, N without."""
    from megatron_2bw.schedule.schedules import get_schedule

    spec = get_schedule(r["schedule"])
    n = stage_numel(cfg, r["d"], r["stage"])
    shard = -(-n // r["w"]) if r["distributed_optimizer"] else n
    wb = 4 if r["precision"] == "fp32" else 2
    gb = 4 if r["precision"] in ("fp32", "bf16") else 2
    return dict(numel=n, weights=spec.weight_versions * n * wb, grads=spec.grad_buffers * n * gb,
                master=shard * 4 if wb == 2 else 0, optimizer_state=shard * 8)


def state_planner(cfg, b: int, m: int, r: dict) -> dict | None:
    """The same four terms from the planner's memory model (analytic costs), or None without it."""
    try:
        from megatron_2bw.planner.hardware import load_cluster
        from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
        from megatron_2bw.planner.memory_model import Candidate, ParamBytes, stage_memory
    except ImportError:
        return None
    costs = analytic_microbatch_costs(cfg, load_cluster("dgx-h100"), r["precision"], 1, b)
    cand = Candidate(1, r["d"], r["w"], b, m, False, r["schedule"], distributed_optimizer=r["distributed_optimizer"])
    sm = stage_memory(costs, cand, cfg.num_layers, r["stage"], ParamBytes.for_precision(r["precision"]))
    return dict(numel=sm.params, weights=sm.weights + sm.second_weights, grads=sm.grads, master=sm.master,
                optimizer_state=sm.optimizer_state)


def _rel(measured: int, ref: int) -> float:
    return 0.0 if measured == ref else (measured - ref) / ref if ref else float("inf")


def state_rows(raw: list[dict], conf: dict) -> list[dict]:
    from megatron_2bw.config import ModelConfig

    cfg = ModelConfig(**conf["model"])
    rows = []
    for r in raw:
        row = dict(r)
        refs = {"formula": state_formula(cfg, r), "planner": state_planner(cfg, conf["micro_batch"], conf["m"], r)}
        for name, ref in refs.items():
            if ref is None:
                continue
            for k in ("numel", *STATE_KEYS):
                row[f"{name}_{k}"] = ref[k]
                row[f"rel_diff_{name}_{k}"] = _rel(r[k], ref[k])
            row[f"max_abs_rel_diff_{name}"] = max(abs(row[f"rel_diff_{name}_{k}"]) for k in STATE_KEYS)
        rows.append(row)
    return rows


def run_states(args: argparse.Namespace) -> int:
    """The ``--states`` benchmark: every (d, w) launch, the table, the JSON."""
    conf = dict(model=common.model_dict(args), micro_batch=args.micro_batch, schedules=("2bw", "flush"),
                precisions=("fp32", "bf16"))
    raw = []
    for d in args.d:
        for w in args.w:
            conf_dw = dict(conf, d=d, m=max(d, 2))
            for rank_rows in common.spawn(state_worker, d * w, conf_dw, timeout=600):
                raw += rank_rows
    rows = state_rows(raw, dict(conf, m=2))
    rows.sort(key=lambda r: (r["d"], r["w"], r["precision"], r["schedule"], r["distributed_optimizer"], r["stage"],
                             r["dp_rank"]))
    show = [dict(r, distributed_optimizer="yes" if r["distributed_optimizer"] else "no",
                 **{k: r[k] / 1024 for k in STATE_KEYS}) for r in rows]
    cols = [("d", "d", ""), ("w", "w", ""), ("precision", "prec", ""), ("schedule", "schedule", ""),
            ("distributed_optimizer", "dist-opt", ""), ("stage", "stage", ""), ("dp_rank", "dp", ""),
            ("weights", "W KiB", ".1f"), ("grads", "grad KiB", ".1f"), ("master", "master KiB", ".1f"),
            ("optimizer_state", "Adam KiB", ".1f"), ("max_abs_rel_diff_formula", "vs formula", ".4f"),
            ("max_abs_rel_diff_planner", "vs planner", ".4f")]
    cfg = conf["model"]
    print(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}: bytes per GPU "
          "of weights (every version), gradients (every buffer), fp32 master and Adam state")
    print(common.table(show, cols))
    worst = {n: max(r.get(f"max_abs_rel_diff_{n}", 0.0) for r in rows) for n in ("formula", "planner")}
    print(f"largest relative difference: formula {worst['formula']:.4%}, planner {worst['planner']:.4%} (target 2%)")
    common.write_json(args.json, {"states": rows, "largest_rel_diff": worst,
                                  "within_2_percent": all(v <= 0.02 for v in worst.values()),
                                  "machine": common.machine_info(), "config": conf})
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    p.add_argument("--d", type=int, nargs="+", default=[2, 4])
    p.add_argument("--m", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                   help="registry schedules to measure (the paper's formulas cover 2bw, flush and gpipe; the "
                        "split-backward ones are compared with the planner's memory model alone)")
    p.add_argument("--quick", action="store_true", help="tiny model, d=2, m=4, 2 steps (a smoke run)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--states", action="store_true",
                   help="instead: weights, gradients, master and Adam state per GPU at each --w, fp32 and bf16, "
                        "with and without the distributed optimizer, vs the formulas and the planner")
    p.add_argument("--w", type=int, nargs="+", default=[1, 2, 4], help="--states: data-parallel widths")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="instead: the stash per stage at t = 2 (2 x d processes, the first --d and --m) with and "
                        "without --sequence-parallel, beside the planner's activations and the saving it predicts")
    p.add_argument("--dropout", type=float, default=0.0, help="--sequence-parallel: hidden and attention dropout")
    memory_context.add_args(p)  # --context-parallel-size, --cp-comm-type, --attention-backend
    return p


def _states(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``--states``: its own model shape and widths unless given."""
    # odd hidden size and sequence: the first stage's N is odd, so every w > 1 pads its last shard
    model = (2, 33, 3, 15, 1, 200) if args.quick else (4, 129, 3, 63, 2, 1000)
    for key, value in zip(("layers", "hidden", "heads", "seq", "micro_batch", "vocab"), model, strict=False):
        if getattr(args, key) == p.get_default(key):
            setattr(args, key, value)
    if args.d == p.get_default("d"):
        args.d = [1] if args.quick else [1, 2]
    if args.quick and args.w == p.get_default("w"):
        args.w = [1, 2]
    return run_states(args)


def _stash(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """The default measurement: weights and stashed activations per stage against the formulas."""
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 4, 64, 4, 32, 2, 256
        args.d, args.m, args.steps = [2], [4], 2
    for d in args.d:
        if args.layers % d:
            p.error(f"--layers {args.layers} is not divisible by d={d}")
    conf = dict(model=common.model_dict(args), micro_batch=args.micro_batch, ms=args.m, steps=args.steps,
                schedules=tuple(args.schedules))
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
            ("measured_over_exact", "meas/exact", ".3f"), ("measured_over_planner", "meas/planner", ".3f")]
    cfg = conf["model"]
    print(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, seq {cfg['seq_length']}, b "
          f"{args.micro_batch}, vocab {cfg['vocab_size']}, fp32; A_input = {rows[0]['A_input_bytes'] / MiB:.2f} MiB")
    print(common.table(show, cols))
    if why:
        print(f"planner: {why}")
    common.write_json(args.json, {"results": rows, "machine": common.machine_info(),
                                  "config": dict(conf, precision="fp32", planner_note=why)})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.context_parallel_size:
        if args.quick:
            args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 2, 64, 4, 64, 2, 256
            args.d, args.m, args.steps = [2], [4], 2
        return memory_context.run(args)
    if args.sequence_parallel:
        if args.quick:
            args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 4, 64, 4, 32, 2, 256
            args.d, args.m, args.steps = [2], [4], 2
        return run_sequence_parallel(args)
    if args.states:
        return _states(args, p)
    return _stash(args, p)


if __name__ == "__main__":
    sys.exit(main())
