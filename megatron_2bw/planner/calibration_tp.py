"""Tensor and sequence parallelism against published measurements (docs/planner.md section 7.2).

Three sets, all in ``published.json``:

- ``tensor_parallel_runs``: Korthikanti et al. 2022, Table 5: t = 8 inside a DGX A100 server (and
  pipelines of such servers), each with full recomputation and with sequence parallelism plus selective
  recomputation, as seconds per iteration; priced like section 7's runs (``calibration.predict_run``).
- ``paper_systems``: the PipeDream-2BW paper's Figure 6a: GPT-2.2B on one 8-V100 server, batch 64. Each
  system gets its best layout of the paper's own search space (the paper's planner: even stages,
  whole-stage recomputation, fp16 gradients, the replicated optimizer, no sequence parallelism): 2BW,
  PipeDream-Flush and GPipe pipelines at t = 1, tensor MP at t = 8 without a pipeline, inter-layer model
  parallelism over the 8 GPUs without pipelining.
- its 64-GPU GPT-3.8B result: 2BW up to 20x tensor MP where tensor MP crosses servers; priced for tensor
  groups of 8 (inside a server), 16 and 32 (across 2 and 4 servers; the 32 heads allow no wider group).

A prediction within ``TOLERANCE`` of its published value agrees; ``KNOWN_MISSES`` names the ones that do
not and why (the test holds the rest within it, and these on their documented side).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .calibration import PUBLISHED, TOLERANCE, CalibrationRow, calibration, load_published
from .hardware import Cluster, load_cluster
from .layer_costs import analytic_layer_costs
from .memory_model import SEQUENTIAL, Candidate
from .report import paper_model
from .search import Evaluated, PlanRequest, evaluate, micro_batch_sizes, search

# the predictions outside TOLERANCE -> the term that is off and why it stays (docs/planner.md section 7.2)
KNOWN_MISSES = {
    "530B full recompute": "priced as 1F1B; the source's 35-stage pipeline schedule is not stated (its interleaved "
                           "one cuts the bubble by up to 10%): 15.2% low",
    "flush": "the V100 curve's level (max_fraction 0.36, Megatron 2019 on one GPU) puts every V100 prediction about "
             "10% under Figure 6a, and Flush's bubble at m = 8 about 5% more: 16% low, 2BW over Flush within 7%",
    "gpipe": "GPipe priced as the engine runs it, within 1-7% of Flush on one layout (docs/data/throughput.json); "
             "the paper's GPipe ran at half of Flush's rate",
    "inter-layer over 2bw": "2BW 10% low (above) and inter-layer 7% high: 2BW over inter-layer 4.2x against about 5x",
    "tensor MP across servers": "the tensor all-reduce across servers priced at the 25 Gbit/s line rate; 2BW over "
                                "t = 32 (4 servers) 13x against up to 20x",
}


def _data() -> dict[str, Any]:
    return json.loads(PUBLISHED.read_text())["paper_systems"]


def korthikanti() -> list[CalibrationRow]:
    """Korthikanti et al. 2022's runs (``tensor_parallel_runs``), predicted."""
    return calibration(load_published(section="tensor_parallel_runs")[1])


@dataclass(frozen=True)
class SystemRow:
    """One system of Figure 6a: published samples/s beside the planner's best layout of it."""

    system: str
    published: float
    best: Evaluated | None

    @property
    def predicted(self) -> float:
        return self.best.samples_per_sec if self.best else 0.0

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def layout(self) -> str:
        if self.best is None:
            return "does not fit"
        c = self.best.candidate
        return (f"t{c.tensor_parallel} d{c.pipeline_parallel} w{c.data_parallel} b{c.micro_batch_size}"
                f"{' rc' if c.recompute else ''}")


def _selectors(n: int) -> dict[str, Any]:
    return {"2bw": lambda c: c.schedule == "2bw" and c.tensor_parallel == 1,
            "flush": lambda c: c.schedule == "flush" and c.pipeline_parallel > 1 and c.tensor_parallel == 1,
            "tensor-mp": lambda c: c.pipeline_parallel == 1 and c.tensor_parallel == n,
            "gpipe": lambda c: c.schedule == "gpipe" and c.tensor_parallel == 1,
            "inter-layer": lambda c: c.schedule == SEQUENTIAL and c.tensor_parallel == 1 and c.pipeline_parallel == n}


def paper_request(name: str, cluster: Cluster, n: int, batch: int, schedules: tuple[str, ...]) -> PlanRequest:
    """The paper's own search space for its model ``name`` (its planner's settings, module docstring)."""
    return PlanRequest(paper_model(name), cluster, n, batch, schedules=schedules, balance_stages=False,
                       distributed_optimizer_options=(False,))


def paper_systems(cluster: Cluster | None = None) -> list[SystemRow]:
    """Figure 6a's systems, published and predicted (each one's best layout in the paper's search space)."""
    data = _data()
    cluster = cluster or load_cluster(data["cluster"])
    n, batch = data["num_gpus"], data["global_batch_size"]
    keep = _selectors(n)
    req = paper_request(data["model"], cluster, n, batch, ("2bw", "flush", "gpipe", SEQUENTIAL))
    result = search(req, top=0, keep=keep, require_fit=False)
    return [SystemRow(s, float(v), result.best_of[s]) for s, v in data["samples_per_sec"].items()]


def tensor_mp(model_name: str, cluster: Cluster, n: int, batch: int, t: int) -> Evaluated | None:
    """The fastest tensor-MP layout (no pipeline, ``w = n/t``) that fits, at any ``b`` and recomputation; ``t``
    may exceed a server (the search never builds such a group; the paper's 64-GPU baseline did)."""
    req = paper_request(model_name, cluster, n, batch, ("flush",))
    w = n // t
    sizes = tuple(b for b in micro_batch_sizes(64) if batch % (b * w) == 0)
    costs = analytic_layer_costs(req.model, cluster, req.precision, (t,), sizes)
    best = None
    for b in sizes:
        for rc in (False, True):
            ev = evaluate(Candidate(t, 1, w, b, batch // (b * w), rc, "flush"), costs, req)
            if ev.prediction and (best is None or ev.samples_per_sec > best.samples_per_sec):
                best = ev
    return best


@dataclass(frozen=True)
class TensorMPRow:
    """2BW's best layout (the paper's search space) over tensor MP of one group size, one batch."""

    global_batch_size: int
    tensor_parallel: int
    two_bw: Evaluated
    tensor: Evaluated | None

    @property
    def speedup(self) -> float | None:
        return self.two_bw.samples_per_sec / self.tensor.samples_per_sec if self.tensor else None


def tensor_mp_64(cluster: Cluster | None = None) -> list[TensorMPRow]:
    """The paper's 64-GPU tensor-MP comparison (GPT-3.8B): 2BW over tensor groups of 8, 16 and 32."""
    data = _data()["tensor_mp_64"]
    cluster = cluster or load_cluster(_data()["cluster"])
    n, name = data["num_gpus"], data["model"]
    heads = paper_model(name).num_attention_heads
    rows = []
    for batch in data["global_batch_sizes"]:
        req = paper_request(name, cluster, n, batch, ("2bw",))
        two_bw = search(req, top=0, keep={"2bw": lambda c: c.tensor_parallel == 1}).best_of["2bw"]
        for t in (8, 16, 32):
            if heads % t == 0 and n % t == 0:
                rows.append(TensorMPRow(batch, t, two_bw, tensor_mp(name, cluster, n, batch, t)))
    return rows


def format_tensor_calibration(kor: list[CalibrationRow], systems: list[SystemRow], tmp: list[TensorMPRow]) -> str:
    """The three tables of docs/planner.md section 7.2."""
    def mark(name: str, ratio: float) -> str:
        return "" if abs(ratio - 1) <= TOLERANCE else (" (known)" if name in KNOWN_MISSES else " *")

    lines = [f"{'run (Korthikanti et al. 2022, A100)':<36} {'t':>2} {'p':>3} {'GPUs':>5} {'B':>4} "
             f"{'published':>10} {'predicted':>10} {'ratio':>6}"]
    for r in kor:
        run = r.run
        lines.append(f"{run.name:<36} {run.tensor_parallel:>2} {run.pipeline_parallel:>3} {run.num_gpus:>5} "
                     f"{run.global_batch_size:>4} {run.samples_per_sec:>10.3f} {r.samples_per_sec:>10.3f} "
                     f"{r.ratio:>6.2f}{mark(run.name, r.ratio)}")
    lines += ["", f"{'Figure 6a (GPT-2.2B, 8 V100, B=64)':<36} {'layout':<16} {'published':>10} {'predicted':>10} "
                  f"{'ratio':>6} {'2BW over it: pub/pred':>22}"]
    two = next(s for s in systems if s.system == "2bw")
    for s in systems:
        over = f"{two.published / s.published:.2f}/{two.predicted / s.predicted:.2f}" if s.predicted else "-"
        lines.append(f"{s.system:<36} {s.layout:<16} {s.published:>10.1f} {s.predicted:>10.1f} {s.ratio:>6.2f}"
                     f"{mark(s.system, s.ratio):<8} {over:>14}")
    lines += ["", f"{'GPT-3.8B, 64 V100':<20} {'B':>5} {'t':>3} {'2BW':>16} {'tensor MP':>18} {'2BW over TP':>12}"]
    for r in tmp:
        c, tp = r.two_bw.candidate, r.tensor
        tp_text = (f"{tp.samples_per_sec:.1f} w{tp.candidate.data_parallel} b{tp.candidate.micro_batch_size}"
                   if tp else "-")
        lines.append(f"{'':<20} {r.global_batch_size:>5} {r.tensor_parallel:>3} "
                     f"{f'{r.two_bw.samples_per_sec:.1f} d{c.pipeline_parallel} w{c.data_parallel}':>16} "
                     f"{tp_text:>18} {(f'{r.speedup:.1f}x' if r.speedup else '-'):>12}")
    lines.append(f"samples/s; ratio = predicted / published (*: outside {TOLERANCE:.0%}; (known): docs/planner.md "
                 "section 7.2 says why); the paper: 2BW up to 20x tensor MP on 64 GPUs")
    return "\n".join(lines)


def tensor_calibration_json(kor: list[CalibrationRow], systems: list[SystemRow],
                            tmp: list[TensorMPRow]) -> dict[str, Any]:
    return {
        "korthikanti_2022": [{"name": r.run.name, "published_samples_per_sec": round(r.run.samples_per_sec, 4),
                              "predicted_samples_per_sec": round(r.samples_per_sec, 4), "ratio": round(r.ratio, 4)}
                             for r in kor],
        "figure_6a": [{"system": s.system, "layout": s.layout, "published_samples_per_sec": s.published,
                       "predicted_samples_per_sec": round(s.predicted, 3), "ratio": round(s.ratio, 4)}
                      for s in systems],
        "tensor_mp_64": [{"global_batch_size": r.global_batch_size, "tensor_parallel": r.tensor_parallel,
                          "two_bw_samples_per_sec": round(r.two_bw.samples_per_sec, 3),
                          "tensor_mp_samples_per_sec": round(r.tensor.samples_per_sec, 3) if r.tensor else None,
                          "speedup": round(r.speedup, 3) if r.speedup else None} for r in tmp],
    }
