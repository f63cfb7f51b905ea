"""What every section of ``docs/benchmarks.md`` formats with: numbers, tables, verdicts, links, plots
and the note for a missing result (``report.py`` and its ``report_*`` sections)."""

from __future__ import annotations

import json
import os

import common

ROOT = common.ROOT
MiB = 2**20


def load_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def f(x, spec=".2f", dash="-"):
    if x is None:
        return dash
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("**pass**" if ok else "**FAIL**")


def rel_link(path: str, doc: str) -> str:
    return os.path.relpath(path, os.path.dirname(os.path.abspath(doc))).replace(os.sep, "/")


def show_path(path: str) -> str:
    """A path relative to the repository when inside it, else absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def median(xs):
    return common.median(xs)


def minmax(xs):
    xs = [x for x in (xs or []) if x is not None]
    return {"lo": min(xs), "hi": max(xs)} if xs else {}


def missing_note(name: str, st: dict | None) -> str:
    if st and not st.get("ok"):
        return (f"**Not available: `{name}` failed** ({st.get('error')}; log `{st.get('log')}`). The rest of the "
                f"report was generated without it.")
    return f"**Not available**: no `{name}` result JSON was found."


def save_figure(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
