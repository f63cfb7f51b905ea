"""``--moe-shared-expert-overlap`` on CPU: one MoE layer with shared experts at expert-parallel size EP (EP gloo
processes, the ``alltoall`` dispatcher), its forward and backward with the shared experts' two halves computed
while the dispatched tokens and the experts' outputs travel (and their gradients) and without, side by side.

Each round times ``--calls`` forward+backward calls of the two layers (the same weights and tokens) one after the
other, in alternating order; per round the ratio of the medians (without over with: above 1 is a saving), and over
rounds the median of those ratios. Beside it, each process's seconds inside ``all_to_all_single`` per call (what
there is to hide) and the shared experts' forward+backward seconds alone (what can hide it). Gloo runs a
collective on its own thread, so on the CPU the shared experts' GEMMs can run while the bytes move; how much that
saves depends on the cores the processes share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import common


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (processes)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank and call")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=256)
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=1024)
    p.add_argument("--calls", type=int, default=10, help="timed calls per layer and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    return p


def _worker(a: dict) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_2bw.config.moe import MoEConfig
    from megatron_2bw.moe import MoELayer

    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = MoEConfig(a["num_experts"], moe_ffn_hidden_size=a["moe_ffn_hidden_size"], moe_router_topk=a["topk"],
                    moe_shared_expert_intermediate_size=a["shared"], moe_token_dispatcher_type="alltoall",
                    expert_model_parallel_size=a["ep"])
    torch.manual_seed(0)
    layers = {False: MoELayer(cfg, a["hidden"], gated=True, ep_group=dist.group.WORLD).train()}
    layers[True] = MoELayer(replace(cfg, moe_shared_expert_overlap=True), a["hidden"], gated=True,
                            ep_group=dist.group.WORLD).train()
    layers[True].load_state_dict(layers[False].state_dict())
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(a["tokens"], 1, a["hidden"], generator=g)

    def call(layer) -> float:
        xi = x.clone().requires_grad_(True)
        dist.barrier()
        t0 = time.perf_counter()
        layer(xi).square().mean().backward()
        return time.perf_counter() - t0

    for layer in layers.values():  # warm-up
        call(layer)
    rounds = []
    for r in range(a["rounds"]):
        times = {False: [], True: []}
        for i in range(a["calls"]):
            for over in ((False, True) if (r + i) % 2 == 0 else (True, False)):
                times[over].append(call(layers[over]))
        rounds.append({k: statistics.median(v) for k, v in times.items()})
    return {"rounds": rounds, "a2a_s": _alltoall_seconds(lambda: call(layers[False]), a["calls"]),
            "shared_s": _alone(layers[False].shared_experts, x.reshape(-1, a["hidden"]), a["calls"])}


def _alltoall_seconds(run, calls: int) -> float:
    """The median over ``calls`` runs of the seconds spent in ``all_to_all_single`` (the layer without overlap:
    every all-to-all is a blocking call)."""
    import torch.distributed as dist

    spent, real, per_call = [0.0], dist.all_to_all_single, []

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = real(*args, **kw)
        spent[0] += time.perf_counter() - t0
        return out

    dist.all_to_all_single = timed
    try:
        for _ in range(calls):
            spent[0] = 0.0
            run()
            per_call.append(spent[0])
    finally:
        dist.all_to_all_single = real
    return statistics.median(per_call)


def _alone(shared, x, calls: int) -> float:
    """The shared experts' forward and backward alone, median seconds."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        shared(x.clone().requires_grad_(True)).square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    a = dict(ep=args.ep, tokens=args.tokens, hidden=args.hidden, num_experts=args.num_experts,
             topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
             shared=args.moe_shared_expert_intermediate_size, calls=args.calls, rounds=args.rounds)
    t0 = time.perf_counter()
    ranks = common.spawn(_worker, args.ep, a, timeout=1800)
    per_round = [statistics.median(r["rounds"][k][False] / r["rounds"][k][True] for r in ranks)
                 for k in range(args.rounds)]
    out = {"benchmark": "moe_shared_overlap", "machine": common.machine_info(), "config": a,
           "without_s": statistics.median(statistics.median(r["rounds"][k][False] for r in ranks)
                                          for k in range(args.rounds)),
           "with_s": statistics.median(statistics.median(r["rounds"][k][True] for r in ranks)
                                       for k in range(args.rounds)),
           "speedup_per_round": per_round, "speedup": statistics.median(per_round),
           "alltoall_s_per_call": statistics.median(r["a2a_s"] for r in ranks),
           "shared_s_per_call": statistics.median(r["shared_s"] for r in ranks),
           "elapsed_s": time.perf_counter() - t0}
    print(f"EP {args.ep}, {args.tokens} tokens/rank: forward+backward {out['without_s'] * 1e3:.1f} ms without the "
          f"overlap, {out['with_s'] * 1e3:.1f} ms with it: {out['speedup']:.3f}x (rounds "
          f"{', '.join(f'{x:.3f}' for x in per_round)}); all-to-all {out['alltoall_s_per_call'] * 1e3:.1f} ms, "
          f"shared experts alone {out['shared_s_per_call'] * 1e3:.1f} ms per call")
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
