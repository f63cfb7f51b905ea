"""The layout sections: tensor/pipeline/data parallel sizes and the pipeline engine's schedule and microbatching."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule.recompute_policy import check_recompute
from ..schedule.schedules import SCHEDULE_NAMES, ScheduleSpec, get_schedule
from .axes import Axes
from .context import CP_COMM_TYPES, P2P
from .optim import AUTO_COMPENSATION, COMPENSATIONS
from .rules import _require


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: tensor ``t``, pipeline depth ``d``, data width ``w``, context ``c``; world = t*c*w*d.

    Context parallelism (``--context-parallel-size``) shards every sequence over ``c`` ranks (attention
    exchanges keys and values by ``--cp-comm-type``); the ``c`` ranks hold the same weights, so they reduce
    gradients together with the data-parallel replicas (Megatron's data-parallel group with context parallel).
    """

    tensor: int = 1
    pipeline: int = 1
    data: int | None = None  # None: derived from the world size
    context: int = 1
    cp_comm_type: str = P2P

    def __post_init__(self) -> None:
        _require(self.tensor >= 1, f"--tensor-model-parallel-size must be >= 1, got {self.tensor}")
        _require(self.pipeline >= 1, f"--pipeline-model-parallel-size must be >= 1, got {self.pipeline}")
        _require(self.data is None or self.data >= 1, f"data-parallel size must be >= 1, got {self.data}")
        _require(self.context >= 1, f"--context-parallel-size must be >= 1, got {self.context}")
        _require(self.cp_comm_type in CP_COMM_TYPES,
                 f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}")

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``data`` derived from the world size, refusing a layout that does not divide."""
        tp = self.tensor * self.pipeline * self.context
        cp = f" x context-parallel-size {self.context}" if self.context > 1 else ""
        _require(
            world_size % tp == 0,
            f"world size {world_size} is not divisible by tensor-model-parallel-size {self.tensor} "
            f"x pipeline-model-parallel-size {self.pipeline}{cp}",
        )
        w = world_size // tp
        _require(
            self.data is None or self.data == w,
            f"world size {world_size} != tensor {self.tensor} x pipeline {self.pipeline}{cp} x data {self.data}",
        )
        return ParallelConfig(self.tensor, self.pipeline, w, self.context, self.cp_comm_type)

    def axes(self, expert: int = 1, virtual: int = 1) -> Axes:
        """The resolved layout as its named axes (``expert`` and ``virtual`` come from the MoE and pipeline
        sections)."""
        _require(self.data is not None, "ParallelConfig.data is unresolved; call resolve(world_size)")
        return Axes(tensor=self.tensor, context=self.context, expert=expert, data=self.data, pipeline=self.pipeline,
                    virtual=virtual)

    @property
    def world_size(self) -> int:
        return self.axes().world

    def describe(self) -> str:
        """The layout as both start-up lines print it: ``t=1 d=2 w=1 c=2 (p2p) (4 processes``."""
        cp = f" c={self.context} ({self.cp_comm_type})" if self.context > 1 else ""
        n = self.world_size
        return f"t={self.tensor} d={self.pipeline} w={self.data}{cp} ({n} process{'es' if n > 1 else ''}"


P2P_MODES = ("auto", "prefetch", "grouped")


@dataclass(frozen=True)
class PipelineConfig:
    """Schedule, microbatching and memory options of the pipeline engine."""

    schedule: str = "2bw"
    micro_batch_size: int = 1
    num_microbatches: int = 1  # m: microbatches per optimizer step per pipeline
    recompute: bool = False
    track_memory: bool = True  # measure stashed activation bytes via saved-tensor hooks
    # stage-to-stage transfers: "prefetch" posts receives ahead (gloo), "grouped" issues each run of
    # transfers with one peer as one batch_isend_irecv group (required by NCCL); "auto" picks by backend
    p2p_mode: str = "auto"
    compensation: str = "none"  # 2BW only: none, predict, dc, ef or extrapolate (pipeline/compensation.py)
    dc_lambda: float = 0.04  # lambda of compensation "dc"
    # gamma of "ef" (applied D_t + gamma (D_t - D_{t-1})) and of "extrapolate" (g_t + gamma (g_t - g_{t-1}))
    ef_scale: float = 1.0
    # transformer layers of each stage (schedule/stages.py); None: the even split
    layer_split: tuple[int, ...] | None = None
    # recomputation inside a stage (schedule/recompute_policy.py); ``recompute`` re-runs whole stages
    recompute_granularity: str | None = None  # full or selective
    recompute_method: str | None = None  # uniform or block (full only)
    recompute_num_layers: int | None = None
    # model chunks per rank (Megatron's --virtual-pipeline-model-parallel-size; interleaved-1f1b); None: the
    # schedule's own count (1 for the one-chunk schedules, 2 for interleaved-1f1b)
    virtual_stages: int | None = None
    # --enable-optimizer-post-validation: speculative updates checked in the next step's warm-up (zb-h1, zb-h2, zb-v)
    post_validation: bool = False

    @property
    def chunks(self) -> int:
        """Model chunks per rank the schedule runs."""
        return self.spec.chunks

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule as this configuration runs it (its chunks, its post-validation): resolved once, where
        the configuration is built; every later reader takes it from here."""
        return self._spec

    def __post_init__(self) -> None:
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(int(n) for n in self.layer_split))
        check_recompute(self.recompute, self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        _require(
            self.schedule in SCHEDULE_NAMES,
            f"--pipeline-schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}",
        )
        _require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _require(self.num_microbatches >= 1, f"microbatches per step must be >= 1, got {self.num_microbatches}")
        _require(self.p2p_mode in P2P_MODES, f"--p2p-mode must be one of {', '.join(P2P_MODES)}, got {self.p2p_mode!r}")
        _require(
            self.compensation in COMPENSATIONS + (AUTO_COMPENSATION,),
            f"--2bw-compensation must be one of {', '.join(COMPENSATIONS + (AUTO_COMPENSATION,))}, "
            f"got {self.compensation!r}",
        )
        # the one lookup of --pipeline-schedule; refuses chunks or post-validation the schedule does not take
        object.__setattr__(self, "_spec", get_schedule(self.schedule, self.virtual_stages, self.post_validation))
        _require(
            self.compensation in ("none", AUTO_COMPENSATION) or self._spec.stale_steps > 0,
            f"--2bw-compensation {self.compensation} only applies to --pipeline-schedule 2bw, not {self.schedule}",
        )
        _require(math.isfinite(self.dc_lambda) and self.dc_lambda >= 0,
                 f"--2bw-dc-lambda must be finite and >= 0, got {self.dc_lambda}")
        _require(math.isfinite(self.ef_scale) and self.ef_scale >= 0,
                 f"--2bw-ef-scale must be finite and >= 0, got {self.ef_scale}")

    def check_depth(self, d: int) -> None:
        """Refuse fewer microbatches per step than the schedule needs at depth ``d``."""
        need = self.spec.min_microbatches(d)
        m = self.num_microbatches
        at_least = f"d microbatches per step: m={m} < d={d}" if need == d else f"{need} microbatches per step: m={m}"
        _require(
            m >= need,
            f"PipeDream-{self.schedule.upper()} needs at least {at_least} "
            "(raise --global-batch-size or lower --micro-batch-size)",
        )
        self.spec.check_layout(d, m)


