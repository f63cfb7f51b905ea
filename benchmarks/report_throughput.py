"""Section 1 of ``docs/benchmarks.md``: pipeline throughput (``pipeline_throughput.py``), its targets and plot."""

from __future__ import annotations

from report_format import f, md_table, median, minmax, missing_note, rel_link, save_figure, verdict

# the issue's targets
T_2BW_VS_SINGLE = 1.8
T_2BW_VS_T1F1B_M4 = 1.2
T_FLUSH_VS_T1F1B = 1.0
T_GPIPE_VS_TGPIPE = 1.0
T_OVERHEAD_PCT = 3.0
T_VALID_RATIO = 1.01

SYSTEM_NAMES = {
    "single": "single process (plain loop)", "engine_d1": "our engine, d=1", "2bw": "PipeDream-2BW (ours)",
    "flush": "PipeDream-Flush (ours)", "gpipe": "GPipe (ours)", "torch_1f1b": "torch Schedule1F1B",
    "torch_gpipe": "torch ScheduleGPipe",
}


def throughput_rows(data: dict, d: int = 2) -> list[dict]:
    return [r for r in data.get("results", []) if r.get("compared_in_world_d", d) == d]


def _per_round_ratio(data: dict, d: int, a: str, b: str, m: int) -> float | None:
    """Median over rounds of sps(a) / sps(b), both inside the same round (from the raw records)."""
    recs = ((data.get("per_d") or {}).get(str(d)) or {}).get("records") or []
    by = {(r["round"], r["system"], r["m"]): r for r in recs}
    ratios = []
    for rnd in sorted({r["round"] for r in recs}):
        x, y = by.get((rnd, a, m)), by.get((rnd, b, m))
        if x and y and x["steady_s"] > 0 and y["steady_s"] > 0:
            ratios.append((x["steady_steps"] / x["steady_s"]) / (y["steady_steps"] / y["steady_s"]))
    return median(ratios)


def throughput_targets(data: dict) -> list[dict]:
    """The issue's throughput targets, measured medians, ideal (bubble-limited) values, verdicts."""
    rows = throughput_rows(data)
    by = {(r["system"], r["m"]): r for r in rows}
    ms = sorted({r["m"] for r in rows})
    out = []
    split_cap = ((data.get("per_d") or {}).get("2") or {}).get("balance_ceiling_vs_single")
    for m in ms:
        r = by.get(("2bw", m))
        if r:
            ideal = r.get("ideal_vs_single")  # 2BW's bubble-free d, capped by the stage split's sum / max
            out.append(dict(target=f"2BW (d=2) vs single process, m={m}", goal=T_2BW_VS_SINGLE,
                            measured=r.get("speedup_vs_single"), quiet=r.get("quiet_speedup_vs_single"),
                            ideal=min(ideal, split_cap) if ideal and split_cap else ideal,
                            lo=r.get("speedup_vs_single_min"), hi=r.get("speedup_vs_single_max")))
    r = by.get(("2bw", 4))
    if r:
        out.append(dict(target="2BW vs torch Schedule1F1B, m=4", goal=T_2BW_VS_T1F1B_M4,
                        measured=r.get("ratio_vs_torch_1f1b"),
                        quiet=r.get("quiet_ratio_vs_torch_1f1b"), ideal=r.get("ideal_vs_torch_1f1b"),
                        **minmax(r.get("ratio_vs_torch_1f1b_per_round"))))
    for m in ms:
        r = by.get(("flush", m))
        if r:
            out.append(dict(target=f"PipeDream-Flush vs torch Schedule1F1B, m={m}", goal=T_FLUSH_VS_T1F1B,
                            measured=r.get("ratio_vs_torch_1f1b"), quiet=r.get("quiet_ratio_vs_torch_1f1b"),
                            ideal=r.get("ideal_vs_torch_1f1b"), **minmax(r.get("ratio_vs_torch_1f1b_per_round"))))
    for m in ms:
        g, t = by.get(("gpipe", m)), by.get(("torch_gpipe", m))
        if g and t:
            ratio = _per_round_ratio(data, 2, "gpipe", "torch_gpipe", m)
            if ratio is None and g.get("samples_per_sec") and t.get("samples_per_sec"):
                ratio = g["samples_per_sec"] / t["samples_per_sec"]
            out.append(dict(target=f"GPipe (ours) vs torch ScheduleGPipe, m={m}", goal=T_GPIPE_VS_TGPIPE,
                            measured=ratio, quiet=None, ideal=1.0))
    for m in ms:
        r = by.get(("engine_d1", m))
        if r:
            ov = r.get("overhead_vs_single_pct")
            out.append(dict(target=f"executor overhead at d=1 (% step time vs plain loop), m={m}", goal=T_OVERHEAD_PCT,
                            measured=ov, quiet=r.get("quiet_overhead_vs_single_pct"), ideal=0.0, lower_is_better=True))
    for o in out:
        x = o["measured"]
        o["ok"] = None if x is None else (x <= o["goal"] if o.get("lower_is_better") else x >= o["goal"])
    return out


def plot_throughput(data: dict, path: str) -> bool:
    rows = throughput_rows(data)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["m"] for r in rows})
    systems = [s for s in SYSTEM_NAMES if any(r["system"] == s for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(SYSTEM_NAMES, ["black", "gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"],
                      strict=False))
    for s in systems:
        pts = sorted((r["m"], r.get("speedup_vs_single"), r.get("ideal_vs_single"), r.get("samples_per_sec"))
                     for r in rows if r["system"] == s)
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1] for p in pts], "o-", color=colors[s], label=SYSTEM_NAMES[s])
        if s in ("2bw", "flush"):
            axes[0].plot(xs, [p[2] for p in pts], ":x", color=colors[s], lw=1, label=f"ideal {s} (bubble-limited)")
        axes[1].plot(xs, [p[3] for p in pts], "o-", color=colors[s], label=SYSTEM_NAMES[s])
    axes[0].axhline(T_2BW_VS_SINGLE, color="tab:blue", ls="--", lw=0.8, label=f"target 2BW {T_2BW_VS_SINGLE}x")
    axes[0].set_ylabel("speedup vs single process (median of rounds)")
    axes[1].set_ylabel("samples/s (median of rounds)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([str(m) for m in ms])
        ax.set_xlabel("m (microbatches per step)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    cfg = (data.get("config") or {}).get("model") or {}
    fig.suptitle(f"CPU, d=2, GPT {cfg.get('num_layers')} layers hidden {cfg.get('hidden_size')} seq "
                 f"{cfg.get('seq_length')}, b={(data.get('config') or {}).get('micro_batch')}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return True


def _setting_lines(data: dict) -> list[str]:
    """The model, the layout, the machine and each d's stage times and load."""
    cfg, mach = data.get("config") or {}, data.get("machine") or {}
    model = cfg.get("model") or {}
    lines = [f"GPT with {model.get('num_layers')} layers, hidden {model.get('hidden_size')}, "
              f"{model.get('num_attention_heads')} heads, sequence {model.get('seq_length')}, vocabulary "
              f"{model.get('vocab_size')}, microbatch b = {cfg.get('micro_batch')}, {cfg.get('optimizer', 'AdamW')}; d "
              f"= {cfg.get('d')}, m = {cfg.get('m')}, {cfg.get('rounds')} alternating rounds (medians "
              f"reported){'; QUICK smoke settings, not representative' if cfg.get('quick') else ''}. "
              f"{mach.get('cpus_usable')} usable CPUs, one torch thread per process; took "
              f"{f(mach.get('elapsed_s'), '.0f')} s.", ""]
    for d_key, e in sorted((data.get("per_d") or {}).items()):
        lines.append(f"- d = {d_key}: forward+backward per microbatch per stage "
                     f"{[round(x, 1) for x in e.get('stage_compute_ms_per_microbatch') or []]} ms; stage-balance "
                     f"ceiling {f(e.get('balance_ceiling_vs_single'), '.3f')}x single; other jobs' load per round "
                     f"(CPUs) {[f(x, '.2f') for x in e.get('foreign_load_cpus_per_round') or []]}; waiting ranks' CPU "
                     f"share {f(e.get('waiting_ranks_cpu_share'), '.3f')}")
    lines.append("")
    return lines


def _targets_lines(targets: list[dict], later: dict | None) -> list[str]:
    """This run's verdict on each target (or the newer run that met one it missed)."""
    rows = []
    for t in targets:
        spread = f"{f(t.get('lo'), '.3f')}-{f(t.get('hi'), '.3f')}" if t.get("lo") is not None else "-"
        rel = "<=" if t.get("lower_is_better") else ">="
        spec = "+.1f" if t.get("lower_is_better") else ".3f"
        met = (later or {}).get(t["target"]) if t["ok"] is False else None
        cell = verdict(t["ok"]) if met is None else f"missed here; **met** by {met[0]} ({met[1]:.3f}, {met[2]})"
        rows.append([t["target"], f"{rel} {t['goal']}", f(t["measured"], spec), spread, f(t.get("quiet"), spec),
                     f(t.get("ideal"), spec), cell])
    return ["### Targets", "", "This run's verdicts; a later run of the same configuration may meet a target this "
              "one missed (the opening section judges each configuration by its newest run).", "",
              md_table(["target", "goal", "measured (median)", "range over rounds", "quiet rounds only",
                        "ceiling", "verdict"], rows), ""]


def _systems_lines(data: dict) -> list[str]:
    """Every system at every m, with the ratios the targets read."""
    all_rows = sorted(throughput_rows(data), key=lambda r: (r["m"], list(SYSTEM_NAMES).index(r["system"])
                                                            if r["system"] in SYSTEM_NAMES else 99))
    table = []
    for r in all_rows:
        table.append([SYSTEM_NAMES.get(r["system"], r["system"]), r.get("d"), r.get("m"), f(r.get("samples_per_sec")),
                      f(r.get("speedup_vs_single"), ".3f"), f(r.get("ideal_vs_single"), ".3f"),
                      f(r.get("ratio_vs_torch_1f1b"), ".3f"), f(r.get("ideal_vs_torch_1f1b"), ".3f"),
                      f(r.get("wall_speedup_vs_single"), ".3f"),
                      f"{f(r.get('speedup_vs_single_min'), '.3f')}-{f(r.get('speedup_vs_single_max'), '.3f')}",
                      f(r.get("foreign_load_cpus"), ".2f"), f"{r.get('quiet_rounds', '-')}/{r.get('rounds', '-')}"])
    return ["### All systems", "", md_table(["system", "d", "m", "samples/s", "x single", "ideal x single",
                                             "x torch 1F1B", "ideal x torch 1F1B", "wall x single", "x single range",
                                             "other load (CPUs)", "quiet rounds"], table), ""]


THROUGHPUT_MEANING = [
    "What the numbers mean:",
    "",
    "- **samples/s**: steady-state throughput, timed on stage 0 from the first forward of step 1 to the first "
    "forward of the segment's last step (whole steps: bubbles, gradient reductions and updates included; the fill "
    "before and the drain after a segment excluded). Median over rounds.",
    "- **x single**: samples/s over the single-process plain loop (whole model, `torch.optim.AdamW(fused=True)`) "
    "measured in the same round, then the median over rounds; **x torch 1F1B** likewise against "
    "`torch.distributed.pipelining.Schedule1F1B` on the same stages.",
    "- **ideal**: the bubble-limited value with perfectly balanced stages and free transfers: 2BW `d`, 1F1B/GPipe "
    "`d*m/(m+d-1)` vs single; ideal vs torch 1F1B is the ratio of those. The stage-balance ceiling above caps "
    "every pipeline further (the last stage carries the LM head and cross-entropy). The targets table's "
    "**ceiling** for 2BW vs single is that cap (the smaller of the two), not `d`.",
    "- **wall x single**: the same ratio on whole-segment wall time (fill and drain included).",
    "- **other load**: CPUs used by other jobs on the machine while we measured (from /proc/stat minus our own "
    "processes); a round is *quiet* when it stayed under the benchmark's threshold. On a shared 2-core machine "
    "this is the main source of noise: read the range and the quiet-only medians next to the medians.",
    "",
]


def throughput_section(data: dict | None, st: dict | None, img: str | None, doc: str,
                       later: dict | None = None) -> tuple[str, list[dict]]:
    """``later``: target name -> (file, value, date) of a newer run that meets a target this one misses."""
    lines = ["## 1. Pipeline throughput (CPU, `benchmarks/pipeline_throughput.py`)", ""]
    if data is None:
        lines += [missing_note("pipeline_throughput", st), ""]
        return "\n".join(lines), []
    lines += _setting_lines(data)
    targets = throughput_targets(data)
    lines += _targets_lines(targets, later) + _systems_lines(data)
    if img:
        lines += [f"![throughput]({rel_link(img, doc)})", ""]
    ov = data.get("executor_overhead_d1_pct") or {}
    if ov:
        lines += ["Executor overhead at d = 1 (our engine running Flush in one process vs the plain loop, % of step "
                  "time): "
                  + ", ".join(f"m={m}: {f(v, '+.1f')}%" for m, v in ov.items()), ""]
    lines += THROUGHPUT_MEANING
    return "\n".join(lines), targets
