"""Which attention kernel ``--attention-backend`` runs: said once at start-up and priced by the planner as that
kernel (review 2, N8; the planner's ``layer_costs.attention_kernel`` calls :func:`attention_kernel_choice`).

``auto`` is ``F.scaled_dot_product_attention``'s own choice (``models/attention_core.py``):

- on the CPU, torch's flash kernel, or its fp32 math path where there is attention dropout (the CPU flash kernel
  takes none);
- on a GPU with fused kernels, flash or memory-efficient; but with grouped-query heads and an attention mask
  (``--reset-attention-mask`` at c = 1, BERT's padding mask) flash takes no mask and the memory-efficient kernel
  no grouped heads (before pytorch#191085), so SDPA falls to its math path: three fp32 ``[b, a, s, s]`` tensors;
- on a GPU without fused kernels (``Cluster.flash_attention`` false), the paper-era unfused core's tensors.

Under context parallelism documents travel as ids and the cores pass no mask tensor with grouped heads, so the
math fallback is a c = 1 case only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context import P2P

if TYPE_CHECKING:
    from .model import ModelConfig

_MATH_WHY = ("grouped-query heads with an attention mask: SDPA's flash kernel takes no mask and its memory-efficient "
             "kernel no grouped heads (before pytorch#191085), so it runs its math path (three fp32 [b, a, s, s] "
             "tensors); --attention-backend unfused keeps fewer, --context-parallel-size > 1 passes documents as ids")


def grouped(model: ModelConfig) -> bool:
    """Grouped-query heads (fewer key/value heads than query heads)."""
    return model.query_groups != model.num_attention_heads


def takes_mask(model: ModelConfig, reset_attention_mask: bool) -> bool:
    """Whether attention at c = 1 takes a mask tensor: documents (``--reset-attention-mask``) or the family's
    padding mask (BERT)."""
    return reset_attention_mask or model.family.padding_mask


def attention_kernel_choice(backend: str, cpu: bool, gqa: bool, masked: bool, dropout: bool,
                            fused_kernels: bool = True) -> tuple[str, str]:
    """``(kernel, why)``: the kernel (``config.blocks.ATTENTION_KERNELS``: fused, unfused or math) that ``backend``
    runs on this device for this attention (module docstring), and a short reason for the start-up line."""
    if backend in ("flash", "fused"):
        return "fused", f"--attention-backend {backend}"
    if backend in ("unfused", "local"):
        return "unfused", f"--attention-backend {backend}: the core written out"
    if cpu:
        if dropout:
            return "math", "torch's CPU flash kernel takes no attention dropout: its fp32 math path"
        return "fused", "torch's CPU flash kernel"
    if not fused_kernels:
        return "unfused", "no fused attention kernel on this device"
    if gqa and masked:
        return "math", _MATH_WHY
    return "fused", "SDPA's flash or memory-efficient kernel"


def ring_written(backend: str, cpu: bool, masked: bool, dropout: bool, fused_kernels: bool = True) -> str | None:
    """Why the ring's blocks (p2p) run the written-out fp32 core in tiles where no kernel takes them
    (``context_parallel/blocks.block_kernel``); None where a kernel runs them."""
    if backend in ("unfused", "local"):
        return "the unfused backend"
    if cpu:
        return "the CPU with attention dropout" if dropout else None  # the CPU flash kernel takes no dropout
    if masked:
        return "documents on a GPU: CUDA's flash op takes no mask"
    return None if fused_kernels else "no fused attention kernel on this device"


def startup_line(backend: str, device: str, gqa: bool, masked: bool, dropout: bool, context: int,
                 cp_comm_type: str = P2P) -> str:
    """The start-up log line: what ``backend`` runs in this run (the kernel the planner prices)."""
    cpu = device == "cpu"
    if context > 1 and cp_comm_type == P2P:
        why = ring_written(backend, cpu, masked, dropout)
        if why is not None:
            return (f"attention: --attention-backend {backend} runs the ring's blocks on the written-out fp32 core "
                    f"in tiles ({why})")
    kernel, why = attention_kernel_choice(backend, cpu, gqa, masked and context == 1, dropout)
    where = " in each context-parallel block or chunk" if context > 1 else ""
    return f"attention: --attention-backend {backend} runs the {kernel} kernel{where} ({why})"
