"""Process groups of a layout's named axes (``config/axes.py``: tensor, context, expert, data, pipeline).

Rank order follows Megatron-LM: tensor ranks are adjacent (they exchange activations every
layer, so they belong on one server), then the weight replicas, then pipeline stages::

    rank = pipeline_rank * (t * replicas) + replica_rank * t + tensor_rank

``replicas`` = data width x c: with context parallelism (c > 1) the context ranks come between tensor and
data ranks (Megatron's tp-cp-dp-pp order) and hold the same weights, so for everything that concerns
weights (gradient reduction, the distributed optimizer's shards, checkpoints) they are replicas:
``ParallelState.replicas`` and ``dp_rank`` count them (Megatron's data group "with context parallel");
the data a rank reads goes by ``data_width`` (``w``, the paper's data-parallel width) and ``data_rank``.

Worked example, 8 processes with t = 2, d = 2, w = 2 (two servers of four GPUs)::

    tensor groups    [0, 1] [2, 3] [4, 5] [6, 7]     each pair splits every layer
    data groups      [0, 2] [1, 3] [4, 6] [5, 7]     replicas all-reduce gradients inside a server
    pipeline groups  [0, 4] [1, 5] [2, 6] [3, 7]     stage 0 on server 0, stage 1 on server 1
    embedding groups [0, 4] [1, 5] [2, 6] [3, 7]     first + last stage (tied embeddings)
    model groups     [0, 1, 4, 5] [2, 3, 6, 7]       one full model: grad norm, overflow flag

Only the point-to-point activation traffic crosses servers, as PipeDream-2BW wants. The groups are built
once (:func:`build_state`) into one :class:`Groups` bundle; the model's layers get theirs as
``models.groups.ModelGroups``.

Expert parallelism (size e, Megatron-Core's folding of EP inside the data x context group): of the
replicas, position j holds expert piece ``j % e`` (the e ranks of an expert group are adjacent, ``j // e``
equal) and its expert weights are replicas over the replicas / e ranks with the same ``j % e``, the
expert-data group. Parameters name the group they are reduced over (their reduction domain,
``tensor_parallel.init.Init.domain``); :meth:`ParallelState.domains` resolves the names.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import ParallelConfig
from .config.axes import Axes
from .errors import ConfigError


def rank_of(t: int, w: int, tp: int, dp: int, pp: int) -> int:
    """Global rank of (tensor, replica, pipeline) ranks with ``w`` weight replicas (:meth:`Axes.rank`)."""
    return Axes(tensor=t, data=w).rank(tp, dp, pp)


def coords_of(rank: int, t: int, w: int) -> tuple[int, int, int]:
    """(tensor_rank, replica_rank, pipeline_rank) of a global rank (:meth:`Axes.coords`)."""
    return Axes(tensor=t, data=w).coords(rank)


def layout_groups(t: int, d: int, w: int, c: int = 1, e: int = 1) -> dict[str, list[list[int]]]:
    """All process groups of a layout as lists of global ranks (:meth:`Axes.groups`); ``w`` counts the weight
    replicas (data width x ``c``)."""
    return Axes(tensor=t, context=c, expert=e, data=w // c, pipeline=d).groups()


EXPERT_DATA = "edp"  # the reduction domain of expert weights: the expert-data group


@dataclass(frozen=True)
class Domain:
    """A reduction domain resolved: the group a parameter's gradient is reduced (and its distributed
    optimizer state sharded) over, and the group across which its values are distinct copies (an
    expert's other pieces: its norm is summed over it; None: the domain's ranks hold every value)."""

    name: str
    group: object | None  # None: a group of one
    size: int
    rank: int
    copies: object | None = None
    copies_size: int = 1


@dataclass(frozen=True)
class Groups:
    """This process's groups of the layout, built once (None: a group of one): tensor, replicas (``dp``:
    data x context, Megatron's data group with context parallel), context, expert (token dispatch, the training
    thread), expert-data, the expert ranks again for the gradient reducer's thread, embedding (first and last
    stage: tied embeddings; None where no tied embedding is summed between ranks) and model (one full model:
    norms, overflow). No pipeline group: transfers go over the default group's communicator."""

    tp: object | None = None
    dp: object | None = None
    cp: object | None = None
    ep: object | None = None
    edp: object | None = None
    ep_copies: object | None = None
    embedding: object | None = None
    model: object | None = None


@dataclass
class ParallelState:
    """This process's place in the layout (its :class:`Axes` and coordinates) and its process groups."""

    rank: int
    world_size: int
    axes: Axes
    tp_rank: int
    dp_rank: int  # among the weight replicas (data x context)
    pp_rank: int
    pipeline_ranks: list[int]
    groups: Groups = field(default_factory=Groups)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: datetime.timedelta | None = None  # --distributed-timeout-minutes, for groups made later (None: torch's)
    # the pipeline rank holding the model's last virtual stage, where the loss is (None: the last rank; a V
    # layout puts it on rank 0: the pipeline stage sets it from its placement)
    loss_stage: int | None = None
    cp_ranks: tuple[int, ...] = (0,)  # the context group's global ranks, in context order

    @property
    def t(self) -> int:
        """Tensor-parallel size."""
        return self.axes.tensor

    @property
    def d(self) -> int:
        """Pipeline depth."""
        return self.axes.pipeline

    @property
    def c(self) -> int:
        """Context-parallel size (the context group's ranks are among the replicas)."""
        return self.axes.context

    @property
    def e(self) -> int:
        """Expert-parallel size, folded inside the replicas."""
        return self.axes.expert

    @property
    def replicas(self) -> int:
        """Ranks of this stage holding the same dense weights (data x context): what gradients are reduced
        and the distributed optimizer's state sharded over."""
        return self.axes.replicas

    @property
    def cp_rank(self) -> int:
        return self.dp_rank % self.c

    @property
    def ep_rank(self) -> int:
        """This rank's expert piece."""
        return self.dp_rank % self.e

    def domains(self) -> dict[str, Domain]:
        """Every reduction domain by name (``init.DATA`` = ``"dp"``: the whole data group; ``"edp"``: the
        expert-data group, whose ranks' expert pieces differ across the expert group)."""
        g = self.groups
        dp = Domain("dp", g.dp, self.replicas, self.dp_rank)
        edp = Domain(EXPERT_DATA, g.edp if self.e > 1 else g.dp, self.axes.expert_data,
                     self.dp_rank // self.e, g.ep_copies, self.e)
        return {dp.name: dp, edp.name: edp}

    @property
    def data_width(self) -> int:
        """Data-parallel width: the replicas that read different data (replicas / c)."""
        return self.axes.data

    @property
    def data_rank(self) -> int:
        """Which slice of each global batch this rank's replica reads."""
        return self.dp_rank // self.c

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.d - 1

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes the loss (the last stage, unless the chunk placement says otherwise)."""
        return self.pp_rank == (self.d - 1 if self.loss_stage is None else self.loss_stage)

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.pipeline_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.pipeline_ranks[self.pp_rank + 1]

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelState":
        """The trivial layout of one process, with no process groups."""
        return cls(0, 1, Axes(), 0, 0, 0, [0], device=torch.device(device))


def _first_slurm_host() -> str:
    """The first host of the SLURM job (the rendezvous address)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    # Fallback parser for the common forms "host1,host2" and "prefix[01-04,07]".
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ConfigError(f"cannot find the first host of SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def distributed_env() -> dict[str, str | int]:
    """Rank, world size, local rank and rendezvous address from torchrun's or SLURM's environment."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
            "master_port": int(env.get("MASTER_PORT", 29500)),
        }
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        return {
            "rank": int(env["SLURM_PROCID"]),
            "world_size": int(env["SLURM_NTASKS"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "master_addr": env.get("MASTER_ADDR") or _first_slurm_host(),
            "master_port": int(env.get("MASTER_PORT", 20000 + job % 20000)),
        }
    return {"rank": 0, "world_size": 1, "local_rank": 0, "master_addr": "127.0.0.1", "master_port": 29500}


# What the backends put in an exception's text when a peer process died or stopped answering: torch
# raises the backends' failures as plain RuntimeError (DistError only on some paths and versions),
# so the text is the one signal common to every version; see ``is_peer_failure``.
PEER_FAILURE_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timeout", "NCCL", "Gloo")


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` most likely means another rank failed (so this rank's own traceback is noise)."""
    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or any(k in text for k in PEER_FAILURE_MARKERS)


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def cuda_device_index(local_rank: int) -> int:
    """The CUDA device of a process with ``local_rank``; refuses to put two local ranks on one GPU.

    Under torchrun (``LOCAL_WORLD_SIZE`` set) the local processes share one set of visible devices,
    so more processes than devices would silently share a GPU (NCCL then aborts with "Duplicate GPU
    detected", older NCCL hangs). Under SLURM's own launch (no torchrun) each task may see only its
    own device (``--gpus-per-task=1``), so the index wraps around there.
    """
    count = torch.cuda.device_count()
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if count < 1:
        raise ConfigError("--device cuda but no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")
    if local_world is not None and int(local_world) > count:
        raise ConfigError(f"{local_world} processes on this node but {count} visible CUDA device(s): two ranks "
                          f"would share a GPU; start at most {count} per node (--nproc-per-node, NPROC) or "
                          "check CUDA_VISIBLE_DEVICES")
    return local_rank % count


def initialize(
    parallel: ParallelConfig,
    *,
    backend: str | None = None,
    device: str | None = None,
    timeout_minutes: float = 10.0,
    expert: int = 1,
    tied_embedding: bool = True,
) -> ParallelState:
    """Start ``torch.distributed`` (if the world has more than one process) and build all groups.

    The layout is checked against the world size before any group or collective exists. ``expert``: the
    expert-parallel size (``--expert-model-parallel-size``), folded inside the data x context ranks.
    ``tied_embedding``: whether a tied word embedding is summed between the first and the last stage's ranks
    (:attr:`~megatron_2bw.config.run.RunConfig.tied_across_ranks`); without it no embedding group is made.
    """
    env = distributed_env()
    world = int(env["world_size"])
    parallel = parallel.resolve(world)
    dev_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_type == "cuda":
        torch.cuda.set_device(cuda_device_index(int(env["local_rank"])))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    axes = parallel.axes(expert=expert)
    rank = int(env["rank"])
    if world == 1 and not dist.is_initialized():
        return ParallelState.single(dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend or default_backend(dev.type),
            init_method=f"tcp://{env['master_addr']}:{env['master_port']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            # NCCL: create the communicators now, so a first batch_isend_irecv among a subset of ranks is legal
            device_id=dev if dev.type == "cuda" else None,
        )
    return build_state(axes, dev, timeout=datetime.timedelta(minutes=timeout_minutes), tied_embedding=tied_embedding)


_TIMEOUT: list[datetime.timedelta | None] = [None]  # the last build_state's group timeout


def group_timeout() -> datetime.timedelta | None:
    """``--distributed-timeout-minutes`` as the layout's groups got it (None: torch's default)."""
    return _TIMEOUT[0]


def build_state(axes: Axes, device: torch.device, *, timeout: datetime.timedelta | None = None,
                tied_embedding: bool = True) -> ParallelState:
    """Create every group of the layout (all ranks call ``new_group`` in the same order).

    ``timeout`` (``--distributed-timeout-minutes``) applies to every group: ``new_group`` does not
    inherit the default group's, it takes torch's default (10 min NCCL, 30 min gloo). Groups made later
    (the checkpoint's gloo group) take it from :func:`group_timeout`. No group is made for the pipeline
    ranks: nothing reduces over them (transfers use the default group), and on NCCL every group is a
    communicator with its own device memory. For the same reason no embedding group is made without
    ``tied_embedding`` (an untied output layer, or a V placement whose first and last stage share a rank).
    """
    _TIMEOUT[0] = timeout
    rank, world = dist.get_rank(), dist.get_world_size()
    if axes.world != world:
        raise ConfigError(f"layout {axes.describe()} needs {axes.world} processes, the world has {world}")
    tp_rank, dp_rank, pp_rank = axes.coords(rank)
    lists = axes.groups()
    mine: dict[str, object | None] = {}
    for name, ranks_lists in lists.items():
        mine[name] = None
        if name == "pipeline" or (name == "embedding" and not tied_embedding):
            continue
        for ranks in ranks_lists:
            g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                mine[name] = g
    pipeline_ranks = next(p for p in lists["pipeline"] if rank in p)
    cp_ranks = next((tuple(g) for g in lists.get("context", ()) if rank in g), (rank,))
    groups = Groups(tp=mine["tensor"], dp=mine["data"], cp=mine.get("context"), ep=mine.get("expert"),
                    edp=mine.get("expert_data"), ep_copies=mine.get("expert_copies"), embedding=mine["embedding"],
                    model=mine["model"])
    return ParallelState(rank, world, axes, tp_rank, dp_rank, pp_rank, pipeline_ranks, groups, device=device,
                         timeout=timeout, cp_ranks=cp_ranks)
