"""The attention core, softmax(QK^T / sqrt(d)) V with dropout, by ``--attention-backend`` (Megatron's names).

- ``auto``: ``F.scaled_dot_product_attention`` picks its kernel (on GPUs flash / memory-efficient; on the
  CPU its flash kernel without dropout and its math path, which keeps three fp32 ``[b, a, s, s]`` tensors,
  with dropout);
- ``flash``: only SDPA's flash kernel; ``fused``: only its fused kernels (flash, memory-efficient,
  cuDNN). Neither keeps an ``s^2`` tensor, only a log-sum-exp per row;
- ``unfused`` / ``local``: the core written out as Megatron's ``DotProductAttention``: scores, masked
  softmax, dropout, times V. It keeps the softmax output, the dropout mask and the dropped
  probabilities (Korthikanti et al.'s ``5as^2b`` in fp16), which the planner counts
  (``planner/layer_costs.py``, ``core_stash_bytes``).

Query heads are grouped by key/value head (``[b, groups * per_group, s, d]``, group-major), so the
unfused core multiplies each group's ``per_group * s`` query rows by its one key matrix: no copy of K or
V per query head.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from ..config import ATTENTION_BACKENDS

_FUSED = {"flash": ("FLASH_ATTENTION",), "fused": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}


def _sdpa_backends(names: tuple[str, ...]) -> list:
    from torch.nn.attention import SDPBackend  # noqa: PLC0415 - torch >= 2.3

    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float,
                      causal: bool) -> torch.Tensor:
    """``q [b, a, s, d]``, ``k, v [b, g, n, d]`` (a = g * per_group) -> ``[b, a, s, d]``, as SDPA computes it
    (``n >= s`` keys: a context-parallel chunk's queries are the last ``s`` of an ``n``-token prefix, so
    ``causal`` is aligned bottom-right). ``mask``: SDPA's convention (bool: True takes part; float: added)."""
    b, a, s, d = q.shape
    g, n = k.shape[1], k.shape[2]
    scores = torch.matmul(q.reshape(b, g, (a // g) * s, d), k.transpose(-1, -2)).view(b, a, s, n)
    scores = scores * (1.0 / math.sqrt(d))
    if causal:
        scores = scores.masked_fill(~prefix_causal_keep(s, n, q.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = F.dropout(torch.softmax(scores, dim=-1), p, p > 0)
    return torch.matmul(probs.view(b, g, (a // g) * s, n), v).view(b, a, s, d)


def prefix_causal_keep(s: int, n: int, device: torch.device) -> torch.Tensor:
    """``[s, n]`` causal mask of the last ``s`` queries of an ``n``-token sequence (bottom-right aligned)."""
    return torch.arange(s, device=device)[:, None] + (n - s) >= torch.arange(n, device=device)[None, :]


_WARNED: list[bool] = []


def _warn_math_once() -> None:
    """``auto`` with grouped heads and a mask tensor (``--reset-attention-mask`` at c = 1): flash takes no mask and
    torch's memory-efficient kernel no grouped heads before pytorch#191085, so SDPA may run its math kernel (three
    fp32 ``[b, a, s, s]`` tensors): said once per process at first use, beside the start-up line
    (``config/attention_choice.py``); the planner prices it as math when told of the documents (review 2, N8)."""
    if not _WARNED:
        _WARNED.append(True)
        logging.getLogger(__name__).warning(
            "--attention-backend auto with grouped-query heads and an attention mask: torch may run its math "
            "attention kernel (s^2 fp32 tensors; tools/plan.py --reset-attention-mask prices it); "
            "--context-parallel-size > 1 runs documents without a mask tensor")


def attention(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float,
              causal: bool) -> torch.Tensor:
    """The core by ``backend`` (module docstring); ``p`` the dropout probability (0 in eval). With more keys
    than queries, ``causal`` means the queries are the keys' last ones (context parallelism's prefix): SDPA
    takes that as torch's bottom-right causal bias, which its fused kernels run without a mask tensor."""
    if backend in ("unfused", "local"):
        return unfused_attention(q, k, v, mask, p, causal)
    if causal and q.shape[2] != k.shape[2]:  # grouped heads too: torch's bias passes enable_gqa to its kernels
        from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415 - torch >= 2.3

        mask, causal = causal_lower_right(q.shape[2], k.shape[2]), False
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if backend == "auto" and gqa and isinstance(mask, torch.Tensor) and q.is_cuda:
        _warn_math_once()
    if backend == "auto":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, **gqa)
    if backend not in _FUSED:
        raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(ATTENTION_BACKENDS)}")
    from torch.nn.attention import sdpa_kernel  # noqa: PLC0415

    with sdpa_kernel(_sdpa_backends(_FUSED[backend])):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, **gqa)
