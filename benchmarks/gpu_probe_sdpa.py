"""``gpu_check.py``'s SDPA kernel matrix: which aten kernel the attention core runs, and its peak memory, per
backend and mask on this device."""

from __future__ import annotations

from gpu_probe import FAIL, PASS, _first_line, _row


def _sdpa_cell(backend: str, q, k, v, mask) -> tuple[str, float | None]:
    """Forward and backward through the attention core; the aten kernel op SDPA ran and the peak MiB."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_2bw.models.attention_core import attention

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            if name.startswith("_scaled_dot_product") or name.startswith(("_flash_attention", "_efficient_attention")):
                self.names.add(name)
            return func(*args, **(kwargs or {}))

    cuda = q.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with Ops() as ops:
        out = attention(backend, q, k, v, mask, 0.0, mask is None)
        out.float().square().mean().backward()
    if cuda:
        torch.cuda.synchronize()
    fwd = sorted(o for o in ops.names if "backward" not in o)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return (", ".join(fwd) or "math (no fused op)"), peak


def sdpa_rows(device) -> list[dict]:
    """Each GPT (MHA) / Llama (GQA) shape x mask x dtype x backend: runs, or is refused at start-up."""
    import torch

    from megatron_2bw.config.run import gqa_kernel_problem

    cuda = device.type == "cuda"
    b, s = (2, 2048) if cuda else (1, 32)
    shapes = {"gpt-mha": (16, 16, 64), "llama-gqa": (32, 8, 64)} if cuda else {"gpt-mha": (4, 4, 16),
                                                                              "llama-gqa": (4, 2, 16)}
    rows = []
    g = torch.Generator().manual_seed(5)
    for shape, (a, kv, hd) in shapes.items():
        for masked in (False, True):
            for dtype in ("bf16", "fp32"):
                tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
                q = torch.randn(b, a, s, hd, generator=g).to(device, tdt).requires_grad_(True)
                k = torch.randn(b, kv, s, hd, generator=g).to(device, tdt).requires_grad_(True)
                v = torch.randn(b, kv, s, hd, generator=g).to(device, tdt).requires_grad_(True)
                mask = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, 1, s, s) if masked else None
                for backend in ("auto", "flash", "fused"):
                    refused = ("flash takes no mask" if backend == "flash" and masked else
                               gqa_kernel_problem(backend, "cuda", a != kv, "a mask" if masked else None, dtype))
                    name = f"sdpa {shape} {'mask' if masked else 'causal'} {dtype} {backend}"
                    try:
                        kernel, peak = _sdpa_cell(backend, q, k, v, mask)
                    except Exception as e:  # noqa: BLE001 - "No available kernel" and the like
                        ok = refused is not None or not cuda
                        rows.append(_row(name, PASS if ok else FAIL, _first_line(e) + (
                            " (refused at start-up)" if refused else "" if cuda else " (CPU)"), refused=refused))
                        continue
                    finally:
                        q.grad = k.grad = v.grad = None
                    s2 = 3 * b * a * s * s * 4 / 2**20  # the math path's three fp32 [b, a, s, s] tensors
                    note = " (runs here although refused at start-up)" if refused and cuda else ""
                    # the planner prices a math core as those three tensors (layer_costs): how the peak compares
                    math_ratio = peak / s2 if peak is not None and "math" in kernel else None
                    rows.append(_row(name, PASS, kernel + note, kernel=kernel, peak_MiB=peak,
                                     math_s2_MiB=s2, math_peak_over_plan=math_ratio, refused=refused))
    return rows
