"""The mixture-of-experts MLP as a block of the transformer layer (``transformer.MLPS["moe"]``).

The MoE layer itself (``megatron_2bw/moe/``) takes ``[s, b, h]`` tokens and an expert-parallel group; this
block fits it to the layer: activations are batch-first ``[b, s, h]`` here, and under sequence parallelism a
rank holds ``s / t`` of the positions. Experts are not split over the tensor group (expert tensor parallel
size 1): every tensor rank runs the whole MoE on the whole sequence (gathered in, its own shard taken out,
backward the reverse without a reduction), so its replicated weights get the whole gradient on every rank
and stay equal, as a replicated norm's do.

Parameters are declared through :class:`~..tensor_parallel.init.Init`, so their values do not depend on the
layout: the expert stacks ``[E, out, in]`` are drawn whole, keyed by name (each global expert id its rows),
and cut to this rank's experts (``expert=(0, ep_rank, e)``), in the expert-data reduction domain
(``edp``); the router and the shared experts are dense (``dp``). The 3-D stacks carry ``expert_stack``,
which Muon reads to orthogonalise each expert's matrix alone.

Layers that ``--moe-layer-freq`` leaves dense get the dense MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig
from ..moe.layer import MoELayer
from ..parallel_state import EXPERT_DATA
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.init import Init, parameter


@dataclass(frozen=True)
class MoEGroups:
    """The process groups an MoE layer needs: the expert-parallel group (None: EP = 1), this rank's place in
    it, and the ranks holding other parts of the same sequences (the context group; None: whole sequences)."""

    ep_group: object | None = None
    ep_rank: int = 0
    ep_size: int = 1
    stats_group: object | None = None

    def __deepcopy__(self, memo) -> MoEGroups:
        return self  # process-group handles: copies of a model share them

    @classmethod
    def from_state(cls, state) -> MoEGroups:
        """From a :class:`~..parallel_state.ParallelState` (its ``ep_group`` and context group)."""
        return cls(state.groups.ep if state.e > 1 else None, state.ep_rank, state.e,
                   state.groups.cp if state.c > 1 else None)


class _GatherSeqReplicated(torch.autograd.Function):
    """``[b, s/t, h]`` -> ``[b, s, h]``; backward: this rank's slice of a whole (not partial) gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x.contiguous(), group=tp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.chunk(ctx.tp.size, dim=1)[ctx.tp.rank].contiguous(), None


class _TakeSeqShard(torch.autograd.Function):
    """``[b, s, h]`` (the same on every tensor rank) -> this rank's ``[b, s/t, h]``; backward: gathered."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return y.chunk(tp.size, dim=1)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        parts = [torch.empty_like(g) for _ in range(ctx.tp.size)]
        dist.all_gather(parts, g.contiguous(), group=ctx.tp.group)
        return torch.cat(parts, dim=1), None


class MoEMLP(nn.Module):
    """The transformer layer's MLP slot holding an :class:`MoELayer` (``self.moe``)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, prefix: str, groups: MoEGroups) -> None:
        super().__init__()
        moe = cfg.moe
        self.tp, self.index = tp, int(prefix.split(".")[1])  # the layer's global index (the log's)
        self.gather = cfg.sequence_parallel and tp.size > 1
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.moe = MoELayer(moe, cfg.hidden_size, gated=cfg.swiglu, ep_group=groups.ep_group,
                            stats_group=groups.stats_group)
        _declare(self.moe, f"{prefix}.moe", seed, cfg.init_method_std, out_std, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather:
            x = _GatherSeqReplicated.apply(x, self.tp)
        y = self.moe(x.transpose(0, 1)).transpose(0, 1)
        return _TakeSeqShard.apply(y, self.tp) if self.gather else y.contiguous()


def _declare(moe: MoELayer, prefix: str, seed: int, std: float, out_std: float, groups: MoEGroups) -> None:
    """Replace the layer's parameters by layout-independent ones (module docstring)."""
    e = groups.ep_size
    for name, p in list(moe.named_parameters()):
        full = list(p.shape)
        expert = name.startswith("experts.")
        if expert:
            full[0] *= e
        fc2 = name.endswith(("linear_fc2", "linear_fc2.weight"))
        init = Init(f"{prefix}.{name}", seed, tuple(full), out_std if fc2 else std,
                    domain=EXPERT_DATA if expert else "dp", expert=(0, groups.ep_rank, e) if expert else None)
        q = parameter(init)
        if expert:
            q.expert_stack = True
        mod = moe.get_submodule(name.rpartition(".")[0]) if "." in name else moe
        mod._parameters[name.rpartition(".")[2]] = q


def is_moe_layer(cfg: ModelConfig, prefix: str) -> bool:
    """Whether the layer named by ``prefix`` (``layers.<i>.mlp``) holds experts (``--moe-layer-freq``)."""
    index = int(prefix.split(".")[1])
    return cfg.moe is not None and cfg.moe.moe_layers(cfg.num_layers)[index]
