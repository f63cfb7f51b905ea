"""Expert parallelism: the same MoE block at EP = 2 (2 gloo processes) equals EP = 1 in its outputs and in the
gradients of its inputs, router, routed and shared experts within 1e-6 (relative to the largest value, at
least 1), with both dispatchers and uneven token
counts (10 tokens on rank 0, 6 on rank 1, so the all-to-all's splits differ per rank and per expert); and the
balancing losses over a stats group of two ranks that each hold half of every sequence.

The reference on every rank is the EP = 1 block with the same global weights, called once on each rank's
tokens: a rank's outputs and input gradients are its call's; the EP = 2 experts' gradients (each rank's slice
of the global experts, fed by both ranks' tokens) equal the reference's slice directly; the router's and
shared experts' (replicated) gradients equal the reference's once summed over the ranks."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.config.moe import MoEConfig
from megatron_2bw.moe import MoELayer

H, E = 8, 8
SHAPES = ((5, 2), (3, 2))  # (s, b) of rank 0 and rank 1
CASES = {
    "alltoall": {"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True},
    "alltoall_shared_overlap": {"moe_token_dispatcher_type": "alltoall", "moe_shared_expert_overlap": True},
    "allgather": {"moe_token_dispatcher_type": "allgather"},
    "alltoall_capacity": {"moe_token_dispatcher_type": "alltoall", "moe_expert_capacity_factor": 1.0,
                          "moe_pad_expert_input_to_capacity": True},
    "allgather_sigmoid_bias": {"moe_token_dispatcher_type": "allgather", "moe_router_score_function": "sigmoid",
                               "moe_router_enable_expert_bias": True, "moe_router_num_groups": 4,
                               "moe_router_group_topk": 2, "moe_router_load_balancing_type": "seq_aux_loss"},
}


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    s, b = SHAPES[rank]
    return torch.randn(s, b, H, generator=gen), torch.randn(s, b, H, generator=gen)


def _grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max(1, max |want|): fp32 sums of O(10) values differ by their last bits."""
    scale = float(want.detach().abs().max())
    assert scale > 0
    return float((got.detach() - want.detach()).abs().max()) / max(1.0, scale)


def _one_case(kw: dict) -> dict[str, float]:
    rank = dist.get_rank()
    cfg = MoEConfig(E, moe_ffn_hidden_size=8, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                    moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True, **kw)
    torch.manual_seed(0)
    ref = MoELayer(cfg, H, gated=True, init_std=0.5).train()
    ep = MoELayer(replace(cfg, expert_model_parallel_size=2), H, gated=True, ep_group=dist.group.WORLD).train()
    mine = slice(ep.local_experts.start, ep.local_experts.stop)
    with torch.no_grad():
        for name, p in ep.named_parameters():
            src = dict(ref.named_parameters())[name]
            p.copy_(src[mine] if name.startswith("experts.") else src)
    x, g = _data(rank)
    x_ep = x.clone().requires_grad_(True)
    (ep(x_ep) * g).sum().backward()
    y_ep = ep(x_ep.detach())
    out: dict[str, float] = {}
    for q in range(2):  # the reference sees both ranks' tokens, one call each
        xq, gq = _data(q)
        xq = xq.requires_grad_(True)
        yq = ref(xq)
        (yq * gq).sum().backward()
        if q == rank:
            out["output"] = _rel(y_ep, yq.detach())
            out["input_grad"] = _rel(x_ep.grad, xq.grad)
    ref_g, ep_g = _grads(ref), _grads(ep)
    for name, grad in ep_g.items():
        if name.startswith("experts."):
            want = ref_g[name][mine]
        else:
            dist.all_reduce(grad)
            want = ref_g[name]
        out[name] = _rel(grad, want)
    out["tokens_counted"] = float(ep.last_stats.tokens_per_expert.sum())
    return out


def _split_sequence_case(balancing: str) -> dict[str, float]:
    """Each rank holds half of every sequence (as sequence or context parallelism cut them): with the two ranks
    as the stats group, the balancing losses count the whole sequences' tokens, so the summed gradients equal
    one process's on the whole sequences, and each rank's outputs are its half of that process's."""
    rank = dist.get_rank()
    cfg = MoEConfig(E, moe_ffn_hidden_size=8, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-2,
                    moe_router_load_balancing_type=balancing)
    torch.manual_seed(0)
    ref = MoELayer(cfg, H, gated=True, init_std=0.5).train()
    part = MoELayer(cfg, H, gated=True, stats_group=dist.group.WORLD).train()
    part.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(7)
    x, g = torch.randn(6, 3, H, generator=gen), torch.randn(6, 3, H, generator=gen)
    mine = slice(3 * rank, 3 * rank + 3)
    (ref(x) * g).sum().backward()
    y = part(x[mine])
    (y * g[mine]).sum().backward()
    out = {"output": _rel(y, ref(x)[mine])}
    losses = {k: v.clone() for k, v in part.last_stats.losses.items()}
    for name, grad in _grads(part).items():
        dist.all_reduce(grad)
        out[name] = _rel(grad, _grads(ref)[name])
    for name, value in losses.items():  # the aux losses' halves add up (z-loss: the mean of the two halves)
        dist.all_reduce(value)
        whole = ref.last_stats.losses[name] * (2 if name == "z_loss" else 1)
        out[f"logged {name}"] = _rel(value, whole)
    return out


def _worker() -> dict[str, dict[str, float]]:
    out = {name: _one_case(kw) for name, kw in CASES.items()}
    for balancing in ("aux_loss", "seq_aux_loss"):
        out[f"split_sequences_{balancing}"] = _split_sequence_case(balancing)
    return out


def _overlap_order() -> tuple[list[str], float, float]:
    """The events of one EP = 2 call with ``--moe-shared-expert-overlap``, forward and backward; the output's and
    the input gradient's difference from the same layer without the overlap (same weights and tokens)."""
    from megatron_2bw.moe import comm

    rank = dist.get_rank()
    cfg = MoEConfig(E, moe_ffn_hidden_size=8, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                    moe_shared_expert_intermediate_size=12, moe_token_dispatcher_type="alltoall",
                    expert_model_parallel_size=2)
    torch.manual_seed(0)
    plain = MoELayer(cfg, H, gated=True, ep_group=dist.group.WORLD).train()
    over = MoELayer(replace(cfg, moe_shared_expert_overlap=True), H, gated=True, ep_group=dist.group.WORLD).train()
    over.load_state_dict(plain.state_dict())
    events: list[str] = []
    issue, wait = comm._InFlight.issue, comm._InFlight.wait
    comm._InFlight.issue = lambda self, *a: (events.append("issue"), issue(self, *a))[1]
    comm._InFlight.wait = lambda self: (events.append("wait"), wait(self))[1]
    shared = over.shared_experts
    for name in ("linear_fc1", "linear_fc2"):
        layer = getattr(shared, name)
        layer.register_forward_hook(lambda *_, n=name: events.append(f"shared {n} forward"))
        layer.register_full_backward_hook(lambda *_, n=name: events.append(f"shared {n} backward"))
    x, g = _data(rank)
    try:
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        y = over(xs[0])
        events.append("backward")
        (y * g).sum().backward()
    finally:
        comm._InFlight.issue, comm._InFlight.wait = issue, wait
    y_plain = plain(xs[1])
    (y_plain * g).sum().backward()
    return events, _rel(y, y_plain), _rel(xs[0].grad, xs[1].grad)


def test_shared_experts_run_while_the_tokens_travel():
    """``--moe-shared-expert-overlap``: the shared experts' first linear runs between the dispatch all-to-all's issue
    and its wait, their second between the combine's; in backward the second's between the issue and the wait of
    the combine's gradient all-to-all, the first's between the dispatch's (autograd's own order, no second
    stream). The result equals the layer's without the overlap (the output bitwise: the same operations; the
    input gradient within 1e-6: its parts are summed in another order)."""
    for events, out_diff, grad_diff in run_workers(_overlap_order, 2, timeout=120):
        assert events == ["issue", "shared linear_fc1 forward", "wait", "issue", "shared linear_fc2 forward", "wait",
                          "backward", "issue", "shared linear_fc2 backward", "wait", "issue",
                          "shared linear_fc1 backward", "wait"], events
        assert out_diff == 0.0 and grad_diff <= 1e-6, (out_diff, grad_diff)


def test_expert_parallel_equals_ep1():
    results = run_workers(_worker, 2, timeout=240)
    for rank, per_case in enumerate(results):
        for case, diffs in per_case.items():
            tokens = SHAPES[rank][0] * SHAPES[rank][1]
            counted = diffs.pop("tokens_counted", None)
            assert counted is None or "capacity" in case or counted == 2 * tokens, (case, counted)
            bad = {k: v for k, v in diffs.items() if v > 1e-6}
            assert not bad, f"rank {rank} {case}: {bad}"
