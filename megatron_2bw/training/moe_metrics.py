"""MoE statistics as the log and the metrics file carry them: per-call values added up (:class:`Sums`), named
as Megatron logs them, and packed into the per-step reduction (``step_stats.py``) so that rank 0 writes every
stage's layers into the metrics file's ``train`` records under ``"moe"``.

Per MoE layer: the balancing losses the run computes (``load_balancing_loss`` or ``seq_load_balancing_loss``,
``z_loss``; without their coefficients), ``tokens_per_expert_max_over_mean`` and, with a capacity,
``dropped_tokens`` (a sum); the losses also averaged over the layers, as Megatron's line shows them. In the
metrics file, at the steps a ``--log-interval`` logs (and the last), each value is the mean over the calls of
the steps since the last logged one and over the stage's data ranks (other steps read nothing from the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.moe import MoEConfig

LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
NAMES = {"max_over_mean": "tokens_per_expert_max_over_mean", "dropped": "dropped_tokens"}


@dataclass
class Sums:
    """Per layer (global index): each value summed over the calls, and the calls."""

    sums: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)

    def add(self, index: int, vals: dict[str, torch.Tensor]) -> None:
        acc = self.sums.setdefault(index, {})
        for k, v in vals.items():
            acc[k] = acc[k] + v.float() if k in acc else v.float().clone()
        self.calls[index] = self.calls.get(index, 0) + 1

    def merge(self, other: Sums) -> None:
        """Add ``other``'s sums and calls into these."""
        for index, acc in other.sums.items():
            mine = self.sums.setdefault(index, {})
            for k, v in acc.items():
                mine[k] = mine[k] + v if k in mine else v
            self.calls[index] = self.calls.get(index, 0) + other.calls[index]

    def copy(self) -> Sums:
        return Sums({k: dict(v) for k, v in self.sums.items()}, dict(self.calls))

    def take(self) -> dict[str, float]:
        """The named values per layer (means over the calls; dropped tokens summed), then the losses averaged
        over the layers; the sums restart."""
        out: dict[str, float] = {}
        for index in sorted(self.sums):
            acc, n = self.sums[index], self.calls[index]
            for k, v in acc.items():
                out[f"{NAMES.get(k, k)} layer {index}"] = float(v) / (1 if k == "dropped" else n)
        for k in LOSS_NAMES:
            per = [v for name, v in out.items() if name.startswith(f"{k} layer ")]
            if per:
                out[k] = sum(per) / len(per)
        self.sums, self.calls = {}, {}
        return out


def slots(moe: MoEConfig, num_layers: int) -> list[str]:
    """The per-layer names a run's metrics carry, in a fixed order (every rank builds the same list)."""
    keys = []
    if moe.moe_router_load_balancing_type != "none" and moe.moe_aux_loss_coeff > 0:
        keys.append("load_balancing_loss" if moe.moe_router_load_balancing_type == "aux_loss"
                    else "seq_load_balancing_loss")
    if moe.moe_z_loss_coeff:
        keys.append("z_loss")
    keys.append(NAMES["max_over_mean"])
    if moe.moe_expert_capacity_factor is not None:
        keys.append(NAMES["dropped"])
    return [f"{k} layer {i}" for i, on in enumerate(moe.moe_layers(num_layers)) if on for k in keys]


def vector(names: list[str], values: dict[str, float], share: float) -> list[float]:
    """This rank's part of the summed vector: its values (``names`` order; 0 for the layers it does not hold)
    times ``share`` (1 / the data ranks: the sum is their mean; 0 off the first tensor rank)."""
    return [values.get(n, 0.0) * share for n in names]


def named(names: list[str], vals: list[float]) -> dict[str, float]:
    """The reduced vector by name, with the losses averaged over the layers."""
    out = dict(zip(names, vals))
    for k in LOSS_NAMES:
        per = [v for n, v in out.items() if n.startswith(f"{k} layer ")]
        if per:
            out[k] = sum(per) / len(per)
    return out
