"""The router: a linear gate ``[E, H]``, top-k routing, the load-balancing losses injected per call, and the
aux-loss-free expert bias as explicit, versionable state.

State a caller may version (2BW keeps two weight versions; a microbatch's forward, recomputation and backward
must route alike): ``expert_bias`` (a buffer, never trained; ``forward(..., expert_bias=...)`` takes another
version's) and ``local_tokens_per_expert`` (the counts the next bias update reads, accumulated once per microbatch
in training: in its first forward, with gradients or not (a pipeline that recomputes runs it without), never in a
replay (:func:`~..tensor_parallel.recompute.replaying`) or with ``count_tokens=False``). The update,
``bias += rate * sign(mean_count - count)``, is :func:`updated_expert_bias`, applied once per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config.moe import MoEConfig
from ..tensor_parallel.recompute import replaying
from .capacity import drop_tokens
from .losses import inject_loss, sequence_aux_loss, switch_aux_loss, z_loss
from .routing import dense_routing, scores_for_aux_loss, topk_routing

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Routing:
    """One call's routing: ``probs``/``routing_map`` ``[T, E]`` (after any dropping), the router logits, and
    the statistics for the log (loss values divided by their coefficients, as Megatron-Core logs them)."""

    probs: torch.Tensor
    routing_map: torch.Tensor
    logits: torch.Tensor
    tokens_per_expert: torch.Tensor  # this rank's kept assignments per expert
    dropped: torch.Tensor | None = None  # assignments cut by the capacity (a tensor: read it when logging)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)


def updated_expert_bias(tokens_per_expert: torch.Tensor, bias: torch.Tensor, rate: float) -> torch.Tensor:
    """``bias + rate * sign(mean - count)``: under-loaded experts become more likely, over-loaded less."""
    mean = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return bias + torch.sign(mean - tokens_per_expert) * rate


def _reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


class _Shared:
    """A process-group handle that copies of the model (2BW's weight versions) share: a group cannot be copied."""

    def __init__(self, group) -> None:
        self.group = group

    def __deepcopy__(self, memo) -> "_Shared":
        return self


class Router(nn.Module):
    """Top-k router of one MoE layer. ``stats_group``: the ranks that hold parts of the same sequences (tensor
    x context with sequence or context parallelism), over which the balancing losses count tokens."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, *, init_std: float = 0.02, stats_group=None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg, self._stats = cfg, _Shared(stats_group)
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype))
        with torch.no_grad():
            self.weight.normal_(0.0, init_std)
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.aux_loss_scale = 1.0  # the gradient the losses receive: 1 / microbatches x the loss scale

    @property
    def stats_group(self):
        return self._stats.group

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _ROUTER_DTYPES[self.cfg.moe_router_dtype] or x.dtype
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def forward(self, x: torch.Tensor, seq_length: int, batch: int, *, expert_bias: torch.Tensor | None = None,
                count_tokens: bool = True) -> Routing:
        """Route ``x [s * b, H]`` (tokens ordered ``[s, b]``)."""
        c = self.cfg
        logits = self.gating(x)
        # the losses' gradient goes in wherever gradients are recorded; their values are logged once per
        # microbatch, in its first forward (which runs without gradients when the pipeline recomputes)
        inject = self.training and torch.is_grad_enabled()
        with_losses = inject or (self.training and not replaying())
        losses: dict[str, torch.Tensor] = {}
        if with_losses and c.moe_z_loss_coeff:
            coeff = c.moe_z_loss_coeff / self._group_size()
            zl = z_loss(logits, coeff)
            logits = inject_loss(logits, zl, self.aux_loss_scale) if inject else logits
            losses["z_loss"] = zl.detach() / coeff
        bias = self.expert_bias if expert_bias is None else expert_bias
        top_p, top_i = topk_routing(
            logits, c.moe_router_topk, score_function=c.moe_router_score_function,
            pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor, expert_bias=bias)
        probs, routing_map = dense_routing(top_p, top_i, c.num_experts)
        dropped = None
        if c.moe_expert_capacity_factor is not None:
            before = routing_map
            probs, routing_map = drop_tokens(probs, routing_map, c.moe_router_topk, c.moe_expert_capacity_factor,
                                             c.moe_token_drop_policy, c.moe_pad_expert_input_to_capacity)
            dropped = (before & ~routing_map).sum()
        if with_losses and c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0:
            probs = self._balancing_loss(probs, logits, seq_length, batch, losses, inject)
        counts = routing_map.sum(dim=0)
        if self.local_tokens_per_expert is not None and self.training and count_tokens and not replaying():
            with torch.no_grad():
                self.local_tokens_per_expert += counts.to(self.local_tokens_per_expert.dtype)
        return Routing(probs, routing_map, logits, counts, dropped, losses)

    def _group_size(self) -> int:
        return 1 if self.stats_group is None else dist.get_world_size(self.stats_group)

    def _balancing_loss(self, probs: torch.Tensor, logits: torch.Tensor, seq_length: int, batch: int,
                        losses: dict[str, torch.Tensor], inject: bool = True) -> torch.Tensor:
        """The aux loss or the sequence aux loss on the balancing scores, injected into ``probs``."""
        c = self.cfg
        aux_map, scores = scores_for_aux_loss(logits, c.moe_router_topk, c.moe_router_score_function)
        coeff, g = c.moe_aux_loss_coeff, self._group_size()
        if c.moe_router_load_balancing_type == "aux_loss":
            counts = _reduce(aux_map.sum(dim=0), self.stats_group)
            loss = switch_aux_loss(scores, counts, aux_map.shape[0] * g, c.moe_router_topk, c.num_experts, coeff)
            name = "load_balancing_loss"
        else:
            counts = _reduce(aux_map.reshape(seq_length, -1).sum(dim=0), self.stats_group)
            loss = sequence_aux_loss(scores, aux_map, seq_length, batch, c.moe_router_topk, c.num_experts, coeff,
                                     group_size=g, counts=counts)
            name = "seq_load_balancing_loss"
        losses[name] = loss.detach() / coeff
        return inject_loss(probs, loss, self.aux_loss_scale) if inject else probs

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """One optimizer step's bias update from the counts since the last (summed over ``group``: the data x
        context x tensor ranks that route the same layer), then the counts restart."""
        if self.expert_bias is None:
            return
        counts = _reduce(self.local_tokens_per_expert, group)
        self.expert_bias.copy_(updated_expert_bias(counts, self.expert_bias, self.cfg.moe_router_bias_update_rate))
        self.local_tokens_per_expert.zero_()
