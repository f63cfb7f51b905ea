"""The device script's context-parallel rows (review 3, G11): the ring and the all_gather prefix core on one GPU.

- ``cp core``: a child process with a world-1 NCCL group (the CPU form: 2 gloo processes, c = 2) runs the ``p2p`` ring
  (its backward's last hop goes to itself through ``batch_isend_irecv``) in bf16 (fp32 on the CPU) against the
  unfused core in fp32 on the same q, k, v, with and without dropout (dropout: the backward run twice gives the
  same gradients, the replay), and reports the block kernel chosen and the peak memory of a block of n = 4096,
  16 heads (the whole-block ring would have held about 5 fp32 blocks of 1 GiB).
- ``cp core p2p documents``: the same ring with documents (ids ``[b, s]``; on CUDA a masked block runs the
  written-out core in tiles) against the unfused core under the documents' mask.
- In both, the ring's own peak (the device's allocated bytes beyond its inputs, forward and backward each from its
  start, as ``tests/test_context_parallel_long.py`` counts live tensors on the CPU) against the planner's
  ``ring_workspace_bytes`` for the kernel the block ran: a peak above the plan by more than ``PLAN_SLACK`` fails
  (the planner would under-reserve). This checks on the device the two ways the planner prices the ring there: the
  flash kernel, and a masked block as the written-out core. One GPU runs c = 1 (two chunks, no hop in forward), so
  the peak can read below the plan by a hop's buffers; a reading above it is the planner under-counting.
- ``cp prefix``: ``attention(auto|fused, q[:, :, :n], k[:, :, :3n], ...)`` (a chunk against its key prefix,
  bottom-right causal), MHA and grouped heads, head dim 128, dropout 0 and 0.1: the difference from the unfused
  core (p = 0) and the peak memory.
"""

from __future__ import annotations

from gpu_probe import FAIL, INFO, PASS, _row

TOL = {"bfloat16": 3e-2, "float32": 1e-4}  # bf16 inputs against an fp32 reference: a few bf16 ulps
PLAN_SLACK = 0.10  # the allocator's rounding and a kernel's own scratch, beyond the live-tensor count the plan models


def _cp_core_worker(n: int, heads: int, hd: int) -> dict:
    """In the child: the ring at c = 1 on this device against the unfused fp32 core."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.context_parallel.blocks import block_kernel
    from megatron_2bw.context_parallel.group import CPGroup, positions_of
    from megatron_2bw.context_parallel.ring import ring_attention
    from megatron_2bw.models.attention_core import unfused_attention

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    c, rank = dist.get_world_size(), dist.get_rank()
    cp = CPGroup(dist.group.WORLD, rank, c, "p2p", tuple(range(c)))
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, 2 * n, hd, device=device, generator=g) for _ in range(4))
    idx = positions_of(2 * n, c, rank, device)
    x = [t.index_select(2, idx).to(dtype).requires_grad_() for t in (q, k, v)]
    full, dout_all, dout = (q, k, v), dout, dout.index_select(2, idx)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = ring_attention(cp, *x, None, 0.0, True)
    out.backward(dout.to(dtype))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    r = [t.detach().requires_grad_() for t in full]
    ref = unfused_attention(*r, None, 0.0, True)
    ref.backward(dout_all)
    err = max(float((a.float() - b.index_select(2, idx)).abs().max() / b.abs().max()) for a, b in
              zip((out, *(t.grad for t in x)), (ref, *(t.grad for t in r))))
    grads = []
    for _ in range(2):  # dropout: the same draw (seeded) twice gives the same gradients: the backward replays it
        torch.manual_seed(1)
        y = [t.detach().clone().requires_grad_() for t in x]
        ring_attention(cp, *y, None, 0.1, True).backward(dout.to(dtype))
        grads.append([t.grad for t in y])
    replay = all(torch.equal(a, b) for a, b in zip(*grads))
    # documents: three of them, the ring's blocks build their rows from the ids
    ids = (torch.arange(2 * n, device=device) * 3 // (2 * n))[None]
    r = [t.detach().requires_grad_() for t in full]
    ref = unfused_attention(*r, (ids[:, :, None] == ids[:, None, :])[:, None], 0.0, True)
    ref.backward(dout_all)
    y = [t.detach().clone().requires_grad_() for t in x]
    out = ring_attention(cp, *y, ids, 0.0, True)
    out.backward(dout.to(dtype))
    err_docs = max(float((a.float() - b.index_select(2, idx)).abs().max() / b.abs().max()) for a, b in
                   zip((out, *(t.grad for t in y)), (ref, *(t.grad for t in r))))
    del ref, r, out, y
    peaks = {docs: _phase_peaks(cp, x, ids if docs else None, dout.to(dtype)) for docs in (False, True)}
    return {"kernel": block_kernel(x[0], 0.0, "auto"), "err": err, "replay": replay, "dtype": str(dtype),
            "peak_GiB": None if peak is None else peak / 2**30, "kernel_docs": block_kernel(x[0], 0.0, "auto", True),
            "err_docs": err_docs, "peaks": peaks}


def _phase_peaks(cp, x, ids, dout) -> tuple[int, int] | None:
    """The ring's forward and backward peaks (CUDA: allocated bytes beyond each phase's start); None on the CPU."""
    import torch

    from megatron_2bw.context_parallel.ring import ring_attention

    y = [t.detach().clone().requires_grad_() for t in x]
    if not y[0].is_cuda:
        ring_attention(cp, *y, ids, 0.0, True).backward(dout)
        return None
    dev = y[0].device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = ring_attention(cp, *y, ids, 0.0, True)
    torch.cuda.synchronize(dev)
    fwd = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out.backward(dout)
    torch.cuda.synchronize(dev)
    return fwd, torch.cuda.max_memory_allocated(dev) - base


def plan_bytes(n: int, heads: int, hd: int, dtype: str, documents: bool, kernel: str) -> int:
    """The planner's ring workspace for the worker's shapes: one rank (c = 1) holding both chunks, b = 1."""
    from megatron_2bw.config import ModelConfig
    from megatron_2bw.planner.context_costs import ring_workspace_bytes

    cfg = ModelConfig("gpt", 2, heads * hd, heads, 2 * n, 2 * n, 256)
    return ring_workspace_bytes(cfg, 1, 1, 1, 4 if dtype == "float32" else 2, tiled=documents,
                                written=kernel == "written")


def _peak_verdict(peaks: tuple[int, int] | None, plan: int) -> tuple[bool, str, float | None]:
    """Whether the measured peak is within the plan (and the slack), the words, the ratio."""
    if peaks is None:
        return True, f"plan {plan / 2**20:.2f} MiB (the peak is measured on CUDA)", None
    ratio = max(peaks) / plan
    return ratio <= 1 + PLAN_SLACK, (f"peak fwd {peaks[0] / 2**20:.0f} / bwd {peaks[1] / 2**20:.0f} MiB, "
                                     f"{ratio:.2f}x the plan's {plan / 2**20:.0f} MiB"), ratio


def cp_core_rows(device, small: bool) -> list[dict]:
    """The ``cp core`` row (module docstring); ``small``: the CPU form's shapes."""
    from megatron_2bw.local_workers import run_workers

    n, heads, hd = (64, 2, 16) if small else (4096, 16, 128)
    try:
        cuda = device.type == "cuda"  # one GPU: a world of 1 (the ring's hop to itself); the CPU form: c = 2 on gloo
        got = run_workers(_cp_core_worker, 1 if cuda else 2, n, heads, hd, timeout=120, pg_timeout=60,
                          backend="nccl" if cuda else "gloo")[0]
    except Exception as e:  # noqa: BLE001 - a crash or a hang of the child is this row's failure
        return [_row("cp core p2p", FAIL, str(e).splitlines()[-1][:200])]
    dt = got["dtype"].removeprefix("torch.")
    rows = []
    for docs in (False, True):
        kernel, err = (got["kernel_docs"], got["err_docs"]) if docs else (got["kernel"], got["err"])
        fits, words, ratio = _peak_verdict(got["peaks"][docs], plan_bytes(n, heads, hd, dt, docs, kernel))
        ok = err <= TOL[dt] and fits and (docs or got["replay"])
        replay = "" if docs else f", dropout replay {'equal' if got['replay'] else 'DIFFERS'}"
        rows.append(_row("cp core p2p documents" if docs else "cp core p2p", PASS if ok else FAIL,
                         f"kernel {kernel}, {dt}, relative error {err:.1e} vs unfused fp32{replay}; {words}",
                         max_allocated_GiB=None if docs else got["peak_GiB"], peak_over_plan=ratio))
    return rows


def prefix_rows(device, small: bool) -> list[dict]:
    """The ``cp prefix`` rows (module docstring); on the CPU a kernel that refuses a case (no fused dropout) is info."""
    import torch

    from megatron_2bw.models.attention_core import attention, unfused_attention

    n, hd = (32, 16) if small else (2048, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for backend in ("auto", "fused"):
        for groups in (8, 2):
            for p in (0.0, 0.1):
                name = f"cp prefix {backend} {'mha' if groups == 8 else 'gqa'} p={p:g}"
                try:
                    g = torch.Generator(device=device).manual_seed(0)
                    q = torch.randn(1, 8, n, hd, device=device, generator=g)
                    k, v = (torch.randn(1, groups, 3 * n, hd, device=device, generator=g) for _ in range(2))
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    out = attention(backend, q.to(dtype), k.to(dtype), v.to(dtype), None, p, True)
                    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                    if p == 0:
                        ref = unfused_attention(q, k, v, None, 0.0, True)
                        err = float((out.float() - ref).abs().max() / ref.abs().max())
                        ok, detail = err <= TOL[str(dtype).removeprefix("torch.")], f"relative error {err:.1e}"
                    else:
                        ok, detail = bool(torch.isfinite(out).all()), "finite"
                    rows.append(_row(name, PASS if ok else FAIL, detail, max_allocated_GiB=peak))
                except Exception as e:  # noqa: BLE001 - a kernel that refuses the case is this row's failure
                    rows.append(_row(name, FAIL if device.type == "cuda" else INFO, str(e).splitlines()[0][:200]))
    return rows
