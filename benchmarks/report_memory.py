"""Section 2 of ``docs/benchmarks.md``: memory per stage (``memory.py``) and its plot."""

from __future__ import annotations

from report_format import MiB, f, md_table, missing_note, rel_link, save_figure


def plot_memory(data: dict, path: str) -> bool:
    rows = data.get("results") or []
    if not rows:
        return False
    d0 = min(r["d"] for r in rows)
    m0 = min(r["m"] for r in rows if r["d"] == d0)
    sel = [r for r in rows if r["d"] == d0 and r["m"] == m0]
    sel.sort(key=lambda r: (r["schedule"], r["recompute"], r["stage"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    n = len(sel)
    xs = list(range(n))
    w = 0.27
    ax.bar([x - w for x in xs], [r["measured_stash_bytes"] / MiB for r in sel], w, label="measured peak stash")
    ax.bar(xs, [r["exact_activation_bytes"] / MiB for r in sel], w, label="formula, exact in-flight count")
    ax.bar([x + w for x in xs], [r["paper_activation_bytes"] / MiB for r in sel], w, label="paper formula (worst case)")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['schedule']}\n{'recomp' if r['recompute'] else 'no rc'}\nstage {r['stage']}" for r in sel],
                       fontsize=7)
    ax.set_ylabel("activation bytes (MiB)")
    ax.set_title(f"stashed activations per stage, d={d0}, m={m0} (fp32)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, path)
    return True


def _summary(rows: list[dict]) -> list[list]:
    """Per schedule x recompute: do weights and in-flight counts match the formulas, and the ratio ranges."""
    summ = []
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["schedule"], r["recompute"]), []).append(r)
    for (s, rc), rs in sorted(groups.items()):
        me = [r["measured_over_exact"] for r in rs if r.get("measured_over_exact") is not None]
        mp = [r["measured_over_paper"] for r in rs if r.get("measured_over_paper") is not None]
        wok = all(r["measured_weight_bytes"] == r["paper_weight_bytes"] for r in rs)
        iok = all(r["max_inflight"] == r["expected_inflight"] for r in rs)
        summ.append([s, "yes" if rc else "no", len(rs), "yes" if wok else "**no**", "yes" if iok else "**no**",
                     f"{f(min(me), '.3f')}-{f(max(me), '.3f')}" if me else "-",
                     f"{f(min(mp), '.3f')}-{f(max(mp), '.3f')}" if mp else "-"])
    return summ


MEMORY_MEANING = [
    "What the numbers mean:",
    "",
    "- **W**: bytes of all weight versions a stage holds (2BW: 2, Flush and GPipe: 1; fp32 here, no master copy). "
    "*paper* = versions x the stage's measured version size `W_r` (the paper's `2|W|/d` or `|W|/d`).",
    "- **A meas**: the peak activation bytes autograd kept for backward at once on that stage (each storage once, "
    "weights and gradients excluded). With recomputation: the stashed stage inputs plus the full activations of the "
    "one microbatch being recomputed.",
    "- **A exact**: the formula with the stage's true in-flight count `n_r` (`min(d-r, m)` for 1F1B schedules, `m` "
    "for GPipe): `n_r*A_r` without recomputation, `A_r + n_r*A_in` with it; **A paper**: the paper's worst case "
    "(`d` stashes for 2BW/Flush, `m` for GPipe, plus its separate `d*A_in` term). `A_r` is the stage's "
    "per-microbatch activation size measured in the Flush run, `A_in = b*s*h*4` bytes.",
    "- **meas/exact** near 1 means the engine stashes exactly what the schedule needs; below 1 on stage 0 with "
    "recomputation because its input is token ids, which are not counted.",
    "",
]


def memory_section(data: dict | None, st: dict | None, img: str | None, doc: str) -> tuple[str, list[dict]]:
    lines = ["## 2. Memory per stage (CPU, `benchmarks/memory.py`)", ""]
    if data is None:
        lines += [missing_note("memory", st), ""]
        return "\n".join(lines), []
    cfg = data.get("config") or {}
    model = cfg.get("model") or {}
    rows = sorted(data.get("results") or [], key=lambda r: (r["d"], r["m"], r["schedule"], r["recompute"], r["stage"]))
    lines += [f"GPT with {model.get('num_layers')} layers, hidden {model.get('hidden_size')}, sequence "
              f"{model.get('seq_length')}, b = {cfg.get('micro_batch')}, {cfg.get('precision', 'fp32')}, "
              f"{cfg.get('steps')} steps per configuration. Measured by the engine's saved-tensor hooks; bytes in MiB.",
              ""]
    if cfg.get("planner_note"):
        lines += [f"Planner column: {cfg['planner_note']}", ""]
    summ = _summary(rows)
    lines += ["### Summary", "", md_table(["schedule", "recompute", "configs x stages", "weights = versions x W_r",
                                            "in-flight = formula", "measured / exact", "measured / paper"], summ), ""]
    table = []
    for r in rows:
        table.append([r["d"], r["m"], r["schedule"], "yes" if r["recompute"] else "no", r["stage"],
                      r["weight_versions"],
                      f"{r['max_inflight']}/{r['expected_inflight']}",
                      f(r["measured_weight_bytes"] / MiB), f(r["paper_weight_bytes"] / MiB),
                      f(r["planner_weight_bytes"] / MiB) if r.get("planner_weight_bytes") is not None else "-",
                      f(r["measured_stash_bytes"] / MiB), f(r["exact_activation_bytes"] / MiB),
                      f(r["paper_activation_bytes"] / MiB),
                      f(r["planner_activation_bytes"] / MiB) if r.get("planner_activation_bytes") is not None else "-",
                      f(r.get("measured_over_exact"), ".3f")])
    lines += ["<details><summary>Every configuration and stage</summary>", "",
              md_table(["d", "m", "schedule", "recompute", "stage", "versions", "in flight (meas/formula)", "W meas",
                        "W paper", "W planner", "A meas", "A exact", "A paper", "A planner", "meas/exact"], table),
              "", "</details>", ""]
    if img:
        lines += [f"![memory]({rel_link(img, doc)})", ""]
    lines += MEMORY_MEANING
    return "\n".join(lines), summ
