"""The expert axis of the planner: what a layer with experts costs, and what the expert-parallel size changes.

A model with experts (``ModelConfig.moe``) is priced from the dense layer's costs (``layer_costs.py``) with its
MLP replaced by the mixture-of-experts block's arithmetic (``config/moe_arith.py``), as the trainer runs it
(``models/moe_block.py``): experts are not split over the tensor group, so every tensor rank runs the router,
the routed experts and the shared experts on the whole microbatch (gathered under sequence parallelism: one
all-gather forward and one backward in place of the dense MLP's all-reduces), and holds whole expert weights.

- Compute is counted from the ACTIVE multiply-adds: the router, the k routed experts a token goes to and the
  shared experts (``MoEMLPArith.macs``), at the layer's speed (the efficiency curve at the layer's shape: the
  small GEMMs of many small experts are not priced apart; a measured profile would be). Memory-bound passes:
  ``MOE_ROW_PASSES`` over the ``k`` dispatched rows (permute, the send and receive buffers, the re-sort by
  expert, the weighted combine) and the activation's passes over the ``k`` expert hidden rows.
- Memory is counted from the TOTAL weights a rank holds: the attention and norms, the router and the shared
  experts (``BlockCost.params``) and ``E / e`` routed experts (``MoECosts.expert_params / e``). With
  ``--moe-layer-freq`` leaving layers dense (DeepSeek-V3's first three), times are the mean over the layers and
  memory counts every layer as its larger kind (an upper bound for the stages holding the dense ones).
- The token all-to-all: dispatch and combine in the forward and their transposes in the backward, 4 per MoE
  layer and microbatch (6 with ``--moe-layer-recompute``, which re-runs the forward's two), each
  ``tokens x k x h x dtype`` bytes per rank (tokens: the rank's microbatch, ``b s / c`` under context
  parallelism), ``(e - 1) / e`` of it leaving the rank (``alltoall_seconds``). It is inside the layer's forward
  and backward times, on every schedule's critical path, except what ``--moe-shared-expert-overlap`` hides: the
  dispatch runs beside the shared experts' first linear, the combine beside their second (and both again beside
  the replay under ``--moe-layer-recompute``), each one's gradient beside that half's backward (twice its
  forward's GEMMs); an all-to-all hides at most itself.
- Load: dropless routing is priced at the busiest rank's load (the all-to-all waits for it and so does the next
  layer). ``expert_load`` is the busiest expert's tokens over the mean (the trainer logs it per layer as
  max/mean); with ``--moe-router-force-load-balancing`` it is 1 (how published MoE throughputs are taken),
  otherwise ``DEFAULT_EXPERT_LOAD`` unless the planner is told the run's value. One expert at ``f`` times the
  mean and the rest sharing what is left evenly puts ``(f + (E/e - 1)(E - f)/(E - 1)) e / E`` times the mean on
  its rank (``rank_load``): 1 at ``e = 1`` (one rank holds every expert), ``f`` at ``e = E``. A capacity factor
  ``c`` caps an expert at ``c`` times the mean (the rest is dropped); padding to capacity makes every expert
  exactly ``c`` times the mean, on every rank.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig, blocks
from ..config.moe_arith import MOE_MLP, router_stash_bytes
from .cost_table import MicrobatchCosts, MoECosts
from .hardware import Cluster

# The busiest expert's tokens over the mean, without --moe-router-force-load-balancing: an assumption (the
# run's own value is the max/mean tokens per expert its log shows; tools/plan.py --moe-expert-load).
DEFAULT_EXPERT_LOAD = 1.25
MOE_ROW_PASSES = 6  # memory passes over the k dispatched rows of h per token (module docstring)
ALLTOALLS, FORWARD_ALLTOALLS = 4, 2


def moe_share(model: ModelConfig) -> float:
    """The share of the layers that hold experts."""
    return sum(model.moe.moe_layers(model.num_layers)) / model.num_layers


def expert_load(force_balanced: bool, load: float | None = None) -> float:
    """The busiest expert's tokens over the mean that a plan assumes (module docstring)."""
    return 1.0 if force_balanced else (DEFAULT_EXPERT_LOAD if load is None else load)


def rank_load(mc: MicrobatchCosts, e: int, load: float) -> float:
    """The busiest expert rank's tokens over the mean at expert-parallel size ``e`` when the busiest expert
    takes ``load`` times the mean (module docstring); a capacity caps it, padding to capacity evens it."""
    m = mc.moe
    if m is None or m.padded or m.num_experts == 1:
        return 1.0
    n, f = m.num_experts, min(load, m.capacity) if m.capacity is not None else load
    return (f + (n / e - 1) * (n - f) / (n - 1)) * e / n


def expert_bandwidth(t: int, e: int, cluster: Cluster) -> tuple[float, float]:
    """``(share of the leaving bytes crossing servers, seconds per such byte)`` of an expert group: its ``e``
    ranks sit ``t`` apart (adjacent data positions); inside one server the bytes go over NVLink, across servers
    the server's NIC is shared by all its GPUs at once (each dispatches its own tokens)."""
    G = cluster.devices_per_server
    if t * e <= G and G % (t * e) == 0:
        return 0.0, 1.0 / cluster.intra_server_p2p_bandwidth
    local = min(e, max(1, G // t))  # members of the group on one server
    return (e - local) / (e - 1), G / cluster.inter_server_bandwidth


def alltoall_seconds(mc: MicrobatchCosts, t: int, e: int, cluster: Cluster, load: float) -> float:
    """One all-to-all of one MoE layer and microbatch at ``e``: the ``(e - 1)/e`` of its bytes that leave the
    rank (times the busiest rank's load, which receives most), over NVLink and the NIC at once."""
    if mc.moe is None or e <= 1:
        return 0.0
    leaving = mc.moe.alltoall_bytes * rank_load(mc, e, load) * (e - 1) / e
    cross, per_byte = expert_bandwidth(t, e, cluster)
    inside = leaving * (1 - cross) / cluster.intra_server_p2p_bandwidth
    return max(inside, leaving * cross * per_byte)


def alltoall_per_layer(mc: MicrobatchCosts, t: int, e: int, cluster: Cluster, load: float) -> tuple[float, float]:
    """``(forward, backward)`` all-to-all seconds of one layer (the mean over the layers) per microbatch."""
    if mc.moe is None:
        return 0.0, 0.0
    m = mc.moe
    one = alltoall_seconds(mc, t, e, cluster, load) * m.moe_share
    fwd, bwd = m.forward_alltoalls * one, (m.alltoalls - m.forward_alltoalls) * one
    if m.shared_overlap and one > 0:  # module docstring: each overlapped all-to-all hides behind shared work
        halves = [m.moe_share * s for s in m.shared_forward_s]  # beside the dispatch, beside the combine
        replayed = m.alltoalls > 2 * m.forward_alltoalls  # --moe-layer-recompute: the replay overlaps as well
        fwd -= sum(min(one, s) for s in halves)
        bwd -= sum(min(one, 2 * s) + (min(one, s) if replayed else 0.0) for s in halves)
    return fwd, bwd


def for_experts(mc: MicrobatchCosts, t: int, e: int, cluster: Cluster, load: float) -> MicrobatchCosts:
    """``mc`` at expert-parallel size ``e`` (the busiest expert at ``load`` times the mean): the layer's forward
    and backward with the all-to-alls and the busiest rank's extra expert work, its stash with that rank's extra
    rows. ``e = 1`` changes nothing (one rank holds every expert: no all-to-all, no uneven share)."""
    if mc.moe is None or e == mc.expert_parallel:
        return mc
    m, lay, extra = mc.moe, mc.layer, rank_load(mc, e, load) - 1.0
    fwd_a2a, bwd_a2a = alltoall_per_layer(mc, t, e, cluster, load)
    slow = m.moe_share * m.expert_forward_s * extra  # forward; the backward's two GEMMs per weight twice it
    stash = lay.stash_bytes + round(m.routed_stash_bytes * extra)
    layer = replace(lay, forward_s=lay.forward_s + slow + fwd_a2a, backward_s=lay.backward_s + 2 * slow + bwd_a2a,
                    backward_weight_s=lay.backward_weight_s + slow, stash_bytes=stash,
                    workspace_bytes=lay.workspace_bytes + stash - lay.stash_bytes)
    return replace(mc, layer=layer, expert_parallel=e, alltoall_s=(fwd_a2a, bwd_a2a))


def expert_choices(model: ModelConfig, replicas: int, wanted: tuple[int, ...] | None) -> tuple[int, ...]:
    """The expert-parallel sizes of a layout with ``replicas`` (data x context) ranks: those dividing both the
    experts and the replicas (``wanted`` None: every one; else only those); a dense model: ``(1,)``."""
    if model.moe is None:
        return (1,)
    n = model.moe.num_experts
    sizes = range(1, n + 1) if wanted is None else wanted
    return tuple(e for e in sizes if n % e == 0 and replicas % e == 0)


def _moe_mlp(model: ModelConfig, b: int, e: int, speed: float, bandwidth: float, pad: float) -> dict:
    """One MoE layer's MLP block on one rank (whole on every tensor rank): forward seconds (GEMMs and, where
    ``bandwidth`` is given, memory passes), its GEMMs' seconds, the routed experts' share, stash, caught
    gradients, what W reads, non-expert parameters."""
    moe, s, h = model.moe, model.seq_length, model.hidden_size
    tokens, k, f = b * s, moe.moe_router_topk, moe.moe_ffn_hidden_size
    routed = 2 * tokens * MOE_MLP.routed_macs(model) * pad / speed
    gemm = 2 * tokens * (MOE_MLP.macs(model) - MOE_MLP.routed_macs(model)) / speed + routed
    shared = tuple(2 * tokens * macs / speed for macs in MOE_MLP.shared_macs(model))  # the two halves
    act = (3 if model.swiglu else 2) * f
    memory = e * tokens * k * pad * (MOE_ROW_PASSES * h + act) / bandwidth if bandwidth else 0.0
    rows = tokens * k * (3 * h + (4 if model.swiglu else 2) * f) * e  # the routed part of the stash
    stash = MOE_MLP.stash(model).full * tokens * e + round(rows * (pad - 1)) + router_stash_bytes(model) * tokens
    if moe.moe_layer_recompute:  # only the block's input is kept; the backward re-runs the forward
        stash, rows = tokens * h * e, 0
    return {"forward": gemm + memory, "gemm": gemm, "routed": routed, "shared": shared, "stash": stash,
            "rows": round(rows * pad),
            "caught": MOE_MLP.wgrad_stash(model).full * tokens * e,
            "read": MOE_MLP.wgrad_input(model).full * tokens * e,
            "params": MOE_MLP.param_terms(model).full - MOE_MLP.expert_params(model)}


def _dense_mlp(model: ModelConfig, b: int, t: int, e: int, speed: float, bandwidth: float, sharded: bool) -> dict:
    """The dense MLP's share of the dense layer's costs (``layer_costs.analytic_microbatch_costs``'s terms)."""
    tokens, mlp = b * model.seq_length, blocks.DENSE_MLP

    def bytes_of(terms: blocks.Terms) -> int:
        return (terms.full + (terms.seq // t if sharded else terms.seq) + terms.split // t) * tokens * e

    gemm = 2 * tokens * mlp.macs(model) / t / speed
    memory = 2 * tokens * model.ffn_hidden_size / t * e / bandwidth if bandwidth else 0.0
    terms = mlp.param_terms(model)
    return {"forward": gemm + memory, "gemm": gemm, "stash": bytes_of(mlp.stash(model)),
            "caught": bytes_of(mlp.wgrad_stash(model)), "read": bytes_of(mlp.wgrad_input(model)),
            "params": terms.split // t + terms.full}


def _larger(layer: int, dense: int, moe: int, phi: float) -> int:
    """A layer's bytes or parameters with its MLP as the larger of the two kinds the model has."""
    return layer - dense + max(dense if phi < 1 else 0, moe)


def with_experts(dense: MicrobatchCosts, model: ModelConfig, cluster: Cluster, precision: str, e: int, t: int,
                 b: int) -> MicrobatchCosts:
    """The analytic costs of ``dense`` (the model's layer with its dense MLP; ``e`` bytes per activation) with
    the MLP of the MoE layers replaced (module docstring): the table's entry, at expert-parallel size 1."""
    moe, lay = model.moe, dense.layer
    speed = cluster.peak(precision) * cluster.efficiency.layer_fraction(b, model.seq_length, model.hidden_size, t)
    bandwidth = cluster.memory_bandwidth if cluster.efficiency.unit == "macs" else 0.0  # as layer_costs
    sharded = model.sequence_parallel and t > 1
    pad = moe.moe_expert_capacity_factor if moe.moe_pad_expert_input_to_capacity else 1.0
    x, d, phi = _moe_mlp(model, b, e, speed, bandwidth, pad), _dense_mlp(model, b, t, e, speed, bandwidth, sharded), \
        moe_share(model)
    fwd = lay.forward_s + phi * (x["forward"] - d["forward"])
    hidden = b * model.seq_length * model.hidden_size * e
    gather = hidden // 2 if sharded else 0  # the block's all-gather (forward) and its gradient's (backward)
    tp_delta = round(phi * (hidden - gather)) if t > 1 else 0
    stash = _larger(lay.stash_bytes, d["stash"], x["stash"], phi)
    layer = replace(
        lay, forward_s=fwd, backward_s=2 * fwd + (phi * x["forward"] if moe.moe_layer_recompute else 0.0),
        backward_weight_s=lay.backward_weight_s + phi * (x["gemm"] - d["gemm"]),
        params=_larger(lay.params, d["params"], x["params"], phi), stash_bytes=stash,
        workspace_bytes=lay.workspace_bytes + stash - lay.stash_bytes,
        weight_grad_stash_bytes=_larger(lay.weight_grad_stash_bytes, d["caught"], x["caught"], phi),
        weight_grad_input_bytes=_larger(lay.weight_grad_input_bytes, d["read"], x["read"], phi),
        tp_allreduce_forward_bytes=lay.tp_allreduce_forward_bytes - tp_delta,
        tp_allreduce_backward_bytes=lay.tp_allreduce_backward_bytes - tp_delta)
    costs = MoECosts(moe.num_experts, MOE_MLP.expert_params(model),
                     b * model.seq_length * moe.moe_router_topk * model.hidden_size * e * pad,
                     ALLTOALLS + (2 if moe.moe_layer_recompute else 0), FORWARD_ALLTOALLS, phi, x["routed"],
                     x["rows"], moe.moe_expert_capacity_factor, moe.moe_pad_expert_input_to_capacity,
                     x["shared"], moe.moe_shared_expert_overlap and bool(moe.moe_shared_expert_intermediate_size))
    return replace(dense, layer=layer, moe=costs)
