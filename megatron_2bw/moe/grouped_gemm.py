"""The one grouped GEMM every expert projection goes through (the seam a GEMM backend can take over).

``grouped_linear(x, w, counts)``: the rows of ``x`` come in ``len(counts)`` consecutive segments, segment ``e``
multiplied by ``w[e]^T`` (``w`` is ``[E, out, in]``, each expert's matrix in ``nn.Linear``'s layout). With
``--moe-grouped-gemm`` it runs ``torch._grouped_mm`` (forward and backward, CPU included in torch 2.13) where
that kernel takes the operands (``grouped_mm_supported``), else one ``F.linear`` per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the dtypes torch._grouped_mm takes: the CPU kernel fp32/bf16/fp16 (checked in torch 2.13); on CUDA only bf16
# (torch's meta function states the CUDA kernel's checks; not run here: no GPU in this project's tests)
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x [N, in]`` and ``w [E, out, in]``: its dtypes, 16-byte strides."""
    dtypes = _GROUPED_DTYPES.get(x.device.type, ())
    if not hasattr(torch, "_grouped_mm") or x.dtype not in dtypes or w.dtype != x.dtype:
        return False
    size = x.element_size()
    return (w.shape[1] * size) % 16 == 0 and (w.shape[2] * size) % 16 == 0


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | list[int],
                   use_grouped_mm: bool = False) -> torch.Tensor:
    """``x [N, in]`` -> ``[N, out]``, segment ``e`` of ``counts[e]`` rows times ``w[e]^T``."""
    if use_grouped_mm and grouped_mm_supported(x, w):
        counts_t = torch.as_tensor(counts, device=x.device)
        offs = torch.cumsum(counts_t, dim=0).to(torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    parts = torch.split(x, sizes, dim=0)
    return torch.cat([F.linear(p, w[e]) for e, p in enumerate(parts)], dim=0)
