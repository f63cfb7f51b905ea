"""The device script's reserve row (review 2/3 N14): device memory a trainer process holds outside torch's allocator.

The planner keeps ``reserved_memory_GiB`` of every GPU for what its memory model does not count: the CUDA context,
the kernels' module images, the libraries' handles, and the NCCL communicators (six per rank at c > 1: world,
tensor, data, embedding, model, context). The presets say 2.5 GiB (``dgx-h100.json``, ``dgx-h200.json``), never
measured. This row measures, in the device script's own process after it has trained (so the libraries a training
step loads are loaded):

- ``outside_GiB``: ``total - free - memory_reserved`` (``torch.cuda.mem_get_info``): what the process holds beyond
  torch's caching allocator (the context, module images, handles). The script is the GPU's only process.
- ``communicator_MiB``: one NCCL communicator's share, from a world of one (``init_process_group`` plus five
  ``new_group``, each made real by an all-reduce), averaged over the five. A one-rank communicator has no peers,
  so the peers' buffers (``NCCL_BUFFSIZE`` per channel and peer, NVLS on NVSwitch) are not in it: that part needs
  two GPUs or more and is stated as unmeasured.

It passes when the context and libraries plus six such communicators fit the preset's reserve for this device.
"""

from __future__ import annotations

from gpu_probe import FAIL, NEEDS_GPU, PASS, _row

COMMUNICATORS = 6  # per rank at c > 1: world, tensor, data, embedding, model, context (review 3, N14)
NAME = "reserve outside the allocator"


def preset_of(device_name: str) -> str:
    """The cluster preset whose reserve applies to this GPU (an H200 or else the H100's)."""
    return "dgx-h200" if "H200" in device_name.upper() else "dgx-h100"


def verdict(outside: int, world_comm: int, each_comm: float, reserve: int, preset: str) -> dict:
    """The row from the measured bytes: the context and libraries plus ``COMMUNICATORS`` one-rank communicators
    against the preset's reserve (the first communicator counted as the world's, the rest at the average)."""
    need = outside + world_comm + (COMMUNICATORS - 1) * each_comm
    ok = need <= reserve
    gib, mib = 2**30, 2**20
    return _row(NAME, PASS if ok else FAIL,
                f"context+libraries {outside / gib:.2f} GiB, a one-rank NCCL communicator {each_comm / mib:.0f} MiB "
                f"(the world's {world_comm / mib:.0f} MiB), x{COMMUNICATORS}: {need / gib:.2f} GiB "
                f"{'within' if ok else 'OVER'} {preset}'s reserve of {reserve / gib:.2f} GiB; the peers' buffers "
                "(NVLS, NCCL_BUFFSIZE per channel and peer) need >= 2 GPUs, not measured",
                outside_GiB=outside / gib, communicator_MiB=each_comm / mib, world_communicator_MiB=world_comm / mib,
                need_GiB=need / gib, reserve_GiB=reserve / gib)


def _outside(device) -> int:
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_row(device, device_name: str) -> dict:
    """The row (module docstring); on the CPU it needs a GPU."""
    if device.type != "cuda":
        return _row(NAME, NEEDS_GPU, "the CUDA context, libraries and NCCL communicators are device memory")
    import torch
    import torch.distributed as dist

    from megatron_2bw.planner.hardware import load_cluster

    if dist.is_initialized():
        return _row(NAME, FAIL, "a process group is already initialized in the script's process")
    outside = _outside(device)
    x = torch.ones(1, device=device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            device_id=device)
    try:
        dist.all_reduce(x)
        after_world = _outside(device)
        groups = [dist.new_group([0]) for _ in range(COMMUNICATORS - 1)]
        for g in groups:
            dist.all_reduce(x, group=g)
        after = _outside(device)
    finally:
        dist.destroy_process_group()
    preset = preset_of(device_name)
    return verdict(outside, after_world - outside, (after - after_world) / (COMMUNICATORS - 1),
                   load_cluster(preset).reserved_memory_bytes, preset)
