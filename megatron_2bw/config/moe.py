"""The mixture-of-experts section: Megatron-Core's MoE fields with their names and defaults, checked where built.

``MoEConfig`` is what ``--num-experts`` and the ``--moe-*`` flags fill (``flags.py``); ``None`` on the model
config means a dense model. Megatron flags that are not built here (an expert-tensor-parallel size other than 1,
the ``flex`` dispatcher, sinkhorn and global aux losses) are refused in one line rather than ignored. The check that
needs the world (the expert-parallel size dividing data x context) is the layout's (``config/axes.py``), made
once the run config resolves it. Torch-free.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import ConfigError
from .rules import _require, _require_finite

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHER_TYPES = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = ("fp32", "fp64")
# Megatron-Core values that parse but are not built here: refused in one line, never silently replaced
_NOT_BUILT = {"moe_token_dispatcher_type": ("flex",), "moe_router_load_balancing_type": ("sinkhorn", "global_aux_loss")}


@dataclass(frozen=True)
class MoEConfig:
    """Megatron-Core's MoE fields (``TransformerConfig``'s names, ``num_moe_experts`` spelt as its flag)."""

    num_experts: int
    moe_ffn_hidden_size: int | None = None  # None: the model's --ffn-hidden-size
    moe_layer_freq: int | tuple[int, ...] = 1  # every N-th layer (0-based i % N == 0), or one 0/1 per layer
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False  # softmax over all experts before top-k (no renormalisation)
    moe_router_num_groups: int | None = None  # group-limited (device/node-limited) routing
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_dtype: str | None = None  # None: the input's dtype; fp32 or fp64 routing
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3)
    moe_router_bias_update_rate: float = 1e-3
    moe_token_dispatcher_type: str = "allgather"  # Megatron-Core's default
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: int | None = None  # all shared experts together
    moe_shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x w) scales the shared experts' output
    moe_shared_expert_overlap: bool = False  # the shared experts run while the dispatch all-to-all is in flight
    moe_grouped_gemm: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1  # only 1 is built
    moe_layer_recompute: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        _require_finite(self)
        self._check_not_built()
        self._check_choices()
        self._check_routing()
        self._check_capacity()
        _require(self.moe_ffn_hidden_size is None or self.moe_ffn_hidden_size > 0,
                 f"--moe-ffn-hidden-size must be positive, got {self.moe_ffn_hidden_size}")
        s = self.moe_shared_expert_intermediate_size
        _require(s is None or s > 0, f"--moe-shared-expert-intermediate-size must be positive, got {s}")
        _require(not self.moe_shared_expert_gate or s is not None,
                 "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        # Megatron-Core's rule: with shared experts the overlap needs the all-to-all dispatcher (without them the
        # flag has nothing to overlap and is accepted, as there)
        _require(not (self.moe_shared_expert_overlap and s is not None
                      and self.moe_token_dispatcher_type != "alltoall"),
                 "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type alltoall")
        f = self.moe_layer_freq
        if isinstance(f, int):
            _require(f >= 1, f"--moe-layer-freq must be >= 1, got {f}")
        else:
            _require(len(f) > 0 and all(v in (0, 1) for v in f), f"--moe-layer-freq list must hold 0s and 1s, got {f}")

    def _check_not_built(self) -> None:
        _require(self.expert_tensor_parallel_size == 1,
                 f"--expert-tensor-parallel-size {self.expert_tensor_parallel_size} is not supported (only 1: experts "
                 "are not sharded over the tensor group)")
        for name, values in _NOT_BUILT.items():
            v = getattr(self, name)
            _require(v not in values, f"--{name.replace('_', '-')} {v} is not supported; choose one of "
                     f"{', '.join(_CHOICES[name])}")

    def _check_choices(self) -> None:
        for name, choices in _CHOICES.items():
            v = getattr(self, name)
            _require(v in choices, f"--{name.replace('_', '-')} must be one of {', '.join(map(str, choices))}, "
                     f"got {v!r}")

    def _check_routing(self) -> None:
        e, k, ep = self.num_experts, self.moe_router_topk, self.expert_model_parallel_size
        _require(e >= 1, f"--num-experts must be >= 1, got {e}")
        _require(ep >= 1, f"--expert-model-parallel-size must be >= 1, got {ep}")
        _require(e % ep == 0, f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}")
        _require(1 <= k <= e, f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
        g, gk = self.moe_router_num_groups, self.moe_router_group_topk
        _require((g is None) == (gk is None), "--moe-router-num-groups and --moe-router-group-topk go together")
        if g is not None:
            _require(g >= 1 and e % g == 0, f"--moe-router-num-groups {g} does not divide --num-experts {e}")
            _require(1 <= gk <= g, f"--moe-router-group-topk {gk} must be between 1 and --moe-router-num-groups {g}")
            _require(k % gk == 0 and k // gk <= e // g,
                     f"--moe-router-topk {k} must be a multiple of --moe-router-group-topk {gk} with at most "
                     f"{e // g} experts (one group) per selected group")
        sf = self.moe_router_topk_scaling_factor
        _require(sf is None or sf > 0, f"--moe-router-topk-scaling-factor must be positive, got {sf}")
        _require(not self.moe_router_enable_expert_bias or self.moe_router_score_function == "sigmoid",
                 "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        _require(not (self.moe_router_pre_softmax and self.moe_router_score_function == "sigmoid"),
                 "--moe-router-pre-softmax applies to --moe-router-score-function softmax only")
        _require(self.moe_aux_loss_coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        z = self.moe_z_loss_coeff
        _require(z is None or z >= 0, f"--moe-z-loss-coeff must be >= 0, got {z}")
        _require(self.moe_router_bias_update_rate >= 0,
                 f"--moe-router-bias-update-rate must be >= 0, got {self.moe_router_bias_update_rate}")

    def _check_capacity(self) -> None:
        c = self.moe_expert_capacity_factor
        _require(c is None or c > 0, f"--moe-expert-capacity-factor must be > 0, got {c}")
        _require(not self.moe_pad_expert_input_to_capacity or c is not None,
                 "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.expert_model_parallel_size

    def moe_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which of the model's layers (0-based) hold an MoE MLP (Megatron's ``moe_layer_freq`` rule)."""
        f = self.moe_layer_freq
        if isinstance(f, int):
            return tuple(i % f == 0 for i in range(num_layers))
        _require(len(f) == num_layers, f"--moe-layer-freq lists {len(f)} layers, the model has {num_layers}")
        return tuple(bool(v) for v in f)

    def for_model(self, num_layers: int, ffn_hidden_size: int) -> MoEConfig:
        """This config checked against the model's depth, the expert FFN size resolved (Megatron's default)."""
        self.moe_layers(num_layers)
        return self if self.moe_ffn_hidden_size is not None else replace(self, moe_ffn_hidden_size=ffn_hidden_size)


_CHOICES: dict[str, tuple[Any, ...]] = {
    "moe_router_score_function": SCORE_FUNCTIONS, "moe_router_load_balancing_type": LOAD_BALANCING_TYPES,
    "moe_token_dispatcher_type": DISPATCHER_TYPES, "moe_token_drop_policy": DROP_POLICIES,
    "moe_router_dtype": (None, *ROUTER_DTYPES),
}


def moe_config_of(value: MoEConfig | Mapping[str, Any] | None) -> MoEConfig | None:
    """A model config's ``moe`` field as stored (a dict in a checkpoint's JSON) or given."""
    if value is None or isinstance(value, MoEConfig):
        return value
    known = {f.name for f in fields(MoEConfig)}
    unknown = sorted(set(value) - known)
    _require(not unknown, f"unknown MoE config field {unknown[0] if unknown else ''!r}")
    return MoEConfig(**value)


def parse_moe_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an int, or a list as Megatron writes it (``[0,1,1]``, ``([0]*3+[1]*58)``)."""
    try:
        value = _eval_list_expr(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ConfigError(f"--moe-layer-freq takes an int or a list like ([0]*3+[1]*5), got {text!r}") from e
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ConfigError(f"--moe-layer-freq takes an int or a list like ([0]*3+[1]*5), got {text!r}")
    return value if isinstance(value, int) else tuple(value)


def format_moe_layer_freq(value: int | tuple[int, ...]) -> str:
    return str(value) if isinstance(value, int) else "[" + ",".join(map(str, value)) + "]"


def _eval_list_expr(node: ast.AST) -> int | list[int]:
    """Integers, list literals of integers, ``+`` and ``*`` only (no names, no calls)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        items = [_eval_list_expr(e) for e in node.elts]
        if not all(isinstance(i, int) for i in items):
            raise ValueError("nested list")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        a, b = _eval_list_expr(node.left), _eval_list_expr(node.right)
        if isinstance(node.op, ast.Add) and type(a) is type(b):
            return a + b
        if isinstance(node.op, ast.Mult) and (isinstance(a, int) or isinstance(b, int)):
            return a * b
    raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")
