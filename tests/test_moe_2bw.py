"""2BW and every other schedule with mixtures of experts (issue 43), through the CLI.

1. Routing follows the weight version. With the aux-loss-free expert bias moving fast (rate 0.2: each update
   flips choices), every microbatch's expert choice is read three times -- in its forward, in any replay of it
   (the pipeline's stash replay with ``--recompute-activations``, a layer checkpoint's replay), and in its
   backward (an identity on the routing weights whose backward reports the routing map the graph holds) -- and
   must be one and the same, at EP 1 and 2, recomputation on and off, on a two-stage 2BW pipeline whose first
   stage starts step s+1 before step s's backwards (where a bias written for all versions at once re-routes a
   recomputation). The losses equal the single-process 2BW run's within 1e-5, which keeps the bias in two
   versions as it keeps two of the weights (a forward on W(v) routes with B(v)).
2. Each schedule with MoE (EP 2 across two pipeline stages: 2BW, GPipe, interleaved 1F1B, zb-h1, zb-h2, zb-v,
   zb-h1 with optimizer post-validation) equals its single-process reference within 1e-5: 2BW the
   single-process 2BW, the flushing ones the single-process Flush (they share its update rule).
"""

from __future__ import annotations

import hashlib
import os

import pytest
import test_moe_training as base
from multiproc import run_workers

TOL = 1e-5
BIAS = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.2", "--moe-aux-loss-coeff", "0", "--train-iters", "4")
TWO_STAGES = ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw")
ROUTING_CELLS = [  # (name, extra flags)
    ("ep1-recompute", (*TWO_STAGES, "--recompute-activations")),
    ("ep1-plain", TWO_STAGES),
    ("ep2-recompute", (*TWO_STAGES, "--expert-model-parallel-size", "2", "--recompute-activations")),
    ("ep2-layer-recompute", (*TWO_STAGES, "--expert-model-parallel-size", "2", "--moe-layer-recompute",
                             "--moe-token-dispatcher-type", "alltoall")),
]
SHARED = ("--moe-shared-expert-intermediate-size", "48", "--moe-token-dispatcher-type", "alltoall")
EP2 = ("--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
       "--global-batch-size", "8")  # m = 4 per data rank: zb-v needs 3
SCHEDULE_CELLS = [  # (name, reference, extra flags): world 4 (d 2 x w 2, EP 2 inside w)
    ("2bw", "2bw", (*EP2, "--pipeline-schedule", "2bw")),
    ("gpipe", "flush", (*EP2, "--pipeline-schedule", "gpipe")),
    ("interleaved", "flush", (*EP2, "--pipeline-schedule", "interleaved-1f1b")),
    ("zb-h1", "flush", (*EP2, "--pipeline-schedule", "zb-h1", "--moe-token-dispatcher-type", "alltoall")),
    ("zb-h2", "flush", (*EP2, "--pipeline-schedule", "zb-h2")),
    ("zb-v", "flush", (*EP2, "--pipeline-schedule", "zb-v")),
    ("zb-h1-pv", "flush", (*EP2, "--pipeline-schedule", "zb-h1", "--enable-optimizer-post-validation")),
    # the shared experts computed while the tokens travel: under 2BW with MoE-layer recomputation (the replay
    # overlaps too) and under zb-h1 (the overlapped backward split into input and weight gradients)
    ("2bw-shared-overlap", "2bw-shared", (*EP2, "--pipeline-schedule", "2bw", *SHARED, "--moe-shared-expert-overlap",
                                          "--moe-layer-recompute")),
    ("zb-h1-shared-overlap", "flush-shared", (*EP2, "--pipeline-schedule", "zb-h1", *SHARED,
                                              "--moe-shared-expert-overlap")),
]
SCHEDULE_REFS = {"2bw": ("--num-layers", "4", "--global-batch-size", "8", "--pipeline-schedule", "2bw"),
                 "flush": ("--num-layers", "4", "--global-batch-size", "8", "--pipeline-schedule", "flush"),
                 "2bw-shared": ("--num-layers", "4", "--global-batch-size", "8", "--pipeline-schedule", "2bw", *SHARED),
                 "flush-shared": ("--num-layers", "4", "--global-batch-size", "8", "--pipeline-schedule", "flush",
                                  *SHARED)}


def _watch_routing(log: list) -> None:
    """Record every router call's (input digest, phase, routing map); backward phases through an identity."""
    import torch

    from megatron_2bw.moe import router as R
    from megatron_2bw.tensor_parallel.recompute import replaying

    class _Seen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, probs, key, routing_map):  # type: ignore[override]
            ctx.key, ctx.map = key, routing_map
            return probs.view_as(probs)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            log.append((ctx.key, "backward", ctx.map.cpu().numpy().tobytes()))
            return grad, None, None

    forward = R.Router.forward

    def watched(self, x, *a, **k):
        route = forward(self, x, *a, **k)
        if not self.training:
            return route
        key = hashlib.sha1(x.detach().cpu().numpy().tobytes()).hexdigest()
        log.append((key, "replay" if replaying() else "forward", route.routing_map.cpu().numpy().tobytes()))
        if route.probs.requires_grad:
            route.probs = _Seen.apply(route.probs, key, route.routing_map.detach().clone())
        return route

    R.Router.forward = watched


def _routing_runs(cells, root: str) -> list:
    """Each cell's rank-0 losses and this rank's routing records: {input: {phase: set of maps}}."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.optimizer import muon

    muon.NS_DTYPE = torch.float32
    rank = dist.get_rank() if dist.is_initialized() else 0
    log: list = []
    _watch_routing(log)
    out = []
    for name, extra in cells:
        log.clear()
        losses = base._cli([*base.BASE, *BIAS, *extra], os.path.join(root, f"{name}.{rank}.jsonl"))
        seen: dict = {}
        for key, phase, m in log:
            seen.setdefault(key, {}).setdefault(phase, set()).add(m)
        out.append((losses, {k: {p: len(v) for p, v in d.items()} for k, d in seen.items()},
                    [k for k, d in seen.items() if len(set().union(*d.values())) > 1]))
    return out


@pytest.fixture(scope="module")
def bias_reference(tmp_path_factory) -> list[float]:
    root = str(tmp_path_factory.mktemp("moe2bw_ref"))
    (out,) = run_workers(_routing_runs, 1, [("ref", ("--pipeline-schedule", "2bw"))], root, timeout=600)
    return out[0][0]


@pytest.mark.parametrize("world", [2, 4])
def test_routing_follows_the_weight_version(world, bias_reference, tmp_path):
    cells = [c for c in ROUTING_CELLS if (4 if "--expert-model-parallel-size" in c[1] else 2) == world]
    outs = run_workers(_routing_runs, world, cells, str(tmp_path), timeout=600)
    for k, (name, _) in enumerate(cells):
        for rank, rank_out in enumerate(outs):
            _, phases, differing = rank_out[k]
            assert not differing, (name, rank, len(differing))  # one expert choice per microbatch input
            assert all("backward" in p for p in phases.values()), (name, rank)
            replayed = sum("replay" in p for p in phases.values())
            assert (replayed > 0) == ("recompute" in name), (name, rank, replayed)
        losses = outs[0][k][0]
        assert losses is not None and len(losses) == len(bias_reference) == 4, (name, losses)
        diff = max(abs(a - b) for a, b in zip(losses, bias_reference))
        assert diff < TOL, (name, losses, bias_reference)


def test_the_bias_moves_and_a_shared_bias_would_reroute(tmp_path):
    """The routing test can fail: the bias changes the routing between steps (a microbatch's input routed
    under two biases differs), so a recomputation under the wrong version would be seen."""
    import torch

    from megatron_2bw.config.moe import MoEConfig
    from megatron_2bw.moe.router import Router, updated_expert_bias

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.2,
                    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    r = Router(cfg, 64)
    x = torch.randn(16, 64)
    first = r(x, 16, 1).routing_map
    bias = updated_expert_bias(first.sum(0).float(), r.expert_bias, 0.2)
    again = r(x, 16, 1, expert_bias=bias).routing_map
    assert not torch.equal(first, again)


def _schedule_runs(cells, root: str) -> list:
    return [None if out is None else out[0] for out in base._runs(cells, root)]


@pytest.fixture(scope="module")
def schedule_references(tmp_path_factory) -> dict[str, list[float]]:
    root = str(tmp_path_factory.mktemp("moesched_ref"))
    names = sorted(SCHEDULE_REFS)
    (out,) = run_workers(_schedule_runs, 1, [(n, SCHEDULE_REFS[n]) for n in names], root, timeout=600)
    return dict(zip(names, out))


def test_every_schedule_with_experts_matches_its_reference(schedule_references, tmp_path):
    outs = run_workers(_schedule_runs, 4, [(n, e) for n, _, e in SCHEDULE_CELLS], str(tmp_path), timeout=900)
    bad = []
    for k, (name, ref, _) in enumerate(SCHEDULE_CELLS):
        losses, want = outs[0][k], schedule_references[ref]
        if losses is None or len(losses) != 3 or max(abs(a - b) for a, b in zip(losses, want)) >= TOL:
            bad.append((name, losses, want))
    assert not bad, bad
