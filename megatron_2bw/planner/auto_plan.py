"""``--auto-plan``: profile the model on this device (or read a saved profile), then run the search.

    choice = auto_plan(model_cfg, num_gpus=64, global_batch=512, cluster="dgx-h200",
                       profile_path="gpt-2.2b.profile.json", precision="bf16")
    t, d, w, b, recompute, schedule, split, zero, policy = choice   # split: layers per stage (None: even)
                                                             # zero: --use-distributed-optimizer
                                                             # policy: recomputation inside stages (None: none)

The search tries Megatron's selective and per-layer recomputation inside stages too
(``recompute_policies``, default ``search.FINER_RECOMPUTE``), beside none and whole stages; the choice's
``recompute_policy`` becomes ``--recompute-granularity/-method/-num-layers`` in its ``layout``.

``profile_path``: read it if it exists; otherwise profile here and write it there, so a job array
profiles once and every later job reuses the file (profile on the kind of GPU you will train on).
Without ``profile_path`` the profile is measured and kept in memory only.

What a single device can measure: ``t = 1`` (``tensor_parallel=(1,)``, the default). Larger ``t``
need ``t`` local devices (``tensor_parallel=(1, 2, 4, 8)`` spawns one process per device, see
``profiler.profile_tensor_parallel``). The search only considers the ``(t, b)`` pairs a profile has.

``cluster``: a ``Cluster``, a preset name or a JSON file (``hardware.py``). ``None`` picks the preset
whose device name matches this GPU (H200, H100, A100, V100) with the device's real memory, or on a
CPU a description of this host (its memory; rough bandwidths) - fine for tests and demos, state a
real cluster for anything else. The chosen plan and where its numbers came from are logged.

The trainer's ``--auto-plan`` plans before ``init_process_group`` (``training/auto_layout.py``),
every rank from the same profile file. Code already inside ``torch.distributed`` can call
:func:`auto_plan_on_rank0` instead: rank 0 plans and broadcasts, so every rank gets the same layout.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from ..config import Layout, ModelConfig
from ..config.axes import Axes
from ..config.context import P2P
from ..errors import ConfigError
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.schedules import SCHEDULE_NAMES
from ..schedule.stages import format_split
from .efficiency import EfficiencyCurve
from .hardware import Cluster, GiB, load_cluster
from .layer_costs import LayerCosts, load_profile  # noqa: F401 - re-exported
from .peaks import DEVICE_PRESETS, PEAK_VARIANTS  # noqa: F401 - DEVICE_PRESETS re-exported
from .profile_check import load_checked_profile
from .search import (
    DEFAULT_MEMORY_MARGIN,
    FINER_RECOMPUTE,
    PlanRequest,
    SearchResult,
    micro_batch_sizes,
    search,
    with_context_costs,
)

log = logging.getLogger(__name__)
AUTO_PLAN_TOP = 10  # plans of the search a run keeps (``AutoPlan.result.ranked``): the best and its runners-up

# Substrings of torch.cuda.get_device_name -> shipped cluster preset.


class PlanChoice(NamedTuple):
    """What the trainer needs: tensor, pipeline and data parallel sizes, microbatch, recompute, schedule,
    the layers of each stage (``None``: the even split), whether the optimizer is distributed and the
    recomputation inside stages (``None``: none)."""

    t: int
    d: int
    w: int
    b: int
    recompute: bool
    schedule: str
    split: tuple[int, ...] | None = None
    distributed_optimizer: bool = False
    recompute_policy: RecomputePolicy | None = None
    context: int = 1  # --context-parallel-size (w is the data width: the world is t * c * w * d)
    cp_comm_type: str = P2P

    @property
    def axes(self) -> Axes:
        """The choice's named axes (the planner searches dense layouts: no experts)."""
        return Axes(tensor=self.t, context=self.context, data=self.w, pipeline=self.d)

    @property
    def layout(self) -> Layout:
        """The choice as the trainer's config takes it (``cli.build_config(..., layout=)``)."""
        return Layout.of(self.axes, self.b, self.recompute, self.schedule, layer_split=self.split,
                         distributed_optimizer=self.distributed_optimizer, recompute_policy=self.recompute_policy,
                         cp_comm_type=self.cp_comm_type)


@dataclass(frozen=True)
class AutoPlan:
    """The choice plus everything behind it."""

    choice: PlanChoice
    num_micro_batches: int
    result: SearchResult
    costs: LayerCosts
    cluster: Cluster
    profile_path: str | None
    profiled_here: bool

    def describe(self) -> str:
        c, ev = self.choice, self.result.best
        split = f" layers/stage={format_split(c.split)}" if c.split else ""
        recompute = "on" if c.recompute else c.recompute_policy.label if c.recompute_policy else "off"
        cp = f" c={c.context} ({c.cp_comm_type})" if c.context > 1 else ""
        return (f"auto-plan: t={c.t}{cp} d={c.d} w={c.w} b={c.b} m={self.num_micro_batches} "
                f"recompute={recompute} schedule={c.schedule}{split} "
                f"distributed-optimizer={'on' if c.distributed_optimizer else 'off'}: "
                f"{ev.samples_per_sec:.1f} samples/s predicted, {ev.memory_bytes_per_gpu / GiB:.2f} GiB/GPU "
                f"on {self.cluster.name}; costs from {self.costs.source}")


def host_cluster(device: torch.device | None = None, num_gpus: int = 1) -> Cluster:
    """A cluster description of this machine (see the module docstring)."""
    dev = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                     else torch.device("cpu"))
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        preset = next((p for key, p in DEVICE_PRESETS if key in name), None)
        if preset is None:
            raise ConfigError(f"no cluster preset matches {name!r}; pass cluster= (a preset name or a JSON file)")
        base = load_cluster(preset)
        total = torch.cuda.get_device_properties(dev).total_memory
        variant = next((peaks for key, peaks in PEAK_VARIANTS if key.upper() in name.upper()), None)
        return replace(base, device=name, device_memory_bytes=total,
                       reserved_memory_bytes=min(base.reserved_memory_bytes, total // 4),
                       peak_flops={k: v * 1e12 for k, v in variant.items()} if variant else base.peak_flops)
    mem = _host_memory_bytes()
    return Cluster(
        name="this-host-cpu", device="CPU (this host)", device_memory_bytes=mem,
        reserved_memory_bytes=mem // 4, peak_flops={"fp32": 1e11, "bf16": 1e11, "fp16": 1e11},
        memory_bandwidth=1e10, devices_per_server=max(num_gpus, 1), intra_server_allreduce_bandwidth=2e9,
        intra_server_p2p_bandwidth=2e9, inter_server_bandwidth=1.25e9, efficiency=EfficiencyCurve(0.5, 1e5),
        description="this host's CPU processes over loopback (rough numbers; for tests and demos)",
    )


def _host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GiB


def _cluster(cluster: Cluster | str | None, device: torch.device, num_gpus: int) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return load_cluster(cluster)
    return host_cluster(device, num_gpus)


def profile_or_load(
    model_cfg: ModelConfig, *, profile_path: str | os.PathLike | None, device: torch.device, precision: str,
    sizes: Sequence[int], tensor_parallel: Iterable[int] = (1,), warmup: int = 2, reps: int = 5,
    log_fn: Callable[[str], None] | None = None,
) -> tuple[LayerCosts, bool]:
    """Costs from ``profile_path`` when it exists, else measured here (and written there if given)."""
    from . import profiler  # noqa: PLC0415 - imports the models; only when profiling

    if profile_path is not None and Path(profile_path).is_file():
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (this host)"
        return load_checked_profile(profile_path, model_cfg, precision, name), False
    profiles = []
    for t in sorted(set(tensor_parallel)):
        if t == 1:
            profiles.append(profiler.profile_model(model_cfg, sizes, device=device, dtype=precision, warmup=warmup,
                                                   reps=reps, log=log_fn, skip_oom=True))
        else:
            profiles.append(profiler.profile_tensor_parallel(model_cfg, t, sizes, device_type=device.type,
                                                             dtype=precision, warmup=warmup, reps=reps))
    prof = profiler.merge_profiles(profiles)
    if profile_path is not None:
        prof.write(profile_path)
        (log_fn or log.info)(f"profile written to {profile_path}")
    return prof.layer_costs(), True


def auto_plan_details(
    model_cfg: ModelConfig, num_gpus: int, global_batch: int, cluster: Cluster | str | None = None,
    profile_path: str | os.PathLike | None = None, device: str | torch.device | None = None, *,
    precision: str = "fp32", max_micro_batch_size: int = 64, micro_batch_sizes_to_profile: Sequence[int] | None = None,
    tensor_parallel: Iterable[int] = (1,), schedules: tuple[str, ...] = SCHEDULE_NAMES, recompute_options=(False, True),
    warmup: int = 2, reps: int = 5, log_fn: Callable[[str], None] | None = None, fp32_grads: bool | None = None,
    distributed_optimizer_options: tuple[bool, ...] = (False, True), compensation: str = "auto",
    memory_margin: float = DEFAULT_MEMORY_MARGIN, recompute_policies: tuple[RecomputePolicy, ...] = FINER_RECOMPUTE,
    optimizer: str = "adam", attention_backend: str | None = None, reset_attention_mask: bool | None = None,
) -> AutoPlan:
    """:func:`auto_plan` with everything behind the choice (see the module docstring). ``attention_backend`` and
    ``reset_attention_mask``: the run's ``--attention-backend`` and ``--reset-attention-mask`` (None: the
    cluster's), which decide the attention kernel the memory is counted for."""
    from .profiler import resolve_device  # noqa: PLC0415

    dev = resolve_device(device)
    cl = _cluster(cluster, dev, num_gpus)
    run = {"attention_backend": attention_backend, "reset_attention_mask": reset_attention_mask}
    cl = replace(cl, **{k: v for k, v in run.items() if v is not None})
    sizes = tuple(micro_batch_sizes_to_profile or [b for b in micro_batch_sizes(max_micro_batch_size)
                                                   if b <= global_batch])
    costs, here = profile_or_load(model_cfg, profile_path=profile_path, device=dev, precision=precision, sizes=sizes,
                                  tensor_parallel=tensor_parallel, warmup=warmup, reps=reps, log_fn=log_fn)
    request = PlanRequest(model_cfg, cl, num_gpus, global_batch, precision, max_micro_batch_size=max_micro_batch_size,
                          schedules=schedules, recompute_options=tuple(recompute_options), fp32_grads=fp32_grads,
                          distributed_optimizer_options=tuple(distributed_optimizer_options), compensation=compensation,
                          memory_margin=memory_margin, recompute_policies=tuple(recompute_policies),
                          optimizer=optimizer)
    costs = with_context_costs(request, costs)  # a profile holds c = 1: a context rank's costs scaled from it
    result = search(request, costs, top=AUTO_PLAN_TOP)  # the exhaustive search's best, pruned (pruning.py)
    c = result.best.candidate
    plan = AutoPlan(PlanChoice(c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.micro_batch_size, c.recompute,
                               c.schedule, c.layer_split, c.distributed_optimizer, c.recompute_policy,
                               c.context_parallel, c.cp_comm_type),
                    c.num_micro_batches, result, costs, cl,
                    str(profile_path) if profile_path is not None else None, here)
    (log_fn or log.info)(plan.describe())
    return plan


def auto_plan(
    model_cfg: ModelConfig, num_gpus: int, global_batch: int, cluster: Cluster | str | None = None,
    profile_path: str | os.PathLike | None = None, device: str | torch.device | None = None, **kwargs,
) -> PlanChoice:
    """Profile (or load ``profile_path``), search, and return the best ``(t, d, w, b, recompute, schedule)``.

    Keyword arguments as :func:`auto_plan_details` (``precision``, ``max_micro_batch_size``, ...).
    A layout nothing fits raises ``ConfigError`` with the smallest candidate's memory.
    """
    return auto_plan_details(model_cfg, num_gpus, global_batch, cluster, profile_path, device, **kwargs).choice


def auto_plan_on_rank0(
    model_cfg: ModelConfig, num_gpus: int, global_batch: int, cluster: Cluster | str | None = None,
    profile_path: str | os.PathLike | None = None, device: str | torch.device | None = None, **kwargs,
) -> PlanChoice:
    """:func:`auto_plan` for a job already inside ``torch.distributed`` (the default group): rank 0
    profiles (or loads) and searches, every rank returns its choice - ranks must never plan apart,
    as measured profiles differ slightly from GPU to GPU. A ``ConfigError`` on rank 0 (nothing fits)
    is raised on every rank. Without an initialized process group it is plain :func:`auto_plan`."""
    import torch.distributed as dist  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return auto_plan(model_cfg, num_gpus, global_batch, cluster, profile_path, device, **kwargs)
    outcome: list = [None]  # rank 0's ("ok", choice) or ("error", message), broadcast to every rank
    if dist.get_rank() == 0:
        try:
            plan = auto_plan(model_cfg, num_gpus, global_batch, cluster, profile_path, device, **kwargs)
            outcome[0] = ("ok", tuple(plan))
        except ConfigError as exc:
            outcome[0] = ("error", str(exc))
    dist.broadcast_object_list(outcome, src=0)
    status, value = outcome[0]
    if status == "error":
        raise ConfigError(value)
    return PlanChoice(*value)
