"""Layout-independent parameter initialization.

Every parameter is drawn in full from a generator seeded by (seed, parameter name) and then
sliced to this rank's shard. So the same seed gives the same full model for every tensor and
pipeline layout, which is what lets every layout be checked against the single-process run.
"""

from __future__ import annotations

import zlib

import torch


def param_generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def normal_full(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    """The full (unsharded) fp32 tensor N(0, std^2) for parameter ``name``."""
    return torch.empty(shape).normal_(0.0, std, generator=param_generator(seed, name))


def shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim``."""
    return full.chunk(size, dim=dim)[rank].contiguous() if size > 1 else full
