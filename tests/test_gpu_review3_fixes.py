"""Review 3's G8 and G9, checked on the CPU with torch.cuda's calls recorded (no GPU here).

- G8: ``RNGTracker`` seeds its CUDA stream with ``torch.cuda.manual_seed``, which seeds the *current* device:
  the call now runs inside ``torch.cuda.device(self.device)``, so a tracker made while another device is
  current still seeds its own.
- G9: the apex probe's device under ``srun`` without torchrun (``SLURM_LOCALID`` only) is the task's GPU.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_2bw import fused
from megatron_2bw.tensor_parallel.random import RNGTracker


def test_tracker_seeds_its_own_cuda_device(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def device(d):
        calls.append(("enter", str(torch.device(d))))
        yield
        calls.append(("exit", str(torch.device(d))))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(("seed", seed)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d=None: torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, d=None: None)
    tracker = RNGTracker(1234, 3, "cuda:1")
    assert calls == [("enter", "cuda:1"), ("seed", tracker.seed), ("exit", "cuda:1")], calls


def test_apex_probe_device_under_srun(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert fused._probe_device() == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun's wins
    assert fused._probe_device() == torch.device("cuda", 2)
