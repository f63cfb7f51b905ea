"""A cluster description: device memory and speed, server size, links inside and between servers.

Read from JSON (a preset name from ``planner/clusters/`` or a file path), so a user describes a new
cluster without touching code. Units are in the key names, as on spec sheets::

    {
      "name": "aws-p3.16xlarge",
      "device": "NVIDIA V100-SXM2-16GB",
      "device_memory_GiB": 15.78,          # what the driver reports as total
      "reserved_memory_GiB": 1.0,          # CUDA context, NCCL buffers, cuBLAS workspace, fragmentation
      "peak_TFLOPs": {"fp16": 125, "fp32": 15.7},   # dense tensor-core peak; absent = unsupported
      "memory_bandwidth_GBps": 900,        # HBM, for memory-bound terms (optimizer step, softmax)
      "devices_per_server": 8,
      "intra_server_allreduce_GBps": 130,  # NCCL all-reduce *bus* bandwidth inside one server
      "intra_server_p2p_GBps": 45,         # one GPU sending to another GPU of its server
      "inter_server_Gbps": 25,             # one server's NIC, each direction, shared by its GPUs
      "efficiency": {"max_fraction_of_peak": 0.62, "half_work_macs": 1.0e10},  # efficiency.py
      "flash_attention": false,            # fused attention kernel: no s^2 activations (default false)
      "attention_backend": "auto",         # the run's --attention-backend (optional; default auto)
      "sources": ["..."]
    }

The cost model turns these into times; see ``cost_model.py`` for how the NIC is shared.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..config import ATTENTION_BACKENDS
from ..errors import ConfigError
from .efficiency import EfficiencyCurve

PRESET_DIR = Path(__file__).resolve().parent / "clusters"
GiB = 1024**3


@dataclass(frozen=True)
class Cluster:
    """One homogeneous cluster; all bandwidths in bytes/s, memory in bytes, speed in FLOP/s."""

    name: str
    device: str
    device_memory_bytes: int
    reserved_memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    devices_per_server: int
    intra_server_allreduce_bandwidth: float
    intra_server_p2p_bandwidth: float
    inter_server_bandwidth: float
    efficiency: EfficiencyCurve
    # the engine's attention (F.scaled_dot_product_attention) runs a fused flash / memory-efficient
    # kernel here: no s^2 tensors kept or moved (GPUs with such kernels; the CPU's math path keeps them)
    flash_attention: bool = False
    description: str = ""
    sources: tuple[str, ...] = field(default=())
    # the run's --attention-backend (config.ATTENTION_BACKENDS): auto takes this device's default kernel
    # (``layer_costs.attention_kernel``); tools/plan.py --attention-backend sets it
    attention_backend: str = "auto"
    # the run's --reset-attention-mask (documents): the attention takes a mask of documents, which changes the
    # kernel (``layer_costs.attention_kernel``) and the ring's tiles (``context_costs``); tools/plan.py sets it
    reset_attention_mask: bool = False

    @property
    def is_cpu(self) -> bool:
        """CPU processes (the cpu-host preset, ``auto_plan.host_cluster``): torch's CPU kernels apply."""
        return self.device.upper().startswith("CPU")

    def __post_init__(self) -> None:
        where = f"cluster {self.name!r}"
        if self.device_memory_bytes <= 0:
            raise ConfigError(f"{where}: device_memory_GiB must be positive")
        if not 0 <= self.reserved_memory_bytes < self.device_memory_bytes:
            raise ConfigError(f"{where}: reserved_memory_GiB must be >= 0 and below device_memory_GiB")
        if self.devices_per_server <= 0:
            raise ConfigError(f"{where}: devices_per_server must be positive")
        for key in ("memory_bandwidth", "intra_server_allreduce_bandwidth", "intra_server_p2p_bandwidth",
                    "inter_server_bandwidth"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{where}: {key} must be positive")
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ConfigError(f"{where}: peak_TFLOPs needs at least one positive entry")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"{where}: attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")

    @property
    def usable_memory_bytes(self) -> int:
        """Memory a training process can fill with tensors."""
        return self.device_memory_bytes - self.reserved_memory_bytes

    def peak(self, precision: str) -> float:
        """Peak dense FLOP/s for ``precision``, refusing one the device lacks (bf16 on a V100)."""
        if precision not in self.peak_flops:
            raise ConfigError(
                f"{self.device} in cluster {self.name!r} has no {precision} peak "
                f"(supports {', '.join(sorted(self.peak_flops))})"
            )
        return self.peak_flops[precision]


def _num(data: Mapping[str, Any], key: str, source: str) -> float:
    if key not in data:
        raise ConfigError(f"cluster {source}: missing key {key!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"cluster {source}: {key!r} must be a number, got {value!r}")
    return float(value)


def _flag(data: Mapping[str, Any], key: str, source: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"cluster {source}: {key!r} must be true or false, got {value!r}")
    return value


def _efficiency(eff: Mapping[str, Any], source: str) -> EfficiencyCurve:
    """``half_work_macs`` (x = b*s*h^2/t) or the earlier ``half_work_elements`` (x = b*s*h/t)."""
    keys = [k for k in ("half_work_macs", "half_work_elements") if k in eff]
    if len(keys) != 1:
        raise ConfigError(f"cluster {source}: 'efficiency' needs exactly one of half_work_macs, half_work_elements")
    unit = keys[0].removeprefix("half_work_")
    return EfficiencyCurve(_num(eff, "max_fraction_of_peak", source), _num(eff, keys[0], source), unit)


def cluster_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Cluster:
    """Build a ``Cluster`` from the JSON schema in this module's docstring."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"cluster {source}: expected a JSON object")
    peak = data.get("peak_TFLOPs")
    if not isinstance(peak, Mapping):
        raise ConfigError(f"cluster {source}: 'peak_TFLOPs' must be an object like {{\"fp16\": 125}}")
    eff = data.get("efficiency")
    if not isinstance(eff, Mapping):
        raise ConfigError(f"cluster {source}: 'efficiency' must be an object with max_fraction_of_peak "
                          "and half_work_macs")
    return Cluster(
        name=str(data.get("name", source)),
        device=str(data.get("device", "unknown device")),
        device_memory_bytes=int(_num(data, "device_memory_GiB", source) * GiB),
        reserved_memory_bytes=int(_num(data, "reserved_memory_GiB", source) * GiB),
        peak_flops={str(k): float(v) * 1e12 for k, v in peak.items() if v is not None},
        memory_bandwidth=_num(data, "memory_bandwidth_GBps", source) * 1e9,
        devices_per_server=int(_num(data, "devices_per_server", source)),
        intra_server_allreduce_bandwidth=_num(data, "intra_server_allreduce_GBps", source) * 1e9,
        intra_server_p2p_bandwidth=_num(data, "intra_server_p2p_GBps", source) * 1e9,
        inter_server_bandwidth=_num(data, "inter_server_Gbps", source) * 1e9 / 8,
        efficiency=_efficiency(eff, source),
        flash_attention=_flag(data, "flash_attention", source),
        attention_backend=str(data.get("attention_backend", "auto")),
        description=str(data.get("description", "")),
        sources=tuple(str(s) for s in data.get("sources", ())),
    )


def cluster_presets() -> list[str]:
    """Names of the shipped presets (file stems in ``planner/clusters``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_cluster(spec: str) -> Cluster:
    """A preset name, or a path to a JSON file; anything else is a one-line ``ConfigError``."""
    looks_like_path = spec.endswith(".json") or os.sep in spec or "/" in spec
    path = Path(spec) if looks_like_path else PRESET_DIR / f"{spec}.json"
    if not path.is_file():
        if looks_like_path:
            raise ConfigError(f"--cluster file {spec!r} does not exist")
        raise ConfigError(f"unknown --cluster preset {spec!r}; choose one of {', '.join(cluster_presets())} "
                          "or give a JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--cluster {spec!r} is not readable JSON: {exc}".replace("\n", " ")) from None
    return cluster_from_dict(data, str(path) if looks_like_path else spec)
