"""``benchmarks/memory.py --sequence-parallel``: the stash per stage at t = 2 with and without
``--sequence-parallel``, beside the planner's activations and the saving it predicts."""

from __future__ import annotations

import argparse

import common

MiB = 2**20

SP_SCHEDULE = "flush"


def sp_worker(conf: dict) -> list[dict]:
    """t x d processes: train a few flush steps with and without --sequence-parallel, report each stage's
    peak stash (the engine's saved-tensor accounting)."""
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage
    from megatron_2bw.tensor_parallel.random import RNGTracker

    t = conf["t"]
    d = dist.get_world_size() // t
    state = build_state(Axes(tensor=t, pipeline=d), torch.device("cpu"))
    b, m = conf["micro_batch"], conf["m"]
    out = []
    for sp in (False, True):
        cfg = replace(ModelConfig(**conf["model"]), sequence_parallel=sp)
        torch.manual_seed(1234)
        tracker = RNGTracker(1234, state.tp_rank)
        spec = ModelSpec(cfg, ModelGroups.of(state), 1234, rng=tracker)
        batches = [spec.make_batch(x) for x in common.token_pool(cfg, 8, b)]
        pipe = PipelineConfig(SP_SCHEDULE, b, m, track_memory=True)
        opt = OptimizerConfig("adam", lr=1e-4, dtype="fp32")
        # the lambdas run within this iteration (B023)
        stage = build_stage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state, pipe, opt,  # noqa: B023
                            cfg.stage_activation_shape(b, t), rng_tracker=tracker)
        stage.train(conf["steps"], lambda mb: batches[mb % len(batches)], lambda step: 1e-4)  # noqa: B023
        st = stage.stats.as_dict()
        if state.tp_rank == 0:
            out.append(dict(t=t, d=d, m=m, sequence_parallel=sp, stage=state.pp_rank,
                            max_inflight=st["max_inflight"], measured_stash_bytes=st["peak_stashed_bytes"]))
        del stage
        dist.barrier()
    return out


def sp_planner_bytes(conf: dict, sp: bool, stage: int, d: int) -> int:
    """The planner's activations of ``stage`` (analytic costs, the attention kernel of this CPU run)."""
    from dataclasses import replace

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.planner.hardware import load_cluster
    from megatron_2bw.planner.layer_costs import analytic_microbatch_costs
    from megatron_2bw.planner.memory_model import Candidate, stage_memory

    cfg = replace(ModelConfig(**conf["model"]), sequence_parallel=sp)
    # this CPU run's kernels (layer_costs.attention_kernel): torch's flash kernel without attention dropout,
    # its fp32 math path with it; dropout masks in the activations' dtype
    cluster = load_cluster("cpu-host")
    costs = analytic_microbatch_costs(cfg, cluster, "fp32", conf["t"], conf["micro_batch"])
    cand = Candidate(conf["t"], d, 1, conf["micro_batch"], conf["m"], False, SP_SCHEDULE, sequence_parallel=sp)
    return stage_memory(costs, cand, cfg.num_layers, stage).activations


def sp_rows(raw: list[dict], conf: dict) -> list[dict]:
    """Each stage with and without SP beside the planner, and the saving (off - on) beside its prediction.
    Stage 0's token ids are in the planner's count but not the engine's (8 bytes a token)."""
    rows = []
    by = {(r["stage"], r["sequence_parallel"]): r for r in raw}
    for (k, sp), r in sorted(by.items()):
        pred = sp_planner_bytes(conf, sp, k, r["d"])
        rows.append(dict(r, planner_activation_bytes=pred, measured_over_planner=r["measured_stash_bytes"] / pred))
    for k in sorted({k for k, _ in by}):
        off, on = by[(k, False)], by[(k, True)]
        saved = off["measured_stash_bytes"] - on["measured_stash_bytes"]
        want = sp_planner_bytes(conf, False, k, off["d"]) - sp_planner_bytes(conf, True, k, off["d"])
        rows.append(dict(t=conf["t"], d=off["d"], m=conf["m"], stage=k, sequence_parallel="saving",
                         max_inflight=on["max_inflight"], measured_stash_bytes=saved, planner_activation_bytes=want,
                         measured_over_planner=saved / want if want else None))
    return rows


def run_sequence_parallel(args: argparse.Namespace) -> int:
    """``--sequence-parallel``: the measured stash per stage at t = 2 with and without it, and the planner's."""
    model = dict(common.model_dict(args), hidden_dropout=args.dropout, attention_dropout=args.dropout)
    conf = dict(model=model, t=2, micro_batch=args.micro_batch, m=args.m[0], steps=args.steps)
    d = args.d[0]
    raw = [row for rank_rows in common.spawn(sp_worker, 2 * d, conf, timeout=600) for row in rank_rows]
    rows = sp_rows(raw, conf)
    show = [dict(r, sequence_parallel={True: "on", False: "off"}.get(r["sequence_parallel"], r["sequence_parallel"]),
                 measured_stash_bytes=r["measured_stash_bytes"] / MiB,
                 planner_activation_bytes=r["planner_activation_bytes"] / MiB) for r in rows]
    cols = [("t", "t", ""), ("d", "d", ""), ("m", "m", ""), ("stage", "stage", ""),
            ("sequence_parallel", "seq-par", ""), ("max_inflight", "inflight", ""),
            ("measured_stash_bytes", "A meas MiB", ".3f"),
            ("planner_activation_bytes", "A planner", ".3f"), ("measured_over_planner", "meas/planner", ".3f")]
    cfg = conf["model"]
    print(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, seq {cfg['seq_length']}, "
          f"b {args.micro_batch}, dropout {args.dropout}, fp32, {SP_SCHEDULE} m={conf['m']}: peak stash per stage at "
          f"t=2 with and without --sequence-parallel, and what it saves")
    print(common.table(show, cols))
    common.write_json(args.json, {"sequence_parallel": rows, "machine": common.machine_info(), "config": conf})
    return 0
