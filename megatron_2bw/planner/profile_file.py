"""A measured profile in memory and on disk: the planner's ``LayerCosts`` plus the extras the
simulator uses (the forward without autograd, timing samples, the optimizer step's cost).

``Profile.to_json`` writes the ``megatron_2bw-profile-v1`` schema of ``layer_costs.py`` plus
entry-level keys that ``layer_costs.load_profile`` ignores (``measured``) and top-level ``meta`` /
``optimizer`` / ``model``; :func:`load_full_profile` reads them back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import ModelConfig
from ..errors import ConfigError
from .block_timing import BlockMeasurement
from .layer_costs import LayerCosts, MicrobatchCosts, layer_costs_from_json, read_profile_json

BLOCKS = ("embedding", "layer", "head")


@dataclass(frozen=True)
class MicrobatchProfile:
    """The three blocks at one (t, b), measured."""

    tensor_parallel: int
    micro_batch_size: int
    embedding: BlockMeasurement
    layer: BlockMeasurement
    head: BlockMeasurement
    tied_params: int

    def costs(self) -> MicrobatchCosts:
        return MicrobatchCosts(self.layer.block_cost(), self.embedding.block_cost(), self.head.block_cost(),
                               tied_params=self.tied_params)

    def block(self, name: str) -> BlockMeasurement:
        return getattr(self, name)


@dataclass(frozen=True)
class OptimizerCost:
    """Time of one optimizer step (``APPLY_UPDATE``) over ``n`` parameters: ``fixed_s + per_param_s * n``."""

    fixed_s: float
    per_param_s: float

    def seconds(self, num_params: int) -> float:
        return self.fixed_s + self.per_param_s * num_params


@dataclass
class Profile:
    """A measured profile: the planner's ``LayerCosts`` plus what the simulator also uses."""

    model: ModelConfig
    entries: dict[tuple[int, int], MicrobatchProfile] = field(default_factory=dict)
    optimizer: OptimizerCost | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def layer_costs(self) -> LayerCosts:
        return LayerCosts(self.source or "profile", {k: e.costs() for k, e in self.entries.items()})

    def to_json(self) -> dict[str, Any]:
        """``megatron_2bw-profile-v1`` (``layer_costs.py``) plus extras its loader ignores."""
        data = self.layer_costs().to_json()
        data["source"] = self.source
        for entry in data["entries"]:
            e = self.entries[(entry["tensor_parallel"], entry["micro_batch_size"])]
            entry["measured"] = {name: e.block(name).extras() for name in BLOCKS}
        data["model"] = asdict(self.model)
        data["meta"] = self.meta
        if self.optimizer is not None:
            data["optimizer"] = asdict(self.optimizer)
        return data

    def write(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")


@dataclass(frozen=True)
class LoadedProfile:
    """What :func:`load_full_profile` returns: the costs, and the extras when the file has them."""

    costs: LayerCosts
    measured: Mapping[tuple[int, int], Mapping[str, Mapping[str, Any]]]
    optimizer: OptimizerCost | None
    model: ModelConfig | None
    meta: Mapping[str, Any]

    def forward_nograd_s(self, t: int, b: int, block: str) -> float | None:
        v = self.measured.get((t, b), {}).get(block, {}).get("forward_nograd_s")
        return float(v) if v is not None else None


def load_full_profile(path: str | Path) -> LoadedProfile:
    """Read a profile file: ``LayerCosts`` via the planner's own parser, plus this module's extras."""
    data = read_profile_json(path)
    costs = layer_costs_from_json(data, str(path))
    measured = {(int(e["tensor_parallel"]), int(e["micro_batch_size"])): e.get("measured", {}) for e in data["entries"]}
    opt = data.get("optimizer")
    model = data.get("model")
    return LoadedProfile(
        costs=costs, measured=measured,
        optimizer=OptimizerCost(float(opt["fixed_s"]), float(opt["per_param_s"])) if isinstance(opt, Mapping) else None,
        model=ModelConfig(**model) if isinstance(model, Mapping) else None,
        meta=data.get("meta", {}),
    )


def merge_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile holding the entries of several (e.g. one per tensor-parallel size)."""
    if not profiles:
        raise ConfigError("no profiles to merge")
    out = Profile(profiles[0].model, {}, profiles[0].optimizer, dict(profiles[0].meta), profiles[0].source)
    for p in profiles:
        if p.model != out.model:
            raise ConfigError("cannot merge profiles of different models")
        for key, e in p.entries.items():
            if key in out.entries:
                raise ConfigError(f"two profiles measured (t={key[0]}, b={key[1]})")
            out.entries[key] = e
    if len(profiles) > 1:
        out.meta["tensor_parallel"] = sorted({k[0] for k in out.entries})
    return out
