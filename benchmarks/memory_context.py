"""``benchmarks/memory.py --context-parallel-size C [C ...]``: the stash per stage under context parallelism.

For each context-parallel size ``c`` (and, at ``c > 1``, each ``--cp-comm-type``), ``c x d`` gloo processes
train a few Flush steps of a small GPT with ``--context-parallel-size c`` and every stage reports its peak
stash (``PipelineRank.stats.peak_stashed_bytes``, the engine's saved-tensor accounting) on each context rank.
Beside it, the planner's activations for that stage (``memory_model.stage_memory`` on the costs of
``planner/context_costs.py``, the attention kernel this CPU runs). Each rank also measures one layer's
attention alone (its Q, K and V and what the core keeps for backward) against the planner's count, which
falls as ``1/c``: every per-token tensor is ``s/c`` long, and only the keys and values of the whole sequence
(the ring's K/V hops, the gather) stay whole.
"""

from __future__ import annotations

import argparse

import common

SCHEDULE = "flush"
MiB = 2**20


def add_args(p: argparse.ArgumentParser) -> None:
    """``memory.py``'s flags of this mode."""
    p.add_argument("--context-parallel-size", type=int, nargs="+", metavar="C",
                   help="instead: the stash per stage at each context-parallel size C (C x d processes, the first --d "
                        "and --m) beside the planner's, and one layer's attention (memory_context.py)")
    p.add_argument("--cp-comm-type", nargs="+", default=["p2p", "all_gather"], choices=["p2p", "all_gather"],
                   help="--context-parallel-size: the communication types measured at C > 1")
    p.add_argument("--attention-backend", nargs="+", default=["auto"], choices=["auto", "unfused"],
                   help="--context-parallel-size: the layers' attention cores measured (unfused keeps the s^2 scores)")


def _attention_bytes(cfg, cp, b: int, backend: str) -> int:
    """What one layer's attention keeps for backward on this rank: the QKV output its views hold and the
    core's own tensors (the engine's accounting, on a layer built here)."""
    import torch

    from megatron_2bw.fused import Kernels
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.transformer import TransformerLayer
    from megatron_2bw.pipeline.accounting import SavedBytes

    layer = TransformerLayer(cfg, ModelGroups(cp=cp), 1234, 0, causal=True, kernels=Kernels(attention=backend))
    x = torch.randn(b, cfg.seq_length // (cp.size if cp else 1), cfg.hidden_size)
    with torch.no_grad():
        qkv = layer.attn.qkv(x)
    qkv.requires_grad_(True)
    q, k, v = layer.attn.split_qkv(qkv * 1.0)  # a fresh storage, as the layer's QKV output
    saved = SavedBytes(set())
    with saved.measure():
        out = layer.attn.core(q, k, v, None)
    out.sum().backward()
    return saved.bytes


def cp_worker(conf: dict) -> list[dict]:
    """c x d processes: train a few Flush steps at one (c, comm); report each stage's peak stash."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.context_parallel.group import CPGroup
    from megatron_2bw.fused import Kernels
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage

    c, comm = conf["c"], conf["comm"]
    d = dist.get_world_size() // c
    state = build_state(Axes(context=c, pipeline=d), torch.device("cpu"))
    cfg, b, m = ModelConfig(**conf["model"]), conf["micro_batch"], conf["m"]
    cp = CPGroup.from_state(state, comm) if c > 1 else None
    torch.manual_seed(1234)
    spec = ModelSpec(cfg, ModelGroups(cp=cp), 1234, kernels=Kernels(attention=conf["backend"]))
    batches = [spec.make_batch(x) for x in common.token_pool(cfg, 8, b)]
    pipe = PipelineConfig(SCHEDULE, b, m, track_memory=True)
    opt = OptimizerConfig("adam", lr=1e-4, dtype="fp32")
    stage = build_stage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state, pipe, opt,
                        cfg.stage_activation_shape(b, 1, c))
    stage.train(conf["steps"], lambda mb: batches[mb % len(batches)], lambda step: 1e-4)
    st = stage.stats.as_dict()
    attention = _attention_bytes(cfg, cp, b, conf["backend"])
    dist.barrier()
    return [dict(backend=conf["backend"], c=c, cp_comm_type=comm if c > 1 else "-", d=d, m=m, stage=state.pp_rank,
                 cp_rank=state.cp_rank,
                 max_inflight=st["max_inflight"], measured_stash_bytes=st["peak_stashed_bytes"],
                 measured_attention_bytes=attention)]


def planner_bytes(conf: dict, c: int, comm: str, stage: int, d: int) -> tuple[int, int]:  # conf: with its backend
    """(the stage's activations, one layer's attention with its Q, K, V) by the planner, for this CPU's kernels."""
    from dataclasses import replace

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.planner.context_costs import context_core_bytes, context_microbatch_costs, keeps_layer_qkv
    from megatron_2bw.planner.hardware import load_cluster
    from megatron_2bw.planner.layer_costs import analytic_microbatch_costs, attention_kernel, core_stash_bytes
    from megatron_2bw.planner.memory_model import Candidate, stage_memory

    cfg, b, e = ModelConfig(**conf["model"]), conf["micro_batch"], 4
    cluster = replace(load_cluster("cpu-host"), attention_backend=conf["backend"])
    kv = 2 * cfg.query_groups * cfg.head_dim
    qkv = (b * (cfg.seq_length // c)
           * (cfg.hidden_size + (kv if c == 1 or keeps_layer_qkv(cfg, cluster, comm) else 0)) * e)
    if c == 1:
        costs = analytic_microbatch_costs(cfg, cluster, "fp32", 1, b)
        attention = qkv + core_stash_bytes(cfg, b, 1, e, kernel=attention_kernel(cluster, cfg))
    else:
        costs = context_microbatch_costs(cfg, cluster, "fp32", 1, b, c, comm)
        core = context_core_bytes(cfg, cluster, "fp32", 1, b, c, comm, True)
        attention = qkv + core
    cand = Candidate(1, d, 1, b, conf["m"], False, SCHEDULE, context_parallel=c, cp_comm_type=comm)
    return stage_memory(costs, cand, cfg.num_layers, stage).activations, attention


def cp_rows(raw: list[dict], conf: dict) -> list[dict]:
    """Each (backend, c, comm, stage) on its fullest context rank beside the planner; the attention's ratio to
    c = 1 with the same backend."""
    fullest: dict[tuple, dict] = {}
    for r in raw:
        key = (r["backend"], r["c"], r["cp_comm_type"], r["stage"])
        if key not in fullest or r["measured_stash_bytes"] > fullest[key]["measured_stash_bytes"]:
            fullest[key] = r
    base = {(r["backend"], r["stage"]): r["measured_attention_bytes"] for r in raw if r["c"] == 1}
    rows = []
    for (backend, c, comm, k), r in sorted(fullest.items()):
        act, att = planner_bytes(dict(conf, backend=backend), c, comm if c > 1 else "p2p", k, r["d"])
        ref = base.get((backend, k))
        rows.append(dict(r, planner_activation_bytes=act, measured_over_planner=r["measured_stash_bytes"] / act,
                         planner_attention_bytes=att,
                         attention_measured_over_planner=r["measured_attention_bytes"] / att,
                         attention_vs_c1=r["measured_attention_bytes"] / ref if ref else None))
    return rows


def run(args: argparse.Namespace) -> int:
    """Every c (and comm type at c > 1), the table, the JSON."""
    conf = dict(model=common.model_dict(args), micro_batch=args.micro_batch, m=args.m[0], steps=args.steps,
                backends=args.attention_backend)
    d, raw = args.d[0], []
    for backend in args.attention_backend:
        for c in args.context_parallel_size:
            for comm in (args.cp_comm_type if c > 1 else ["p2p"]):
                run_conf = dict(conf, c=c, comm=comm, backend=backend)
                for rank_rows in common.spawn(cp_worker, c * d, run_conf, timeout=900):
                    raw += rank_rows
    rows = cp_rows(raw, conf)
    show = [dict(r, **{k: r[k] / MiB for k in ("measured_stash_bytes", "planner_activation_bytes",
                                                "measured_attention_bytes", "planner_attention_bytes")}) for r in rows]
    cols = [("backend", "attention", ""), ("c", "c", ""), ("cp_comm_type", "comm", ""), ("d", "d", ""),
            ("stage", "stage", ""), ("cp_rank", "cp rank", ""), ("max_inflight", "inflight", ""),
            ("measured_stash_bytes", "A meas MiB", ".3f"), ("planner_activation_bytes", "A planner", ".3f"),
            ("measured_over_planner", "meas/planner", ".3f"), ("measured_attention_bytes", "attn meas MiB", ".3f"),
            ("planner_attention_bytes", "attn planner", ".3f"), ("attention_measured_over_planner", "attn m/p", ".3f"),
            ("attention_vs_c1", "attn vs c=1", ".3f")]
    cfg = conf["model"]
    print(f"GPT {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
          f"seq {cfg['seq_length']}, b {args.micro_batch}, fp32, {SCHEDULE} d={d} m={conf['m']}: peak stash per stage "
          "(the fullest context rank) and one layer's attention, by context-parallel size")
    print(common.table(show, cols))
    worst = max(abs(r["measured_over_planner"] - 1) for r in rows)
    print(f"largest |measured/planner - 1| over stages: {worst:.4f} (target 0.05)")
    common.write_json(args.json, {"context_parallel": rows, "raw": raw, "largest_rel_diff": worst,
                                  "within_5_percent": worst <= 0.05, "machine": common.machine_info(), "config": conf})
    return 0
