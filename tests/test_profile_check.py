"""A planner profile of another model shape, precision or kind of device is refused (issue 19, item 2).

The newcomer's case: a 5M-parameter fp32 CPU profile made GPT-3.8B "fit in 0.25 GiB" on V100s. Through
``tools/plan.py --profile`` (one ``error:`` line, exit 2) and the trainer's ``--auto-plan-profile`` path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.auto_plan import profile_or_load
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.profile_check import device_kind
from megatron_2bw.planner.search import PlanRequest, default_costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = get_preset("gpt-tiny")


def _profile(path, model=TINY, dtype="fp32", device="x86_64", device_type="cpu") -> str:
    """A profile file as tools/profile_model.py writes it (costs from the analytic model, for speed)."""
    data = default_costs(PlanRequest(model, load_cluster("dgx-h100"), 4, 16, dtype)).to_json()
    data.update(source="test", model=asdict(model), meta={"dtype": dtype, "device": device, "device_type": device_type})
    path.write_text(json.dumps(data))
    return str(path)


def _plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_device_kind():
    assert device_kind("NVIDIA V100-SXM2-16GB") == "V100"
    assert device_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert device_kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert device_kind("CPU (this host)") == "cpu" and device_kind("x86_64", "cpu") == "cpu"
    assert device_kind("Some GPU", "cuda") == "cuda"


def test_plan_refuses_a_foreign_profile(tmp_path):
    cpu_tiny = _profile(tmp_path / "tiny.json")
    cases = [
        (["--model-preset", "gpt-3.8b", "--precision", "fp16"],
         f"error: --profile {cpu_tiny} was measured on another model: hidden_size 64 (this plan: 3072), "),
        (["--model-preset", "gpt-tiny", "--precision", "fp16"],
         f"error: --profile {cpu_tiny} was measured in fp32 but the plan is for fp16; "),
        (["--model-preset", "gpt-tiny", "--precision", "fp32"],
         f"error: --profile {cpu_tiny} was measured on x86_64 (cpu) but the plan's devices are NVIDIA "
         "V100-SXM2-16GB (V100): "),
    ]
    for flags, want in cases:
        res = _plan(*flags, "--num-gpus", "4", "--global-batch-size", "16", "--profile", cpu_tiny)
        assert res.returncode == 2 and res.stderr.startswith(want) and len(res.stderr.splitlines()) == 1, \
            (flags, res.stderr)
        assert "Traceback" not in res.stderr and not res.stdout
    # the profile of this model, precision and device kind is used (an H100 profile on an H100 cluster)
    h100 = _profile(tmp_path / "h100.json", dtype="bf16", device="NVIDIA H100 80GB HBM3", device_type="cuda")
    res = _plan("--model-preset", "gpt-tiny", "--precision", "bf16", "--cluster", "dgx-h100", "--num-gpus", "4",
                "--global-batch-size", "16", "--profile", h100, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["costs_source"].startswith(f"profile {h100}")


def test_auto_plan_profile_of_another_model_is_refused(tmp_path):
    path = _profile(tmp_path / "tiny.json")
    other = get_preset("bert-tiny")
    with pytest.raises(ConfigError, match=r"was measured on another model: kind gpt \(this plan: bert\)"):
        profile_or_load(other, profile_path=path, device=torch.device("cpu"), precision="fp32", sizes=[1])
    with pytest.raises(ConfigError, match="was measured in fp32 but the plan is for bf16"):
        profile_or_load(TINY, profile_path=path, device=torch.device("cpu"), precision="bf16", sizes=[1])
    costs, profiled = profile_or_load(TINY, profile_path=path, device=torch.device("cpu"), precision="fp32", sizes=[1])
    assert not profiled and costs.micro_batch_sizes(1)
