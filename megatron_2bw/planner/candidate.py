"""One point of the planner's search (``Candidate``) and the bytes each parameter costs (``ParamBytes``).

``data_parallel`` is the data width ``w`` (replicas that read different data); with context parallelism
(``context_parallel`` c > 1, ``--context-parallel-size``) every sequence is sharded over c ranks that hold
the same weights, so the world is ``t * c * w * d`` and the weights have ``w * c`` replicas (``replicas``:
what the gradient reduction and the distributed optimizer's shards span), as in Megatron's data group with
context parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from ..config import fp32_grads_for, resolve_compensation
from ..config.axes import Axes
from ..config.context import P2P
from ..errors import ConfigError
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.schedules import SCHEDULES, parse_schedule_id, validate_pipeline
from .context_costs import PLANNED_CP_COMM_TYPES
from .spec_cache import spec_of

# Inter-layer model parallelism without pipelining: one microbatch at a time through the stages.
# A baseline of the paper's comparison, not a schedule of the trainer.
SEQUENTIAL = "sequential"


@dataclass(frozen=True)
class Candidate:
    """One point of the search: the layout (t, d, w, c), microbatch b, m per batch, recompute, schedule."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    recompute: bool
    schedule: str
    layer_split: tuple[int, ...] | None = None  # layers per stage; None: the even split
    # recomputation inside each stage (Megatron's --recompute-granularity); ``recompute``: whole stages
    recompute_policy: RecomputePolicy | None = None
    # ZeRO-1: master and optimizer state sharded over the w replicas (a no-op at w = 1)
    distributed_optimizer: bool = False
    async_save: bool = False  # --async-save: a host copy of what each rank writes (StageMemory.host_save)
    # --sequence-parallel (t > 1): norms, dropout and the residual stream sharded over the tensor group;
    # its costs (a layer's whole stash over t, sharded stage inputs) are ``LayerCosts.at(..., True)``'s
    sequence_parallel: bool = False
    # --context-parallel-size c and --cp-comm-type: every sequence sharded over c weight replicas (module
    # docstring); its costs are ``LayerCosts.at(..., context=(c, cp_comm_type))``'s (planner/context_costs.py)
    context_parallel: int = 1
    cp_comm_type: str = P2P
    # --expert-model-parallel-size e: a model's experts spread over e adjacent ranks of the w * c replicas (each
    # holds E/e of them; planner/moe_costs.py); 1 for a dense model
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(int(n) for n in self.layer_split))
        if self.recompute_policy is not None and not self.recompute_policy.active:
            object.__setattr__(self, "recompute_policy", None)
        if self.recompute and self.recompute_policy is not None:
            raise ConfigError("use either --recompute-activations (whole stages) or --recompute-granularity")
        if self.cp_comm_type not in PLANNED_CP_COMM_TYPES:
            raise ConfigError(f"the planner prices --cp-comm-type {' and '.join(PLANNED_CP_COMM_TYPES)}, "
                              f"got {self.cp_comm_type!r}")
        for key in ("tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch_size", "num_micro_batches",
                    "context_parallel", "expert_parallel"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        name, pv = parse_schedule_id(self.schedule)
        if name not in (*SCHEDULES, SEQUENTIAL):  # the registry as it is now (tests add schedules)
            raise ConfigError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != SEQUENTIAL:
            validate_pipeline(name, self.pipeline_parallel, self.num_micro_batches, post_validation=pv)
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        self.axes  # noqa: B018 - the named axes validate themselves (experts folded inside data x context)

    @cached_property
    def axes(self) -> Axes:
        """The candidate's layout as the trainer's named axes (``virtual``: the schedule's chunks per rank)."""
        chunks = 1 if self.schedule == SEQUENTIAL else spec_of(self.schedule).chunks
        return Axes(tensor=self.tensor_parallel, context=self.context_parallel, expert=self.expert_parallel,
                    data=self.data_parallel, pipeline=self.pipeline_parallel, virtual=chunks)

    @property
    def num_gpus(self) -> int:
        return self.axes.world

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: the data width times the context ranks (module docstring)."""
        return self.axes.replicas

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (the expert-data group): the replicas over the expert-parallel size."""
        return self.axes.expert_data

    @property
    def context(self) -> tuple[int, str] | None:
        """``(c, cp_comm_type)`` for ``LayerCosts.at``; None without context parallelism."""
        return (self.context_parallel, self.cp_comm_type) if self.context_parallel > 1 else None

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.data_parallel


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of each copy kept (``grad``: per gradient buffer); ``per_param`` is the
    usual 16 of mixed-precision Adam with fp16 gradients."""

    weight: int = 2
    grad: int = 2
    master: int = 4
    optimizer_state: int = 8
    stale_correction: int = 0  # the 2BW compensation's state (2BW candidates only; module docstring)
    # bytes of optimizer state fewer per element of a Muon matrix (--optimizer muon: one fp32 momentum
    # buffer instead of Adam's two moments; the transformer layers' weights, see muon_matrix_numel)
    muon_saving: int = 0

    @classmethod
    def for_precision(cls, precision: str, fp32_grads: bool | None = None, compensation: str = "none",
                      optimizer: str = "adam") -> "ParamBytes":
        """The copies of ``precision``; ``fp32_grads`` None: that precision's default accumulation;
        ``compensation``: the run's ``--2bw-compensation``; ``optimizer``: ``--optimizer`` (muon: 4 bytes
        less state per matrix element)."""
        # auto: the trainer's default for a 2BW stage (replicated optimizer; predict costs nothing in half
        # precision and is what auto picks there, and with the distributed optimizer auto picks none: 0 too)
        # auto resolves per schedule; these bytes are what a stale-gradient schedule pays (the others pay none:
        # compensation_bytes), so resolve as for one staleness step
        compensation = resolve_compensation(compensation, 1, optimizer, precision, False)
        if optimizer == "muon":
            return replace(cls.for_precision(precision, fp32_grads, compensation), muon_saving=4)
        if precision not in ("fp16", "bf16", "fp32"):
            raise ConfigError(f"unknown precision {precision!r}; choose one of fp16, bf16, fp32")
        extra = 4 if compensation in ("ef", "extrapolate") or (compensation == "predict" and precision == "fp32") else 0
        if precision in ("fp16", "bf16"):
            return cls(2, 4 if fp32_grads_for(precision, fp32_grads) else 2, 4, 8, extra)
        return cls(4, 4, 0, 8, extra)

    @property
    def per_param(self) -> int:
        return self.weight + self.grad + self.master + self.optimizer_state
