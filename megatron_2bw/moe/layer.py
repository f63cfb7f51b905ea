"""The MoE MLP: ``forward(x [s, b, h]) -> y [s, b, h]``, the contract of any MLP in a transformer layer.

Router -> dispatcher -> grouped experts -> combine, plus the shared experts. Built from a :class:`MoEConfig`
and an explicit expert-parallel process group (None: EP = 1). The balancing losses' gradient is injected into
this call's activations (schedule-agnostic); the call's statistics are ``last_stats`` for the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config.moe import MoEConfig
from ..tensor_parallel.recompute import checkpointed, replaying
from .dispatcher import make_dispatcher
from .experts import GroupedExperts
from .router import Router
from .shared import SharedExperts


@dataclass
class MoEStats:
    """One call's numbers for the log: Megatron-Core's loss names (values divided by their coefficients),
    this rank's assignments per expert (after dropping) and the assignments the capacity cut. Tensors, detached:
    reading them (``float``) is the logger's synchronisation, not the forward's."""

    losses: dict[str, torch.Tensor]
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor | None

    @property
    def max_over_mean(self) -> float:
        """The most loaded expert's tokens over the mean (1.0: perfectly balanced)."""
        t = self.tokens_per_expert.float()
        return float(t.max() / t.mean()) if t.sum() > 0 else 1.0


class MoELayer(nn.Module):
    """A mixture-of-experts MLP. ``gated``: SwiGLU experts (else GELU). ``ep_group``: the expert-parallel
    ranks (its size must be ``expert_model_parallel_size``); ``stats_group``: ranks sharing sequences (the
    balancing losses count their tokens together; None: this rank's)."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, *, gated: bool, ep_group=None, stats_group=None,
                 init_std: float = 0.02, output_init_std: float | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        if ep != cfg.expert_model_parallel_size:
            raise ValueError(f"the expert group has {ep} ranks, the config says --expert-model-parallel-size "
                             f"{cfg.expert_model_parallel_size}")
        self.cfg = cfg
        ffn = cfg.moe_ffn_hidden_size
        if ffn is None:
            raise ValueError("MoEConfig.moe_ffn_hidden_size is unresolved (build it through ModelConfig)")
        out_std = init_std if output_init_std is None else output_init_std
        self.router = Router(cfg, hidden_size, init_std=init_std, stats_group=stats_group, dtype=dtype)
        self.experts = GroupedExperts(cfg.num_local_experts, hidden_size, ffn, gated, init_std=init_std,
                                      use_grouped_mm=cfg.moe_grouped_gemm, dtype=dtype)
        if out_std != init_std:
            with torch.no_grad():
                self.experts.linear_fc2.normal_(0.0, out_std)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = (SharedExperts(hidden_size, shared, gated, cfg.moe_shared_expert_gate,
                                             init_std=init_std, dtype=dtype) if shared else None)
        self.dispatcher = make_dispatcher(cfg.moe_token_dispatcher_type, cfg.num_experts, ep_group)
        self.last_stats: MoEStats | None = None

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts."""
        first = self.dispatcher.first
        return range(first, first + self.cfg.num_local_experts)

    def set_aux_loss_scale(self, scale: float) -> None:
        """The gradient the balancing losses get per call (the main loss's: 1 / microbatches, the loss scale)."""
        self.router.aux_loss_scale = scale

    def forward(self, x: torch.Tensor, *, expert_bias: torch.Tensor | None = None,
                count_tokens: bool = True) -> torch.Tensor:
        """``x [s, b, h] -> [s, b, h]``. ``expert_bias``: route with this version of the bias (default: the
        router's buffer); ``count_tokens=False``: leave the bias update's counts alone (a recomputation)."""
        if not (self.cfg.moe_layer_recompute and self.training and torch.is_grad_enabled()):
            return self._forward(x, expert_bias, count_tokens, True)
        bias = self.router.expert_bias if expert_bias is None else expert_bias
        bias = None if bias is None else bias.detach().clone()  # the replay routes with the forward's bias
        calls = [0]

        def run(inp: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            first = calls[0] == 1  # the replay in backward neither counts tokens again nor replaces the stats
            return self._forward(inp, bias, count_tokens and first, first)

        return checkpointed(run, x, tracker=None)

    def _forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None, count_tokens: bool,
                 record: bool) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        route = self.router(tokens, s, b, expert_bias=expert_bias, count_tokens=count_tokens)
        shared = self.shared_experts
        overlap = shared is not None and self.cfg.moe_shared_expert_overlap  # each half beside one all-to-all
        rows, counts, handle = self.dispatcher.dispatch(tokens, route.routing_map, route.probs,
                                                        (lambda: shared.first(tokens)) if overlap else None)
        y = self.dispatcher.combine(self.experts(rows, counts), handle,
                                    (lambda: shared.second(*handle.during_dispatch)) if overlap else None)
        if shared is not None:
            y = y + (handle.during_combine if overlap else shared(tokens))
        if record and self.training and not replaying():  # once per microbatch: its first forward
            self.last_stats = MoEStats(route.losses, route.tokens_per_expert.detach(), route.dropped)
        return y.view(s, b, h).to(x.dtype)


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Every MoE layer under ``module`` gives its balancing losses the gradient ``scale``."""
    for m in module.modules():
        if isinstance(m, MoELayer):
            m.set_aux_loss_scale(scale)
