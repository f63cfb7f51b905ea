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

_MATH_WHY = ("grouped-query heads with an attention mask: SDPA's flash kernel takes no mask and its memory-efficient "
             "kernel no grouped heads (before pytorch#191085), so it runs its math path (three fp32 [b, a, s, s] "
             "tensors); --attention-backend unfused keeps fewer, --context-parallel-size > 1 passes documents as ids")


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


def startup_line(backend: str, device: str, gqa: bool, masked: bool, dropout: bool, context: int,
                 cp_comm_type: str = "p2p") -> str:
    """The start-up log line: what ``backend`` runs in this run (the kernel the planner prices). Under context
    parallelism the ring's blocks (p2p) run the written-out fp32 core in tiles where no kernel takes them: the
    unfused backend, the CPU with attention dropout, a GPU block with documents (``context_parallel/blocks.py``)."""
    cpu = device == "cpu"
    if context > 1 and cp_comm_type == "p2p":
        why = ("the unfused backend" if backend in ("unfused", "local") else "the CPU with attention dropout"
               if cpu and dropout else "documents on a GPU: CUDA's flash op takes no mask" if masked and not cpu
               else None)
        if why is not None:
            return (f"attention: --attention-backend {backend} runs the ring's blocks on the written-out fp32 core "
                    f"in tiles ({why})")
    kernel, why = attention_kernel_choice(backend, cpu, gqa, masked and context == 1, dropout)
    where = " in each context-parallel block or chunk" if context > 1 else ""
    return f"attention: --attention-backend {backend} runs the {kernel} kernel{where} ({why})"
