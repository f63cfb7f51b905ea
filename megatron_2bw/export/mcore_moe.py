"""Experts in Megatron-Core's torch format (``--saver mcore`` / ``--loader mcore`` of an MoE GPT).

Megatron-Core's ``MoELayer`` (its local spec, and its Transformer Engine spec without grouped GEMM) saves per
layer ``mlp.router.weight [E, h]``, each expert as a ``SequentialMLP`` of its own
``mlp.experts.local_experts.K.linear_fc1.weight [2F, h]`` (SwiGLU's gate rows first, as our ``linear_fc1[K]``)
and ``linear_fc2.weight [h, F]``, and the shared experts as ``mlp.shared_experts.linear_fc1/linear_fc2.weight``
with ``mlp.shared_experts.gate_weight [1, h]``. An MoE layer keeps its ``pre_mlp_layernorm`` as a module of its own
under either implementation (no fused norm before a router). Files are written at expert-parallel size 1 (every
expert in every file), expert tensor parallel size 1 (experts whole on every tensor rank). Shared experts are an
``MLP`` on the dense tensor group whatever the expert tensor parallel size: at t > 1 tensor rank r holds rows r
of t of ``linear_fc1`` (column-parallel; with SwiGLU its own [gate; up] rows, as the dense ``linear_fc1``), columns r
of t of ``linear_fc2`` (row-parallel) and the whole gate; our shared experts are whole on every tensor rank, so
the export cuts them (:func:`shared_piece`) and the loader joins them (:func:`join_shared`).

The MoE flags travel in ``args`` under Megatron's names (``num_experts``, ``moe_router_topk``, ...: the
:class:`~megatron_2bw.config.moe.MoEConfig` fields), and are read back from them.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

import torch

from ..checkpoint.names import is_moe_layer
from ..config import ModelConfig
from ..config.moe import MoEConfig
from ..errors import ConfigError

STACKS = ("mlp.moe.experts.linear_fc1", "mlp.moe.experts.linear_fc2")  # our expert stacks [E, out, in]
SHARED = "mlp.moe.shared_experts."
SHARED_SPLIT = {"linear_fc1.weight": 0, "linear_fc2.weight": 1}  # column- and row-parallel in Megatron-Core
# the fields of Megatron's args that shape or route an MoE model (a checkpoint's training-only ones are left)
_READ = ("moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
         "moe_router_pre_softmax", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
         "moe_router_dtype", "moe_router_enable_expert_bias", "moe_expert_capacity_factor", "moe_token_drop_policy",
         "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")


def check_writable(cfg: ModelConfig) -> None:
    """What --saver mcore cannot write of an MoE model, in one line."""
    m = cfg.moe
    if m is not None and m.moe_router_enable_expert_bias:
        raise ConfigError("--saver mcore cannot write this MoE model: its --moe-router-enable-expert-bias state is not "
                          "part of the exported weights; keep it in --ckpt-format torch_dist")


def _shared_dim(rest: str) -> int | None:
    """Megatron-Core's tensor-parallel split dimension of a shared-expert weight (``rest``: our name in a layer);
    None for the gate and for any other name."""
    return SHARED_SPLIT.get(rest[len(SHARED):]) if rest.startswith(SHARED) else None


def _gated(cfg: ModelConfig, rest: str) -> bool:
    return cfg.swiglu and rest == SHARED + "linear_fc1.weight"


def shared_piece(cfg: ModelConfig, rest: str, value: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """Tensor rank ``tp``'s piece of the whole tensor ``value`` of our parameter ``rest`` as Megatron-Core holds it
    (``value`` itself unless it is a split shared-expert weight)."""
    dim = _shared_dim(rest)
    if dim is None or t == 1:
        return value
    if _gated(cfg, rest):  # [gate; up] rows: this rank's rows of each
        return torch.cat([half.chunk(t, 0)[tp] for half in value.chunk(2, 0)], 0)
    return value.chunk(t, dim)[tp]


def join_shared(cfg: ModelConfig, parts: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
    """In place: every tensor rank's shared-expert weights in ``parts`` (by (tensor, pipeline) rank, our global
    names) replaced by the whole tensor joined from all ranks' pieces (our layout holds them whole everywhere)."""
    t = 1 + max(tp for tp, _ in parts)
    if t == 1 or cfg.moe is None:
        return
    for (tp, pp), part in parts.items():
        if tp != 0:
            continue
        for name in [n for n in part if _shared_dim(n.split(".", 1)[1]) is not None]:
            pieces = [parts[(r, pp)][name] for r in range(t)]
            if _gated(cfg, name.split(".", 1)[1]):
                gate, up = zip(*(p.chunk(2, 0) for p in pieces))
                whole = torch.cat([*gate, *up], 0)
            else:
                whole = torch.cat(pieces, _shared_dim(name.split(".", 1)[1]))
            for r in range(t):
                parts[(r, pp)][name] = whole


def moe_key(rest: str) -> str:
    """Megatron-Core's module path in a layer of our ``mlp.moe.*`` name (router, shared experts; an expert stack
    names the prefix :func:`expert_entries` extends)."""
    return "mlp." + rest.removeprefix("mlp.moe.")


def layer_keys(rest: str, num_experts: int) -> list[str]:
    """Every key of a layer's module path our ``rest`` maps to: one, or one per expert for an expert stack."""
    key = moe_key(rest)
    if rest not in STACKS:
        return [key]
    fc = key.rsplit(".", 1)[1]
    return [f"mlp.experts.local_experts.{k}.{fc}.weight" for k in range(num_experts)]


def expert_entries(prefix: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """An expert stack ``[E, out, in]`` as Megatron-Core's per-expert ``SequentialMLP`` weights."""
    return {prefix + k: value[i] for i, k in enumerate(layer_keys(rest, value.shape[0]))}


def read_stack(model: dict, prefix: str, rest: str, num_experts: int) -> torch.Tensor:
    """The expert stack ``[E, out, in]`` of one layer from Megatron-Core's per-expert weights."""
    keys = [prefix + k for k in layer_keys(rest, num_experts)]
    missing = [k for k in keys if not isinstance(model.get(k), torch.Tensor)]
    if missing:
        grouped = any(k.startswith(prefix + "mlp.experts.") and "local_experts" not in k for k in model)
        why = (" (it holds grouped-GEMM experts: mlp.experts.weight1 or linear_fc1.weight0; only SequentialMLP's "
               "per-expert names are read)") if grouped else ""
        raise ConfigError(f"Megatron-Core checkpoint lacks {missing[0]}{why}")
    return torch.stack([model[k] for k in keys])


def te_extra(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The MLP's Transformer Engine modules with an ``_extra_state`` in layer ``layer`` (0-based)."""
    if not is_moe_layer(cfg, layer):
        return ("mlp.linear_fc1", "mlp.linear_fc2")
    out = tuple(f"mlp.experts.local_experts.{k}.linear_fc{j}" for k in range(cfg.moe.num_experts) for j in (1, 2))
    shared = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    return out + (shared if cfg.moe.moe_shared_expert_intermediate_size is not None else ())


def moe_args(cfg: ModelConfig) -> dict:
    """Megatron's MoE arguments for ``cfg`` as written (``num_experts`` None for a dense model)."""
    m = cfg.moe
    if m is None:
        return {"num_experts": None}
    out = {f.name: getattr(m, f.name) for f in fields(MoEConfig)}
    freq = m.moe_layer_freq
    out.update(moe_layer_freq=freq if isinstance(freq, int) else list(freq), moe_grouped_gemm=False,
               expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    return out


def with_moe(cfg: ModelConfig, args: argparse.Namespace | dict) -> ModelConfig:
    """``cfg`` with the experts Megatron's ``args`` describe (unchanged for a dense checkpoint)."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    if not a.get("num_experts"):
        return cfg
    ep, etp = a.get("expert_model_parallel_size") or 1, a.get("expert_tensor_parallel_size") or 1
    t = a.get("tensor_model_parallel_size") or 1
    if ep > 1 or (etp > 1 and t > 1):
        raise ConfigError(f"Megatron-Core checkpoint with expert parallel size {ep} and expert tensor parallel size "
                          f"{etp}: only whole experts in every file are read (convert it at EP 1 and expert tensor "
                          "parallel size 1 first)")
    given = {k: a[k] for k in _READ if a.get(k) is not None}
    if isinstance(given.get("moe_layer_freq"), list):
        given["moe_layer_freq"] = tuple(given["moe_layer_freq"])
    moe = MoEConfig(int(a["num_experts"]), **given)
    if moe.moe_router_enable_expert_bias:
        raise ConfigError("Megatron-Core checkpoint with --moe-router-enable-expert-bias: its expert bias is not "
                          "read (this project's exported weights do not hold it)")
    return replace(cfg, moe=moe)
