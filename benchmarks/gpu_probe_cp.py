"""The device script's context-parallel rows (review 3, G11): the ring and the all_gather prefix core on one GPU.

- ``cp core``: a child process with a world-1 NCCL group (the CPU form: 2 gloo processes, c = 2) runs the ``p2p`` ring
  (its backward's last hop goes to itself through ``batch_isend_irecv``) in bf16 (fp32 on the CPU) against the
  unfused core in fp32 on the same q, k, v, with and without dropout (dropout: the backward run twice gives the
  same gradients, the replay), and reports the block kernel chosen and the peak memory of a block of n = 4096,
  16 heads (the whole-block ring would have held about 5 fp32 blocks of 1 GiB).
- ``cp prefix``: ``attention(auto|fused, q[:, :, :n], k[:, :, :3n], ...)`` (a chunk against its key prefix,
  bottom-right causal), MHA and grouped heads, head dim 128, dropout 0 and 0.1: the difference from the unfused
  core (p = 0) and the peak memory.
"""

from __future__ import annotations

PASS, FAIL, INFO = "pass", "FAIL", "info"
TOL = {"bfloat16": 3e-2, "float32": 1e-4}  # bf16 inputs against an fp32 reference: a few bf16 ulps


def _row(name: str, status: str, detail: str = "", **numbers) -> dict:
    return dict(check=name, status=status, detail=detail, **numbers)


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
    return {"kernel": block_kernel(x[0], 0.0, "auto"), "err": err, "replay": replay, "dtype": str(dtype),
            "peak_GiB": None if peak is None else peak / 2**30}


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
    ok = got["err"] <= TOL[dt] and got["replay"]
    return [_row("cp core p2p", PASS if ok else FAIL,
                 f"kernel {got['kernel']}, {dt}, relative error {got['err']:.1e} vs unfused fp32, dropout replay "
                 f"{'equal' if got['replay'] else 'DIFFERS'}", max_allocated_GiB=got["peak_GiB"])]


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
