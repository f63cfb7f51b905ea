"""What the options beyond the paper change on the paper's cluster: fp32 gradient accumulation and the
distributed optimizer (ZeRO-1), for GPT-2.2B and 3.8B on 64 V100s.

Each option set re-runs the search of the paper's comparison (2BW and Flush schedules) with its
gradient precision and optimizer, and keeps the best 2BW and PipeDream-Flush configurations; the largest model of the
3.8B shape (more layers, ``report.max_model_size``) is found per pipeline depth under each set. The
paper's own setting (fp16 gradients, every replica a whole optimizer) is the first set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .hardware import Cluster, GiB, load_cluster
from .report import BASELINES, PAPER_CLUSTER, ComparisonRow, MaxModelRow, _short, describe, max_model_size, paper_model
from .search import PlanRequest, search


@dataclass(frozen=True)
class OptionSet:
    """Gradient precision (None: the precision's default) and whether the search may shard the optimizer."""

    label: str
    fp32_grads: bool | None
    distributed_optimizer: bool

    @property
    def distributed_optimizer_options(self) -> tuple[bool, ...]:
        return (False, True) if self.distributed_optimizer else (False,)


OPTION_SETS = (
    OptionSet("paper: fp16 grads, replicated", None, False),
    OptionSet("+ distributed optimizer", None, True),
    OptionSet("fp32 grads, replicated", True, False),
    OptionSet("fp32 grads + distributed opt.", True, True),
)
OPTION_SCENARIOS = (("gpt-2.2b", 64, 512), ("gpt-2.2b", 64, 2048), ("gpt-3.8b", 64, 512), ("gpt-3.8b", 64, 2048))
MAX_MODEL_NAME, MAX_MODEL_DEPTHS = "gpt-3.8b", (1, 4, 16, 64)
SYSTEMS = {"2BW": lambda c: c.schedule == "2bw", "PipeDream-Flush": BASELINES["PipeDream-Flush"]}


@dataclass(frozen=True)
class OptionsRow:
    """One scenario under one option set: the paper's comparison row it gives."""

    options: OptionSet
    row: ComparisonRow


def options_comparison(cluster: Cluster | None = None,
                       scenarios: Iterable[tuple[str, int, int]] = OPTION_SCENARIOS,
                       option_sets: Iterable[OptionSet] = OPTION_SETS) -> list[OptionsRow]:
    """Every scenario under every option set (fp16, as the paper trained)."""
    cluster = cluster or load_cluster(PAPER_CLUSTER)
    sets = tuple(option_sets)
    out = []
    for name, n, b in scenarios:
        model = paper_model(name)
        for o in sets:
            req = PlanRequest(model, cluster, n, b, schedules=("2bw", "flush"), fp32_grads=o.fp32_grads,
                              distributed_optimizer_options=o.distributed_optimizer_options)
            best = dict(search(req, require_fit=False, top=0, keep=SYSTEMS).best_of)  # each system's best only
            out.append(OptionsRow(o, ComparisonRow(name, n, b, best)))
    return out


def options_max_model(cluster: Cluster | None = None, num_gpus: int = 64,
                      option_sets: Iterable[OptionSet] = OPTION_SETS) -> dict[str, list[MaxModelRow]]:
    """The largest 2BW model of the 3.8B shape per depth, under each option set."""
    cluster = cluster or load_cluster(PAPER_CLUSTER)
    template = paper_model(MAX_MODEL_NAME)
    return {o.label: max_model_size(template, cluster, num_gpus, MAX_MODEL_DEPTHS, "2bw", "fp16",
                                    distributed_optimizer=o.distributed_optimizer, fp32_grads=o.fp32_grads)
            for o in option_sets}


def _gib(r: ComparisonRow, system: str) -> str:
    ev = r.best[system]
    return f"{ev.memory_bytes_per_gpu / GiB:.1f}" if ev else "-"


def format_options(rows: list[OptionsRow], largest: dict[str, list[MaxModelRow]]) -> str:
    """The best 2BW and Flush per scenario and option set, then the largest model per option set."""
    lines = ["Beyond the paper (fp16 on the same V100s): fp32 gradient accumulation and the distributed optimizer",
             "(t d w b, rc = recomputation, +do = distributed optimizer; GiB = the fullest GPU)", ""]
    head = f"{'scenario':<22}{'options':<32}{'2BW':>24}{'GiB':>6}{'PipeDream-Flush':>24}{'GiB':>6}{'2BW/Flush':>11}"
    lines += [head, "-" * len(head)]
    for x in rows:
        r = x.row
        ratio = r.ratio("PipeDream-Flush")
        lines.append(f"{r.model_name + f' N={r.num_gpus} B={r.global_batch_size}':<22}{x.options.label:<32}"
                     f"{_short(r.best['2BW']):>24}{_gib(r, '2BW'):>6}{_short(r.best['PipeDream-Flush']):>24}"
                     f"{_gib(r, 'PipeDream-Flush'):>6}{(f'{ratio:.2f}x' if ratio else 'n/a'):>11}")
    if largest:
        model = paper_model(MAX_MODEL_NAME)
        lines += ["", f"Largest 2BW model of the {MAX_MODEL_NAME} shape (hidden {model.hidden_size}, more layers) on "
                  "64 GPUs: t = 1, w = 64/d, microbatch 1, recomputation, m = d; layers, parameters", ""]
        labels = list(largest)
        lines.append(f"{'d':>4}" + "".join(f"{lab:>32}" for lab in labels))
        for i, d in enumerate(MAX_MODEL_DEPTHS):
            cells = [largest[lab][i] for lab in labels]
            lines.append(f"{d:>4}" + "".join(
                f"{(f'{c.num_layers}, {c.num_parameters / 1e9:.1f}B' if c.num_layers else 'none'):>32}" for c in cells))
    return "\n".join(lines)


def options_json(rows: list[OptionsRow], largest: dict[str, list[MaxModelRow]]) -> dict[str, Any]:
    """The same as :func:`format_options`, as JSON."""
    return {
        "scenarios": [{"model": x.row.model_name, "num_gpus": x.row.num_gpus,
                       "global_batch_size": x.row.global_batch_size, "options": x.options.label,
                       "fp32_grads": bool(x.options.fp32_grads),
                       "distributed_optimizer_allowed": x.options.distributed_optimizer,
                       "best": {s: (describe(e) if (e := x.row.best[s]) else None) for s in SYSTEMS},
                       "speedup_2bw_over_flush": x.row.ratio("PipeDream-Flush")} for x in rows],
        "largest_model": {lab: [{"pipeline_parallel": r.pipeline_parallel, "num_layers": r.num_layers,
                                 "num_parameters": r.num_parameters, "memory_bytes_per_gpu": r.memory_bytes_per_gpu}
                                for r in rs] for lab, rs in largest.items()},
    }
