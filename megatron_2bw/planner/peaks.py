"""The dense peaks of known devices: the cluster preset a device name selects, and the PCIe and NVL parts
whose peak is not their SXM preset's. Read by the planner (``auto_plan.host_cluster``) and by the trainer's
log (MFU)."""

from __future__ import annotations

from .hardware import load_cluster

# a device name holding the key -> the cluster preset describing it
DEVICE_PRESETS = (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80gb"), ("V100", "aws-p3.16xlarge"))

# Dense peaks (TFLOP/s; no sparsity, no TF32: this trainer never enables it) of the parts whose name
# holds a cluster preset's key (DEVICE_PRESETS) but whose peak is not the preset's:
# the presets are SXM boards (H100 SXM 989 bf16), these are the PCIe and NVL cards.
PEAK_VARIANTS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of a known GPU in ``precision`` (a variant above, else the planner's
    cluster preset whose key the name holds), else None."""
    variant = next((peaks for key, peaks in PEAK_VARIANTS if key.upper() in device_name.upper()), None)
    if variant is not None:
        return variant.get(precision)
    preset = next((p for key, p in DEVICE_PRESETS if key in device_name.upper()), None)
    if preset is None:
        return None
    peaks = load_cluster(preset).peak_flops
    return peaks[precision] / 1e12 if precision in peaks else None
