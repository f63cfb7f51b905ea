"""Pictures of a simulated pipeline: a Chrome trace (``chrome://tracing`` / Perfetto) and a PNG.

Chrome trace: the JSON object format (``{"traceEvents": [...]}``), one process ("pipeline"),
one thread row (``tid``) per stage, named ``stage r``. Each FORWARD / BACKWARD / APPLY_UPDATE is a
complete event (``"ph": "X"``, microseconds) named like the schedules print them (``F3v1``,
``B3v1``, ``U0``) with its microbatch, step and weight version in ``args``; receive waits are
``wait RA3`` events (category ``wait``); step starts are instant events; each stage's memory is a
counter track (``"ph": "C"``: static, activations). Open it in chrome://tracing or ui.perfetto.dev.

PNG (matplotlib, Agg backend): one row per stage, forwards light and backwards dark in the colour
of their microbatch (tab10 without its grey, by microbatch index within the step), updates grey, the start of
every step a dashed line; below it, each stage's memory over time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..schedule.actions import Op
from .simulator import SimResult

_US = 1e6
_COMPUTE = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "input_grad",
            Op.BACKWARD_WEIGHT: "weight_grad", Op.APPLY_UPDATE: "update"}


def chrome_trace(result: SimResult, *, title: str | None = None) -> dict[str, Any]:
    """The trace as a dict (see the module docstring)."""
    pid = 0
    name = title or f"{result.schedule} d={result.d} m={result.m}"
    ev: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}]
    for r in range(result.d):
        ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": f"stage {r}"}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": r, "args": {"sort_index": r}})
    for stage_events in result.events:
        for e in stage_events:
            if e.op in _COMPUTE:
                args = {"step": e.step}
                if e.op is not Op.APPLY_UPDATE:
                    args.update(microbatch=e.mb, version=e.version)
                ev.append({"name": e.label, "cat": _COMPUTE[e.op], "ph": "X", "pid": pid, "tid": e.stage,
                           "ts": e.start * _US, "dur": (e.end - e.start) * _US, "args": args})
            elif e.op in (Op.RECV_ACT, Op.RECV_GRAD) and e.end > e.start:
                ev.append({"name": f"wait {e.label}", "cat": "wait", "ph": "X", "pid": pid, "tid": e.stage,
                           "ts": e.start * _US, "dur": (e.end - e.start) * _US, "args": {"microbatch": e.mb}})
    for t, s in enumerate(result.step_starts):
        ev.append({"name": f"step {result.first_step + t}", "ph": "i", "s": "g", "pid": pid, "tid": 0, "ts": s * _US})
    # every point of ``memory``: it has more than ``activation_memory`` (the workspace's peaks), so no zip with it
    for r, mem in enumerate(result.memory):
        static = result.static_bytes[r]
        for t, total in mem:
            ev.append({"name": f"memory stage {r}", "ph": "C", "pid": pid, "tid": r, "ts": t * _US,
                       "args": {"static": static, "activations": max(total - static, 0)}})
    ev.sort(key=lambda x: (x.get("ts", -1), x["tid"]))
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {k: v for k, v in result.summary().items() if not isinstance(v, list)}}


def write_chrome_trace(result: SimResult, path: str | Path, *, title: str | None = None) -> Path:
    p = Path(path)
    p.write_text(json.dumps(chrome_trace(result, title=title)))
    return p


# tab10 without its grey (updates are grey)
_PALETTE_INDICES = (0, 1, 2, 3, 4, 5, 6, 8, 9)


def _draw_timeline(ax, result: SimResult, scale: float, palette: list, title: str | None, unit: str) -> None:
    """One row per stage: forwards light and backwards dark in their microbatch's colour, updates grey."""
    from matplotlib.patches import Patch  # noqa: PLC0415 - optional dependency, imported when used

    d, m, span = result.d, result.m, result.makespan or 1.0
    for r, stage_events in enumerate(result.events):
        y = d - 1 - r
        for e in stage_events:
            if e.op not in _COMPUTE or e.end <= e.start:
                continue
            x, w = e.start * scale, (e.end - e.start) * scale
            if e.op is Op.APPLY_UPDATE:
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors="0.35", edgecolor="black", linewidth=0.3)
                continue
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=palette[e.mb % m % len(palette)],
                           alpha=0.45 if e.op is Op.FORWARD else 1.0, edgecolor="black", linewidth=0.3,
                           hatch="///" if e.op is Op.BACKWARD_WEIGHT else None)  # a split backward's W
            if w > span * scale / 120:
                ax.text(x + w / 2, y, f"{e.mb}", ha="center", va="center", fontsize=6)
    for t, s in enumerate(result.step_starts):
        ax.axvline(s * scale, color="black", linestyle="--", linewidth=0.7)
        ax.text(s * scale, d - 0.45, f" step {result.first_step + t}", fontsize=7, va="bottom")
    ax.set_yticks(range(d))
    ax.set_yticklabels([f"stage {d - 1 - i}" for i in range(d)])
    ax.set_ylim(-0.6, d - 0.1 + 0.35)
    ax.set_xlim(0, span * scale)
    ax.legend(handles=[Patch(facecolor=palette[0], alpha=0.45, label="forward"),
                       Patch(facecolor=palette[0], label="backward"),
                       Patch(facecolor="0.35", label="optimizer update")],
              loc="upper right", fontsize=7, ncol=3, bbox_to_anchor=(1.0, 1.18))
    head = title or f"{result.schedule}  d={d}  m={m}"
    ax.set_title(f"{head}:  {result.step_time_s * scale:.3g} {unit}/step steady state, "
                 f"bubble {100 * result.bubble_fraction:.1f}%", fontsize=9, loc="left")


def _draw_memory(mx, result: SimResult, scale: float, unit: str) -> None:
    """Each stage's bytes over time."""
    span = result.makespan or 1.0
    for r in range(result.d):
        pts = result.memory[r]
        xs = [t * scale for t, _ in pts] + [span * scale]
        ys = [b / 2**20 for _, b in pts] + [pts[-1][1] / 2**20]
        mx.step(xs, ys, where="post", label=f"stage {r}", linewidth=1.0)
    mx.set_ylabel("MiB")
    mx.set_xlabel(f"time ({unit})")
    mx.legend(fontsize=7, ncol=min(result.d, 8), loc="upper right")
    mx.set_title("memory per GPU: weights, gradients, optimizer state + stashed activations", fontsize=8, loc="left")


def write_png(result: SimResult, path: str | Path, *, title: str | None = None, memory: bool = True,
              dpi: int = 110) -> Path:
    """The timeline (and memory) as a PNG; see the module docstring."""
    import matplotlib  # noqa: PLC0415 - optional dependency, imported when used

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    d = result.d
    unit, scale = ("ms", 1e3) if (result.makespan or 1.0) < 10 else ("s", 1.0)
    rows = 2 if memory else 1
    width = min(4 + 0.12 * sum(len(e) for e in result.events) / d, 22)
    fig, axes = plt.subplots(rows, 1, figsize=(width, 1.0 + 0.55 * d + (2.6 if memory else 0)), squeeze=False,
                             gridspec_kw={"height_ratios": [max(d, 2), 3][:rows]}, sharex=True)
    tab = matplotlib.colormaps["tab10"]
    _draw_timeline(axes[0][0], result, scale, [tab(i) for i in _PALETTE_INDICES], title, unit)
    if memory:
        _draw_memory(axes[1][0], result, scale, unit)
    else:
        axes[0][0].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p
