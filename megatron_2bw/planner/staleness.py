"""The expected cost of a schedule's stale gradients, shown beside its throughput.

Synchronous schedules (Flush, GPipe, one stage, the sequential baseline) compute every gradient on
the weights they update: no cost. PipeDream-2BW's gradients are ``stale_steps`` (1) updates behind
(``ScheduleSpec.stale_steps``); what that costs depends on the model, the optimizer and the learning
rate, and nothing in the planner can predict it. What it reports instead is what this project
measured: the final validation loss of 2BW over Flush's with the same data, seeds and steps
(``staleness.json``, a summary of ``docs/data/convergence_optimizers.json``, per optimizer and
``--2bw-compensation`` mode, the one a candidate would train with), on the small gpt-demo
model on CPU, and the wall time 2BW took to its final loss over the time Flush took to reach the
same loss (``time_vs_flush_to_2bw_final_loss``, in the JSON). The report labels it so; the ranking
stays by throughput (``tools/plan.py --schedules flush,gpipe`` searches only the synchronous
schedules).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..config import resolve_compensation
from ..schedule.schedules import spec_of
from .memory_model import SEQUENTIAL, Candidate

STALENESS = Path(__file__).resolve().parent / "staleness.json"
REGIMES = ("paper", "aggressive")  # the paper's learning rate (3e-4), and 1e-3


@lru_cache(maxsize=1)
def measured() -> dict[str, Any]:
    """The measured loss ratios (``staleness.json``)."""
    return json.loads(STALENESS.read_text())


@dataclass(frozen=True)
class Staleness:
    """A candidate's stale updates and, where stale, the measured loss ratios per regime."""

    stale_steps: int
    valid_loss_ratio: dict[str, float]  # regime -> 2BW's final validation loss over Flush's (empty: none)
    # regime -> 2BW's wall time to its final loss over the time Flush took to reach the same loss
    time_to_loss_ratio: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """Short cell: ``none``, or the measured loss increase over the regimes, e.g. ``+2.7..9.2%*``."""
        if not self.stale_steps:
            return "none"
        pct = sorted((r - 1) * 100 for r in self.valid_loss_ratio.values())
        return f"{pct[0]:+.1f}..{pct[-1]:.1f}%*" if len(pct) > 1 else f"{pct[0]:+.1f}%*"  # below Flush: -x

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stale_steps": self.stale_steps}
        if self.stale_steps:
            m = measured()
            out["valid_loss_ratio_vs_flush"] = self.valid_loss_ratio
            out["time_vs_flush_to_2bw_final_loss"] = self.time_to_loss_ratio
            out["measured_on"] = f"{m['model']}; {m['source']}"
        return out


def stale_steps(c: Candidate) -> int:
    """Updates the gradients lag behind (0: synchronous); one stage has no pipeline to lag."""
    if c.schedule == SEQUENTIAL or c.pipeline_parallel == 1:
        return 0
    return spec_of(c.schedule).stale_steps


def measured_key(compensation: str, optimizer: str = "adam") -> str:
    """The key of a (compensation, optimizer) in ``staleness.json``: the mode for Adam (the measured AdamW
    runs; SGD is not measured and reads Adam's), ``muon/<mode>`` for Muon."""
    return f"muon/{compensation}" if optimizer == "muon" else compensation


def staleness(c: Candidate, compensation: str = "none", optimizer: str = "adam", precision: str = "fp32") -> Staleness:
    """The staleness cost of ``c`` (``compensation``: the trainer's ``--2bw-compensation``, ``auto`` resolved as
    the trainer resolves it for ``c``; a mode never measured with ``optimizer`` shows plain 2BW's ratio)."""
    n = stale_steps(c)
    if not n:
        return Staleness(0, {})
    mode = resolve_compensation(compensation, spec_of(c.schedule).stale_steps, optimizer, precision,
                                c.distributed_optimizer)
    regimes = measured()["regimes"]
    here = [r for r in REGIMES if r in regimes]

    def pick(r: str, what: str) -> float:
        table = regimes[r][what]
        return table.get(measured_key(mode, optimizer), table[measured_key("none", optimizer)])

    return Staleness(n, {r: pick(r, "valid_loss_ratio_vs_flush") for r in here},
                     {r: pick(r, "time_vs_flush_to_2bw_final_loss") for r in here})


STALENESS_NOTE = ("* staleness: 2BW's final validation loss over Flush's, measured on the small gpt-demo model "
                  "(CPU, 300-500 steps, learning rates 3e-4..1e-3; docs/data/convergence_optimizers.json), "
                  "not a prediction for this model; Flush/GPipe: none")
