"""What the planner prints of a model with experts (``report.py`` calls these; nothing for a dense model).

The header states the experts, the total and active parameters (``config/moe_presets.parameter_counts``) and
the load the plan assumes (``moe_costs``); each plan its expert-parallel size ``e``, the all-to-all seconds per
step and the routed experts' bytes per GPU (weights, gradients, master and optimizer state); the trainer's
command its MoE flags with ``--expert-model-parallel-size e``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..argv import render
from ..config import ModelConfig
from ..config.moe import MoEConfig
from ..config.moe_presets import parameter_counts
from .hardware import GiB
from .memory_model import Candidate
from .moe_costs import DEFAULT_EXPERT_LOAD

# the table's MoE columns (after seq-par), a dense model's table has none; the experts' GiB per GPU of stage 0, the
# fullest middle stage and the last, as the GiB column of the whole memory
HEADER = f" {'e':>3} {'a2a s/step':>10} {'experts GiB 0/1/last':>20}"


def header_lines(request: Any) -> list[str]:
    """The experts, the parameters and the load the plan assumes (empty for a dense model)."""
    m = request.model
    if m.moe is None:
        return []
    moe, (total, active) = m.moe, parameter_counts(m)
    layers, load = sum(moe.moe_layers(m.num_layers)), load_text(request)
    cap = moe.moe_expert_capacity_factor
    cap_text = "dropless" if cap is None else f"capacity factor {cap:g}" + (
        ", padded to capacity" if moe.moe_pad_expert_input_to_capacity else "")
    shared = moe.moe_shared_expert_intermediate_size
    return [f"experts: {moe.num_experts} per MoE layer ({layers} of {m.num_layers} layers), top-{moe.moe_router_topk}"
            f"{f', shared experts {shared} wide' if shared else ''}"
            f"; {total / 1e9:.2f}B parameters in all, {active / 1e9:.2f}B active per token (compute from the "
            f"active, memory from the E/e experts each rank holds); {cap_text}; load: {load}"]


def load_text(request: Any) -> str:
    """The expert load a plan assumes, in words."""
    if request.moe_force_balanced:
        return "force-balanced (--moe-router-force-load-balancing: every expert gets the mean)"
    if request.moe_expert_load is None:
        return (f"the busiest expert at {DEFAULT_EXPERT_LOAD:g} x the mean tokens (assumed; --moe-expert-load "
                "sets the max/mean the run's log shows)")
    return f"the busiest expert at {request.moe_expert_load:g} x the mean tokens (--moe-expert-load)"


def alltoall_per_step(ev: Any) -> float:
    """All-to-all seconds on the critical path of one step: the slowest stage's ``m`` microbatches' and their
    share of the schedule's bubble (a flushing schedule's fill and drain run them too; 2BW has none)."""
    p = ev.prediction
    if p is None:
        return 0.0
    slowest = max(p.stages, key=lambda s: s.microbatch_s)
    a = slowest.alltoall_s
    return ev.candidate.num_micro_batches * a + (p.bubble_s * a / slowest.microbatch_s if a else 0.0)


def cells(ev: Any, model: ModelConfig) -> str:
    """The row's MoE columns (empty for a dense model)."""
    if model.moe is None:
        return ""
    mem = ev.memory
    if len(mem) > 3:
        mem = (mem[0], max(mem[1:-1], key=lambda s: s.experts), mem[-1])
    per_stage = "/".join(f"{s.experts / GiB:.1f}" for s in mem)
    return f" {ev.candidate.expert_parallel:>3} {alltoall_per_step(ev):>10.3f} {per_stage:>20}"


def plan_fields(ev: Any, model: ModelConfig) -> dict[str, Any]:
    """A plan's MoE JSON fields (none for a dense model)."""
    if model.moe is None:
        return {}
    return {"expert_parallel": ev.candidate.expert_parallel,
            "alltoall_seconds_per_step": round(alltoall_per_step(ev), 6),
            "expert_bytes_by_stage": {str(s.stage): s.experts for s in ev.memory}}


def model_fields(model: ModelConfig) -> dict[str, Any]:
    """The model's MoE JSON fields: experts, top-k, total and active parameters (none for a dense model)."""
    if model.moe is None:
        return {}
    total, active = parameter_counts(model)
    return {"num_experts": model.moe.num_experts, "moe_router_topk": model.moe.moe_router_topk,
            "total_parameters": total, "active_parameters": active}


def moe_argv(model: ModelConfig, cand: Candidate) -> list[str]:
    """The trainer's MoE flags of ``model`` (those off their defaults) with the plan's expert-parallel size."""
    if model.moe is None:
        return []
    default = MoEConfig(model.moe.num_experts)
    values = {f"moe.{f.name}": getattr(model.moe, f.name) for f in fields(MoEConfig)
              if getattr(model.moe, f.name) != getattr(default, f.name) or f.name == "num_experts"}
    values["moe.expert_model_parallel_size"] = cand.expert_parallel if cand.expert_parallel > 1 else None
    return render(values, model.kind)
