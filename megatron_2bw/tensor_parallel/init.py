"""Parameter initialization: layout-independent on the CPU, or per partition on the device.

A tensor-parallel layer does not draw its weight when it is built: it gets a parameter carrying an
:class:`Init` (what the full tensor is: its shape, N(0, std^2) or zeros, and which slice of it this
rank holds). Built inside :func:`deferred` (as ``RankWeights`` builds a stage), the parameter is a
meta tensor, and the values are written straight into the stage's flat buffer on its device, one
parameter at a time; outside it, the values are made at once (a layer built on its own, in tests).
Either way there are two ways to make them (Megatron's ``--use-cpu-initialization`` chooses):

- **CPU (layout-independent)**: the full fp32 tensor is drawn on the CPU from a generator seeded by
  (seed, parameter name) and sliced to this rank's shard. The same seed gives the same full model
  for every tensor and pipeline layout, which is what lets every layout be checked against the
  single-process run; each full matrix exists once, briefly, on every tensor rank.
- **Per partition (Megatron's default)**: each rank draws only its own shard, on its device, from a
  stream of its own seeded by (seed, parameter name, tensor rank, t) - the model-parallel RNG keyed
  per parameter, so the values do not depend on the order layers are built in and the dropout
  streams (``random.RNGTracker``) are left as they are. No full unsharded matrix is allocated.
  Replicated parameters (and every parameter at t = 1) use the CPU path's stream, so at t = 1 on
  the CPU both paths give the same bits; at t > 1 a shard is not a slice of the t = 1 tensor.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def param_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def normal_full(shape: tuple[int, ...], std: float, seed: int, name: str,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The full (unsharded) fp32 tensor N(0, std^2) for parameter ``name`` (drawn into ``out``, a
    contiguous tensor of that shape, if given)."""
    out = torch.empty(shape) if out is None else out
    return out.normal_(0.0, std, generator=param_generator(seed, name))


def shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim``."""
    return full.chunk(size, dim=dim)[rank].contiguous() if size > 1 else full


DATA = "dp"  # the default reduction domain: the whole data (x context) group, whose ranks hold replicas


@dataclass(frozen=True)
class Shard:
    """One split of a parameter's full tensor: along ``dim``, this rank's ``rank``-th of ``size`` pieces."""

    axis: str  # "tensor" or "expert"
    dim: int
    rank: int
    size: int


@dataclass(frozen=True)
class Init:
    """How one parameter is made: the full tensor (``full_shape``; N(0, std^2) in its first ``rows``
    rows, zero elsewhere, or all ``value`` when ``std`` is None: zeros, a norm's ones) and this rank's
    slice of it along ``dim`` (``rank`` of ``size``; ``dim`` None: the whole tensor, replicated).

    ``expert`` (dim, rank, size) splits the full tensor along an expert axis first (the tensor split then
    applies to that piece). ``domain`` names the ranks its gradient is reduced and its optimizer state
    sharded over (:data:`DATA`: the whole data group; expert weights: the expert-data subgroup), which
    the stage's weight store keys its flat segments by (``pipeline.segments``)."""

    name: str
    seed: int
    full_shape: tuple[int, ...]
    std: float | None = None
    dim: int | None = None
    rank: int = 0
    size: int = 1
    rows: int | None = None  # drawn rows (the real vocabulary of a padded embedding); None: all
    value: float = 0.0  # every element when ``std`` is None
    domain: str = DATA
    expert: tuple[int, int, int] | None = None  # (dim, rank, size) of the expert axis; None: not split

    @property
    def split(self) -> bool:
        return self.dim is not None and self.size > 1

    @property
    def shards(self) -> tuple[Shard, ...]:
        """Every split of the full tensor this rank's piece is cut by, outermost (expert) first."""
        out = [Shard("expert", *self.expert)] if self.expert is not None and self.expert[2] > 1 else []
        return tuple(out + ([Shard("tensor", self.dim, self.rank, self.size)] if self.split else []))

    @property
    def shape(self) -> tuple[int, ...]:
        """This rank's shape."""
        s = list(self.full_shape)
        for sh in self.shards:
            s[sh.dim] //= sh.size
        return tuple(s)

    def _expert_piece(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` cut to this rank's expert piece (itself when there is no expert split)."""
        e = self.expert
        return shard(full, e[0], e[1], e[2]) if e is not None and e[2] > 1 else full

    def full(self) -> torch.Tensor:
        """The full fp32 tensor on the CPU (the layout-independent path)."""
        if self.std is None:
            return torch.full(self.full_shape, self.value)
        if self.rows is None:
            return normal_full(self.full_shape, self.std, self.seed, self.name)
        out = torch.zeros(self.full_shape)
        normal_full((self.rows, *self.full_shape[1:]), self.std, self.seed, self.name, out=out[:self.rows])
        return out

    def cpu_shard(self) -> torch.Tensor:
        """This rank's slice of :meth:`full` (``--use-cpu-initialization``)."""
        full = self._expert_piece(self.full())
        return shard(full, self.dim, self.rank, self.size) if self.split else full

    def fill_shard(self, out: torch.Tensor) -> None:
        """Write this rank's values into ``out`` (on any device, any dtype) drawing only them (per partition)."""
        if self.std is None:
            out.fill_(self.value)
            return
        if self.expert is not None and self.expert[2] > 1:  # drawn as the CPU path (room for a per-expert stream)
            out.copy_(self.cpu_shard())
            return
        out.zero_()
        drawn = out
        if self.rows is not None:  # the real rows among this rank's (the rest is vocabulary padding)
            first = self.rank * self.shape[0] if self.split and self.dim == 0 else 0
            drawn = out[:max(0, min(self.shape[0], self.rows - first))]
        if drawn.numel() == 0:
            return
        key = f"{self.name}@tp{self.rank}of{self.size}" if self.split else self.name
        values = torch.empty(drawn.shape, device=out.device)  # fp32, then rounded once, as the CPU path
        values.normal_(0.0, self.std, generator=param_generator(self.seed, key, out.device))
        drawn.copy_(values)


_DEFERRED = [0]  # depth of open ``deferred()`` blocks


@contextlib.contextmanager
def deferred():
    """Build parameters that carry an :class:`Init` on the meta device (``RankWeights`` materializes them)."""
    _DEFERRED[0] += 1
    try:
        yield
    finally:
        _DEFERRED[0] -= 1


def constant_parameters(build: Callable[[], nn.Module], values: dict[str, float]) -> nn.Module:
    """``build()`` (a norm) with its parameters named in ``values`` set to those constants: inside
    :func:`deferred` built on the meta device and made later on the stage's device like every other
    deferred parameter (no host tensor); outside it, as built (the module's own ones and zeros)."""
    if not _DEFERRED[0]:
        return build()
    with torch.device("meta"):
        module = build()
    for name, p in list(module.named_parameters()):
        if name not in values:
            raise ValueError(f"no constant for parameter {name} of {type(module).__name__}")
        mod = module.get_submodule(name.rpartition(".")[0])
        q = parameter(Init(name, 0, tuple(p.shape), value=values[name]))
        q.requires_grad_(p.requires_grad)
        q.__dict__.update({k: v for k, v in p.__dict__.items() if k != "init"})
        mod._parameters[name.rpartition(".")[2]] = q
    return module


def parameter(init: Init) -> nn.Parameter:
    """A parameter made by ``init``: a meta tensor inside :func:`deferred`, else its CPU values now."""
    if _DEFERRED[0]:
        p = nn.Parameter(torch.empty(init.shape, device="meta"))
    else:
        p = nn.Parameter(init.cpu_shard())
    p.init = init
    return p


def materialize(p: nn.Parameter, out: torch.Tensor, *, cpu: bool) -> None:
    """Write a deferred parameter's values into ``out`` (its view of a flat buffer)."""
    init: Init = p.init
    if cpu:
        out.copy_(init.cpu_shard())
    else:
        init.fill_shard(out)


def domain_of(p: torch.Tensor) -> str:
    """The reduction domain ``p`` states through its :class:`Init` (:data:`DATA` where it has none)."""
    return getattr(getattr(p, "init", None), "domain", DATA)
