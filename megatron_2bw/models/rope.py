"""Rotary position embeddings (RoPE), Megatron-Core's and Hugging Face Llama's rotate-half convention.

Channel ``i < d/2`` of a head's first ``d`` (``ModelConfig.rotary_dim``) channels is rotated with
channel ``i + d/2`` by angle ``pos * base**(-2i/d)``; channels past ``d`` (``--rotary-percent`` < 1)
pass through. The cos/sin tables are computed in fp32 and cast to the activations' dtype, as both
Megatron-Core and transformers do, so fp64 runs match transformers' to rounding.
"""

from __future__ import annotations

import torch

from ..context_parallel.group import CPGroup


def inverse_frequencies(dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """``base ** (-2i/dim)`` for ``i < dim/2``, fp32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def rotary_tables(positions: torch.Tensor, dim: int, base: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[len(positions), dim]`` (each frequency twice: the two halves share it)."""
    freqs = positions.float()[:, None] * inverse_frequencies(dim, base, positions.device)[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., s, head_dim]``'s first ``cos.shape[-1]`` channels by position."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], -1)


class RotaryEmbedding:
    """The cos/sin tables of one model for positions ``start .. start+s-1``, cached by (s, device, dtype).

    Not a module: the tables are derived data, never parameters or buffers (they must not enter
    the flat weight buffers or be cast to a low precision by ``.to(dtype)``).
    """

    def __init__(self, dim: int, base: float) -> None:
        self.dim, self.base = dim, base
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, s: int, device: torch.device, dtype: torch.dtype, start: int = 0,
               cp: CPGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of ``s`` positions from ``start``; under context parallelism (``cp``), of this rank's
        ``s`` tokens of the ``s * c`` long sequence (their global positions)."""
        sharded = cp is not None and cp.size > 1
        key = (s, start, device, dtype, (cp.rank, cp.size) if sharded else None)
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            pos = cp.positions(s * cp.size, device) if sharded else torch.arange(start, start + s, device=device)
            self._cache[key] = rotary_tables(pos, self.dim, self.base, dtype)
        return self._cache[key]
