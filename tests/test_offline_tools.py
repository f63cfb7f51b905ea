"""The offline tools as safe as the trainer (issue 37): the exact commands of the issue's bad and poor
cases, each refused in one ``error:`` line (exit 2) or working."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict

from megatron_2bw.models.presets import get_preset
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.search import PlanRequest, default_costs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(name: str):
    """``tools/<name>.py`` as a module (its ``main`` is the command line)."""
    path = os.path.join(REPO, "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tool37_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_error(capsys, code: int, starts: str) -> str:
    """The single ``error:`` line a refused command printed (exit 2)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(starts), (code, err)
    return lines[0]


def test_simulate_refuses_a_cpu_profile_for_an_h200_cluster_as_plan_does(tmp_path, capsys):
    """Poor case: tools/simulate.py accepted a CPU profile for an H200 cluster where tools/plan.py refuses it."""
    model = get_preset("gpt-tiny")
    data = default_costs(PlanRequest(model, load_cluster("dgx-h200"), 4, 16, "fp32")).to_json()
    data.update(source="test", model=asdict(model), meta={"dtype": "fp32", "device": "x86_64", "device_type": "cpu"})
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    want = f"error: --profile {path} was measured on x86_64 (cpu) but the plan's devices are NVIDIA H200"
    code = tool("simulate").main(["--schedule", "2bw", "--d", "2", "--m", "4", "--profile", str(path),
                                  "--cluster", "dgx-h200", "--precision", "fp32"])
    one_error(capsys, code, want)
    code = tool("plan").main(["--model-preset", "gpt-tiny", "--precision", "fp32", "--cluster", "dgx-h200",
                              "--num-gpus", "4", "--global-batch-size", "16", "--profile", str(path)])
    one_error(capsys, code, want)
    # the same profile for the CPU host's cluster is simulated
    assert tool("simulate").main(["--schedule", "2bw", "--d", "2", "--m", "4", "--profile", str(path),
                                  "--cluster", "cpu-host", "--precision", "fp32"]) == 0, capsys.readouterr().err
