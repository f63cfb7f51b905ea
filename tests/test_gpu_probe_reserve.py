"""The device script's reserve row (review 3 N14), its CUDA branch run on the CPU with torch.cuda's and NCCL's
calls faked: the row derives the context's and one communicator's bytes from the device's free memory as each
step takes it, and holds them against the preset's reserve."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_probe_reserve as reserve  # noqa: E402

from megatron_2bw.planner.hardware import load_cluster  # noqa: E402

GiB, MiB = 2**30, 2**20


def _fake_device(monkeypatch, *, context: int, world_comm: int, each_comm: int) -> list[str]:
    """A GPU of 80 GiB whose allocator holds 10 GiB; the context, each communicator as it is made real."""
    held = {"outside": context}
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB - 10 * GiB - held["outside"],
                                                                           80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GiB)
    real_ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, device=None, **k: real_ones(*a, **k))
    made: set = set()

    def all_reduce(x, group=None):
        if group not in made:
            made.add(group)
            held["outside"] += world_comm if group is None else each_comm
        calls.append(f"all_reduce {group}")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(f"init {backend} "
                                                                                        f"{kw['world_size']}"))

    def new_group(ranks):
        calls.append("new")
        return f"group {calls.count('new')}"

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    return calls


def test_the_row_measures_the_context_and_one_communicator(monkeypatch):
    calls = _fake_device(monkeypatch, context=int(0.6 * GiB), world_comm=200 * MiB, each_comm=100 * MiB)
    row = reserve.reserve_row(torch.device("cuda", 0), "NVIDIA H100 80GB HBM3")
    assert calls[-1] == "destroy" and "init nccl 1" in calls and calls.count("new") == reserve.COMMUNICATORS - 1
    assert row["outside_GiB"] == pytest.approx(0.6) and row["world_communicator_MiB"] == pytest.approx(200)
    assert row["communicator_MiB"] == pytest.approx(100)
    assert row["need_GiB"] == pytest.approx(0.6 + (200 + 5 * 100) / 1024)
    assert row["reserve_GiB"] == pytest.approx(load_cluster("dgx-h100").reserved_memory_bytes / GiB)
    assert row["status"] == reserve.PASS and "within dgx-h100's reserve" in row["detail"]


def test_a_reserve_too_small_fails_the_row(monkeypatch):
    _fake_device(monkeypatch, context=2 * GiB, world_comm=300 * MiB, each_comm=300 * MiB)
    row = reserve.reserve_row(torch.device("cuda", 0), "NVIDIA H200")
    assert row["status"] == reserve.FAIL and "OVER dgx-h200's reserve" in row["detail"]
    assert row["reserve_GiB"] == pytest.approx(load_cluster("dgx-h200").reserved_memory_bytes / GiB)


def test_the_cpu_form_needs_a_gpu():
    assert reserve.reserve_row(torch.device("cpu"), "cpu")["status"] == reserve.NEEDS_GPU
