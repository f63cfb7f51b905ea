"""Does a measured profile fit the plan it is given to? A profile of another model shape, precision
or kind of device is refused with one line (a 5M-parameter fp32 CPU profile once made GPT-3.8B
"fit in 0.25 GiB" on V100s). Torch-free, like ``layer_costs``: ``tools/plan.py`` imports it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from ..config import ModelConfig
from ..errors import ConfigError
from .layer_costs import LayerCosts, layer_costs_from_json, read_profile_json

# What a microbatch's per-layer, embedding and head costs depend on (the depth does not: costs are per layer).
PROFILE_MODEL_FIELDS = ("kind", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
                        "num_tokentypes")
_GPU_FAMILY = re.compile(r"\b([A-Z]{1,2}\d{2,4})\b")


def device_kind(name: str, device_type: str | None = None) -> str:
    """``cpu``, a GPU family (``V100``, ``A100``, ``H100``, ...) from a device's name, or ``cuda``."""
    if device_type == "cpu" or name.upper().startswith("CPU") or (device_type is None and "cpu" in name.lower()):
        return "cpu"
    m = _GPU_FAMILY.search(name.upper())
    return m.group(1) if m else "cuda"


def _same_kind(a: str, b: str) -> bool:
    """Equal kinds, or a GPU whose family the name does not tell beside any GPU."""
    return a == b or ("cpu" not in (a, b) and "cuda" in (a, b))


def check_profile_fits(path: str | Path, data: Mapping[str, Any], model: ModelConfig, precision: str,
                       device: str | None) -> None:
    """Refuse a profile measured on another model shape, precision or kind of device (one line).

    A profile records its model (``model``) and where it ran (``meta``: ``dtype``, ``device``,
    ``device_type``); one without a record (hand-written, or older) is not compared on that point.
    ``device``: the plan's device name (the cluster's ``device``), None to skip that check.
    """
    where = f"--profile {path}"
    saved = data.get("model")
    if isinstance(saved, Mapping):
        diff = [f"{f} {saved[f]} (this plan: {getattr(model, f)})" for f in PROFILE_MODEL_FIELDS
                if f in saved and saved[f] != getattr(model, f)]
        if diff:
            raise ConfigError(f"{where} was measured on another model: {', '.join(diff)}; profile this model "
                              "(tools/profile_model.py with the same shape flags) or plan without --profile")
    meta = data.get("meta") if isinstance(data.get("meta"), Mapping) else {}
    if meta.get("dtype") is not None and meta["dtype"] != precision:
        raise ConfigError(f"{where} was measured in {meta['dtype']} but the plan is for {precision}; profile in "
                          f"{precision} (tools/profile_model.py --precision {precision}) or plan with --precision "
                          f"{meta['dtype']}")
    if device is not None and (meta.get("device") is not None or meta.get("device_type") is not None):
        theirs = device_kind(str(meta.get("device") or ""), meta.get("device_type"))
        mine = device_kind(device)
        if not _same_kind(theirs, mine):
            raise ConfigError(f"{where} was measured on {meta.get('device') or meta.get('device_type')} "
                              f"({theirs}) but the plan's devices are {device} ({mine}): profile on that kind of "
                              "device, or plan without --profile")


def load_checked_profile(path: str | Path, model: ModelConfig, precision: str, device: str | None) -> LayerCosts:
    """``layer_costs.load_profile`` after :func:`check_profile_fits`."""
    data = read_profile_json(path)
    check_profile_fits(path, data, model, precision, device)
    # the profiler measured the model as configured, --sequence-parallel included
    return replace(layer_costs_from_json(data, str(path)), sequence_parallel=model.sequence_parallel)
