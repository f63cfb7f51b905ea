"""Run the CPU benchmarks and regenerate ``docs/benchmarks.md`` (tables, targets, plots).

    python benchmarks/report.py                      # full: several minutes to tens of minutes on 2 cores
    python benchmarks/report.py --quick              # smoke settings; writes under runs/benchmarks_quick/
    python benchmarks/report.py --from-json DIR      # rebuild the markdown and plots from DIR/*.json
    python benchmarks/report.py --gpu-json gpu.json  # also a table from benchmarks/gpu.py run on a GPU node

Each benchmark (``pipeline_throughput.py``, ``memory.py``, ``convergence.py``) runs as its own
subprocess with ``--json DIR/<name>.json`` (log in ``DIR/<name>.log``), one after the other, so
no two measurements share the CPUs. A benchmark that fails or times out is reported as such in
the document; the others still make it in. ``DIR`` defaults to ``runs/benchmarks`` (full) or
``runs/benchmarks_quick`` (``--quick``). The quick report goes to ``DIR/benchmarks.md`` unless
``--doc`` says otherwise, so a smoke run never overwrites the real document.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

import common
import convergence  # its plots and run_group
import kept_notes
from megatron_2bw.export.outputs import write_text_atomic
from answers import answers_section, speed_rows

ROOT = common.ROOT
BENCH = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = ("throughput", "memory", "convergence")
SCRIPTS = {"throughput": "pipeline_throughput.py", "memory": "memory.py", "convergence": "convergence.py"}
MiB = 2**20

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


# ============================================================================ running
def run_benchmarks(args, out_dir: str, img_dir: str) -> dict:
    """Each benchmark as a subprocess; returns {name: status dict}."""
    status = {}
    for name in args.only:
        script = os.path.join(BENCH, SCRIPTS[name])
        js = os.path.join(out_dir, f"{name}.json")
        log = os.path.join(out_dir, f"{name}.log")
        if os.path.exists(js):
            os.remove(js)
        cmd = [sys.executable, script, "--json", js]
        if args.quick:
            cmd.append("--quick")
        if name == "convergence":
            cmd += ["--out-dir", os.path.join(out_dir, "convergence_runs")]
            if args.quick:
                cmd += ["--data-dir", os.path.join(out_dir, "quick_data")]
            elif args.sweep_lr:
                cmd += ["--sweep-lr", *[str(x) for x in args.sweep_lr]]
        cmd += shlex.split(getattr(args, f"{name}_args") or "")
        print(f"[report] {name}: {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}", flush=True)
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        st = {"command": " ".join(shlex.quote(c) for c in cmd), "log": os.path.relpath(log, ROOT)}
        with open(log, "w") as f:
            rc = convergence.run_group(cmd, args.timeout, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        st["seconds"] = round(time.time() - t0, 1)
        if rc == 0 and os.path.exists(js):
            st["ok"] = True
        else:
            st["ok"] = False
            with open(log) as f:
                lines = [ln.rstrip() for ln in f if ln.strip()]
            st["error"] = (f"timed out after {args.timeout:.0f} s" if rc is None else f"exit status {rc}") + \
                (": " + lines[-1][:300] if lines else "")
        print(f"[report] {name}: {'ok' if st['ok'] else 'FAILED (' + st['error'] + ')'} in {st['seconds']} s", flush=True)
        status[name] = st
    with open(os.path.join(out_dir, "status.json"), "w") as f:
        json.dump(status, f, indent=1)
    return status


def load_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ============================================================================ helpers
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


def _rel(path: str, doc: str) -> str:
    return os.path.relpath(path, os.path.dirname(os.path.abspath(doc))).replace(os.sep, "/")


def _show(path: str) -> str:
    """A path relative to the repository when inside it, else absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def _median(xs):
    return common.median(xs)


# ============================================================================ throughput
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
    return _median(ratios)


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
                            ideal=min(ideal, split_cap) if ideal and split_cap else ideal, lo=r.get("speedup_vs_single_min"),
                            hi=r.get("speedup_vs_single_max")))
    r = by.get(("2bw", 4))
    if r:
        out.append(dict(target="2BW vs torch Schedule1F1B, m=4", goal=T_2BW_VS_T1F1B_M4, measured=r.get("ratio_vs_torch_1f1b"),
                        quiet=r.get("quiet_ratio_vs_torch_1f1b"), ideal=r.get("ideal_vs_torch_1f1b"),
                        **_minmax(r.get("ratio_vs_torch_1f1b_per_round"))))
    for m in ms:
        r = by.get(("flush", m))
        if r:
            out.append(dict(target=f"PipeDream-Flush vs torch Schedule1F1B, m={m}", goal=T_FLUSH_VS_T1F1B,
                            measured=r.get("ratio_vs_torch_1f1b"), quiet=r.get("quiet_ratio_vs_torch_1f1b"),
                            ideal=r.get("ideal_vs_torch_1f1b"), **_minmax(r.get("ratio_vs_torch_1f1b_per_round"))))
    for m in ms:
        g, t = by.get(("gpipe", m)), by.get(("torch_gpipe", m))
        if g and t:
            ratio = _per_round_ratio(data, 2, "gpipe", "torch_gpipe", m)
            if ratio is None and g.get("samples_per_sec") and t.get("samples_per_sec"):
                ratio = g["samples_per_sec"] / t["samples_per_sec"]
            out.append(dict(target=f"GPipe (ours) vs torch ScheduleGPipe, m={m}", goal=T_GPIPE_VS_TGPIPE, measured=ratio,
                            quiet=None, ideal=1.0))
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


def _minmax(xs):
    xs = [x for x in (xs or []) if x is not None]
    return {"lo": min(xs), "hi": max(xs)} if xs else {}


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
    colors = dict(zip(SYSTEM_NAMES, ["black", "gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
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
    fig.suptitle(f"CPU, d=2, GPT {cfg.get('num_layers')} layers hidden {cfg.get('hidden_size')} seq {cfg.get('seq_length')}, "
                 f"b={(data.get('config') or {}).get('micro_batch')}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return True


def throughput_section(data: dict | None, st: dict | None, img: str | None, doc: str,
                       later: dict | None = None) -> tuple[str, list[dict]]:
    """``later``: target name -> (file, value, date) of a newer run that meets a target this one misses."""
    lines = ["## 1. Pipeline throughput (CPU, `benchmarks/pipeline_throughput.py`)", ""]
    if data is None:
        lines += [_missing("pipeline_throughput", st), ""]
        return "\n".join(lines), []
    cfg, mach = data.get("config") or {}, data.get("machine") or {}
    model = cfg.get("model") or {}
    lines += [f"GPT with {model.get('num_layers')} layers, hidden {model.get('hidden_size')}, {model.get('num_attention_heads')} heads, "
              f"sequence {model.get('seq_length')}, vocabulary {model.get('vocab_size')}, microbatch b = {cfg.get('micro_batch')}, "
              f"{cfg.get('optimizer', 'AdamW')}; d = {cfg.get('d')}, m = {cfg.get('m')}, {cfg.get('rounds')} alternating rounds "
              f"(medians reported){'; QUICK smoke settings, not representative' if cfg.get('quick') else ''}. "
              f"{mach.get('cpus_usable')} usable CPUs, one torch thread per process; took {f(mach.get('elapsed_s'), '.0f')} s.", ""]
    for d_key, e in sorted((data.get("per_d") or {}).items()):
        lines.append(f"- d = {d_key}: forward+backward per microbatch per stage "
                     f"{[round(x, 1) for x in e.get('stage_compute_ms_per_microbatch') or []]} ms; stage-balance ceiling "
                     f"{f(e.get('balance_ceiling_vs_single'), '.3f')}x single; other jobs' load per round (CPUs) "
                     f"{[f(x, '.2f') for x in e.get('foreign_load_cpus_per_round') or []]}; waiting ranks' CPU share "
                     f"{f(e.get('waiting_ranks_cpu_share'), '.3f')}")
    lines.append("")
    targets = throughput_targets(data)
    rows = []
    for t in targets:
        spread = f"{f(t.get('lo'), '.3f')}-{f(t.get('hi'), '.3f')}" if t.get("lo") is not None else "-"
        rel = "<=" if t.get("lower_is_better") else ">="
        spec = "+.1f" if t.get("lower_is_better") else ".3f"
        met = (later or {}).get(t["target"]) if t["ok"] is False else None
        cell = verdict(t["ok"]) if met is None else f"missed here; **met** by {met[0]} ({met[1]:.3f}, {met[2]})"
        rows.append([t["target"], f"{rel} {t['goal']}", f(t["measured"], spec), spread, f(t.get("quiet"), spec),
                     f(t.get("ideal"), spec), cell])
    lines += ["### Targets", "", "This run's verdicts; a later run of the same configuration may meet a target this "
              "one missed (the opening section judges each configuration by its newest run).", "",
              md_table(["target", "goal", "measured (median)", "range over rounds", "quiet rounds only",
                        "ceiling", "verdict"], rows), ""]
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
    lines += ["### All systems", "", md_table(["system", "d", "m", "samples/s", "x single", "ideal x single", "x torch 1F1B",
                                               "ideal x torch 1F1B", "wall x single", "x single range", "other load (CPUs)",
                                               "quiet rounds"], table), ""]
    if img:
        lines += [f"![throughput]({_rel(img, doc)})", ""]
    ov = data.get("executor_overhead_d1_pct") or {}
    if ov:
        lines += ["Executor overhead at d = 1 (our engine running Flush in one process vs the plain loop, % of step time): "
                  + ", ".join(f"m={m}: {f(v, '+.1f')}%" for m, v in ov.items()), ""]
    lines += [
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
    return "\n".join(lines), targets


# ============================================================================ memory
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
    _save(fig, path)
    return True


def memory_section(data: dict | None, st: dict | None, img: str | None, doc: str) -> tuple[str, list[dict]]:
    lines = ["## 2. Memory per stage (CPU, `benchmarks/memory.py`)", ""]
    if data is None:
        lines += [_missing("memory", st), ""]
        return "\n".join(lines), []
    cfg = data.get("config") or {}
    model = cfg.get("model") or {}
    rows = sorted(data.get("results") or [], key=lambda r: (r["d"], r["m"], r["schedule"], r["recompute"], r["stage"]))
    lines += [f"GPT with {model.get('num_layers')} layers, hidden {model.get('hidden_size')}, sequence {model.get('seq_length')}, "
              f"b = {cfg.get('micro_batch')}, {cfg.get('precision', 'fp32')}, {cfg.get('steps')} steps per configuration. "
              f"Measured by the engine's saved-tensor hooks; bytes in MiB.", ""]
    if cfg.get("planner_note"):
        lines += [f"Planner column: {cfg['planner_note']}", ""]
    # summary per schedule x recompute
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
    lines += ["### Summary", "", md_table(["schedule", "recompute", "configs x stages", "weights = versions x W_r",
                                            "in-flight = formula", "measured / exact", "measured / paper"], summ), ""]
    table = []
    for r in rows:
        table.append([r["d"], r["m"], r["schedule"], "yes" if r["recompute"] else "no", r["stage"], r["weight_versions"],
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
        lines += [f"![memory]({_rel(img, doc)})", ""]
    lines += [
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
    return "\n".join(lines), summ


# ============================================================================ convergence
def plot_convergence(data: dict, path: str) -> bool:
    runs = data.get("runs") or []
    if not runs or not all("curve" in r for r in runs):
        return False
    cfg, mach = data.get("config") or {}, data.get("machine") or {}
    nseeds = len({r.get("seed") for r in runs})
    title = (f"{cfg.get('preset')} (seq {cfg.get('seq')}), d=2, b={cfg.get('micro_batch')}, m={cfg.get('m')}, "
             f"{cfg.get('iters')} steps, {nseeds} seed(s) on {mach.get('cpus_usable')} CPUs; valid loss 2BW/Flush = "
             f"{f(data.get('valid_loss_ratio_2bw_over_flush'), '.4f')}")
    convergence.plot(runs, path, title)
    return True


def plot_convergence_sweep(data: dict, path: str) -> bool:
    sweep = data.get("lr_sweep") or []
    if len(sweep) < 2:
        return False
    cfg = data.get("config") or {}
    convergence.plot_sweep(sweep, path, f"{cfg.get('preset')} (seq {cfg.get('seq')}), d=2, b={cfg.get('micro_batch')}, "
                                        f"m={cfg.get('m')}, {cfg.get('iters')} steps: 2BW (solid) vs Flush (dashed) per peak lr")
    return True


def _exploration_table(rows: list[dict]) -> list[str]:
    """Earlier measured settings (how the defaults were chosen): one row per (setting, seed)."""
    out = []
    for e in rows:
        r = e.get("ratio")
        if r is None and e.get("valid_2bw") and e.get("valid_flush"):
            r = e["valid_2bw"] / e["valid_flush"]
        out.append([e.get("label", "-"), f(e.get("global_batch")), f(e.get("iters")), f(e.get("warmup")),
                    f(e.get("lr"), "g"), f(e.get("seed")), f(e.get("valid_sequences")), f(e.get("valid_2bw"), ".4f"),
                    f(e.get("valid_flush"), ".4f"), f(r, ".4f"), verdict(None if r is None else r <= T_VALID_RATIO),
                    e.get("note", "")])
    return [md_table(["setting", "global batch", "steps", "warm-up", "peak lr", "seed", "valid seqs", "2BW final valid",
                      "Flush final valid", "2BW / Flush", "within 1%", "note"], out), ""]


def convergence_section(data: dict | None, st: dict | None, img: str | None, doc: str, sweep_img: str | None = None,
                        regimes: dict | None = None, regimes_img: str | None = None) -> str:
    lines = ["## 3. Convergence: 2BW vs Flush at equal steps (CPU, `benchmarks/convergence.py`)", ""]
    if data is None:
        lines += [_missing("convergence", st), ""] + regimes_section(regimes, regimes_img, doc)
        return "\n".join(lines)
    cfg, mach = data.get("config") or {}, data.get("machine") or {}
    seeds = cfg.get("seeds") or [cfg.get("seed")]
    nvalid = cfg.get("valid_sequences") or ((cfg.get("eval_iters") or 0) * (cfg.get("global_batch") or 0) or None)
    lines += [f"The real trainer (`pretrain_gpt.py`, torchrun, 2 processes, d = 2, w = 1), preset `{cfg.get('preset')}` at "
              f"sequence {cfg.get('seq')}, b = {cfg.get('micro_batch')}, m = {cfg.get('m')} (global batch "
              f"{cfg.get('global_batch')}), {cfg.get('iters')} steps, Adam lr {cfg.get('lr')} (cosine to {cfg.get('min_lr')}, "
              f"{cfg.get('warmup')} linear warm-up steps), weight decay {cfg.get('weight_decay')}, clipping {cfg.get('clip_grad')}, "
              f"{cfg.get('precision')}, seeds {', '.join(str(x) for x in seeds)}, data `{cfg.get('data')}` (vocabulary "
              f"{cfg.get('vocab')}); validation every {cfg.get('eval_interval')} steps over {cfg.get('eval_iters')} global "
              f"batches ({f(nvalid)} sequences); logging segments of {cfg.get('log_interval')} steps (2BW drains only there)"
              f"{'; QUICK smoke settings, not representative' if cfg.get('quick') else ''}. Only `--pipeline-schedule` differs "
              f"between the two runs of a seed; the seed sets the initialization, the training data order and which "
              f"validation sequences are drawn. Took {f(mach.get('elapsed_s'), '.0f')} s.", ""]
    table = []
    for r in data.get("runs") or []:
        t = r.get("time_to_loss") or {}
        table.append([r["schedule"], f(r.get("seed", cfg.get("seed"))), r.get("steps"), f(r.get("final_valid_loss"), ".4f"),
                      f(r.get("final_train_loss"), ".4f"), f(r.get("seconds"), ".1f"), f(r.get("wall_seconds"), ".1f"),
                      f(r.get("samples_per_sec_median"), ".1f"), f(t.get("target"), ".4f"), f(t.get("step")),
                      f(t.get("seconds"), ".1f"), f(r.get("foreign_load_cpus"), ".2f")])
    lines += [md_table(["schedule", "seed", "steps", "final valid loss", "final train loss (smoothed)", "training s",
                        "process wall s", "samples/s (median)", "time-to-loss target", "step reached", "seconds to target",
                        "other load (CPUs)"], table), ""]
    noise = data.get("seed_noise") or {}
    if noise.get("per_seed"):
        rows = [[f(e["seed"]), f(e["final_valid_loss"].get("2bw"), ".4f"), f(e["final_valid_loss"].get("flush"), ".4f"),
                 f(e.get("valid_loss_ratio_2bw_over_flush"), ".4f")] for e in noise["per_seed"]]
        means = noise.get("mean_final_valid_loss") or {}
        rows.append(["mean", f(means.get("2bw"), ".4f"), f(means.get("flush"), ".4f"), f(noise.get("valid_loss_ratio_mean"), ".4f")])
        lines += ["Per seed (each ratio is paired: same initialization, data order and validation sequences):", "",
                  md_table(["seed", "2BW final valid", "Flush final valid", "2BW / Flush"], rows), ""]
    ratio = data.get("valid_loss_ratio_2bw_over_flush")
    fs = noise.get("flush_seed_spread", data.get("flush_seed_spread"))
    gap = noise.get("gap_above_noise")
    lines += [md_table(["target", "goal", "measured", "verdict"], [
        ["2BW final valid loss / Flush final valid loss (equal steps" + (", mean over seeds)" if len(seeds) > 1 else ")"),
         f"<= {T_VALID_RATIO}", f(ratio, ".4f"), verdict(None if ratio is None else ratio <= T_VALID_RATIO)],
        ["noise floor: Flush seed-to-seed spread (max - min) / mean of its final valid loss", "(info)", f(fs, ".4f"), "-"],
        ["2BW's excess (mean ratio - 1) above that noise floor", "(info)",
         "-" if gap is None else ("yes" if gap else "no") + f" ({f(None if ratio is None else ratio - 1, '+.4f')} vs {f(fs, '.4f')})", "-"],
        ["spread of the per-seed ratios (max - min)", "(info)", f(noise.get("ratio_spread"), ".4f"), "-"],
        ["training-time speedup 2BW vs Flush (same steps" + (", mean over seeds)" if len(seeds) > 1 else ")"), "(info)",
         f(data.get("train_time_speedup_2bw_vs_flush"), ".3f"), "-"],
        ["time-to-loss speedup 2BW vs Flush", "(info)", f(data.get("time_to_loss_speedup_2bw_vs_flush"), ".3f"), "-"],
    ]), ""]
    if img:
        lines += [f"![convergence]({_rel(img, doc)})", ""]
    sweep = data.get("lr_sweep") or []
    if len(sweep) > 1:
        rows = []
        for e in sweep:
            by = {r["schedule"]: r for r in e["runs"]}
            rows.append([f"{e['lr']:g}" + (" (above)" if e["lr"] == cfg.get("lr") else ""), f"{e['min_lr']:g}",
                         f((by.get("2bw") or {}).get("final_valid_loss"), ".4f"),
                         f((by.get("flush") or {}).get("final_valid_loss"), ".4f"),
                         f(e.get("valid_loss_ratio_2bw_over_flush"), ".4f"),
                         verdict(None if e.get("valid_loss_ratio_2bw_over_flush") is None
                                 else e["valid_loss_ratio_2bw_over_flush"] <= T_VALID_RATIO),
                         f((by.get("2bw") or {}).get("final_train_loss"), ".4f"),
                         f((by.get("flush") or {}).get("final_train_loss"), ".4f")])
        lines += ["### Learning-rate sensitivity", "",
                  f"The same pair of runs (seed {seeds[0]} only) at other peak learning rates (cosine decay to the same "
                  "fraction, everything else unchanged), to show how the gap between the 1-stale-gradient rule and "
                  "vanilla updates depends on the step size in this short, small-batch regime.", "",
                  md_table(["peak lr", "min lr", "2BW final valid", "Flush final valid", "2BW / Flush", "within 1%",
                            "2BW train (sm)", "Flush train (sm)"], rows), ""]
        if sweep_img:
            lines += [f"![convergence vs learning rate]({_rel(sweep_img, doc)})", ""]
    expl = data.get("exploration") or []
    if expl:
        lines += ["### How the defaults were chosen (measured settings)", "",
                  "Pairs of runs (2BW and Flush, same seed) measured with this script while choosing the defaults; "
                  "everything not listed is as above (seq 64, b = 2, cosine decay to lr/10, weight decay 0.01, clipping 1.0). "
                  "Settings where 2BW misses 1% are kept.", ""] + _exploration_table(expl)
    lines += [
        "What the numbers mean:",
        "",
        "- **final valid loss**: mean LM loss (nats/token) of the last validation evaluation, after the last step, on the "
        "newest weights; both runs of a seed see the same validation samples at the same steps, so each per-seed ratio "
        "is a paired comparison. Flush has vanilla semantics `W(t+1) = W(t) - lr*grad f_t(W(t))`; 2BW applies the "
        "1-stale gradient `grad f_t(W(t-1))`; a (mean) ratio at or under 1.01 is the issue's convergence target.",
        "- **noise floor**: the Flush-vs-Flush difference between seeds, `(max - min) / mean` of Flush's final validation "
        "loss (for two seeds `|flush(s1) - flush(s2)| / flush`). A 2BW excess (mean ratio - 1) below it is not "
        "distinguishable from changing the seed; the paired per-seed ratios are less noisy than that, so their own "
        "spread is listed too.",
        f"- **final train loss**: trailing mean of the training loss over the last {cfg.get('smooth_window')} steps "
        "(2BW's training loss of step t is computed on `W(t-1)`).",
        "- The losses are deterministic for a given configuration (same seed, data order and fp32 arithmetic; a rerun "
        "reproduces them to the printed digits); the times are not.",
        "- **training s**: the sum of the trainer's per-step times (each logging segment's wall time, fill and drain "
        "included; evaluations, start-up and process launch excluded); **process wall s** is the whole torchrun "
        "subprocess. Both are noisy on a shared 2-core machine (see *other load*).",
        f"- **time-to-loss**: target = {cfg.get('target_factor')} x Flush's final smoothed training loss of the same seed; "
        "the first step whose smoothed training loss is at or under it, and the training seconds up to it (step times "
        f"inside a {cfg.get('log_interval')}-step segment are the segment's mean).",
        "",
    ]
    return "\n".join(lines + regimes_section(regimes, regimes_img, doc))


# ============================================================================ convergence: regimes
REGIME_TARGETS = {"paper": 1.01, "aggressive": 1.02}  # issue 15: best 2BW mode within 1% / 2% of Flush
MODE_TEXT = {"none": "2BW (plain)", "predict": "2BW + predict", "dc": "2BW + dc"}


def plot_regimes(data: dict, path: str) -> bool:
    if not (data.get("regimes") and all(r.get("runs") for r in data["regimes"].values())):
        return False
    convergence.plot_regimes(data, path)
    return True


def _regime_rows(name: str, reg: dict) -> tuple[list[list], str | None]:
    """Table rows of one regime (Flush first, then each 2BW mode) and its best mode."""
    runs, target = reg["runs"], REGIME_TARGETS.get(name, T_VALID_RATIO)
    seeds = sorted({r["seed"] for r in runs})

    def per_seed(rs, key, spec):
        by = {r["seed"]: r.get(key) for r in rs}
        return " / ".join(f(by.get(sd), spec) for sd in seeds)

    flush = [r for r in runs if r["schedule"] == "flush"]
    rows = [["Flush", per_seed(flush, "final_valid_loss", ".4f"), "1 (reference)", "-", "-",
             per_seed(flush, "steps_to_target", ""), "-", "-", "-"]]
    best, best_ratio = None, None
    for mode, mo in reg["modes"].items():
        rs = [r for r in runs if r["schedule"] == "2bw" and r["compensation"] == mode]
        mean = mo.get("valid_loss_ratio_mean")
        complete = len(mo.get("seeds") or []) == len(seeds)
        if mean is not None and complete and (best_ratio is None or mean < best_ratio):
            best, best_ratio = mode, mean
        rows.append([MODE_TEXT.get(mode, mode), per_seed(rs, "final_valid_loss", ".4f"),
                     per_seed(rs, "valid_loss_ratio_vs_flush", ".4f"),
                     f(mean, ".4f") + ("" if complete else f" ({len(mo.get('seeds') or [])} seed)"),
                     verdict(None if mean is None else mean <= target), per_seed(rs, "steps_to_target", ""),
                     per_seed(rs, "time_to_target_vs_flush", ".2f"), per_seed(rs, "flush_steps_to_this_loss", ""),
                     per_seed(rs, "time_vs_flush_at_this_loss", ".2f")])
    return rows, best


def _default_advice(data: dict) -> list[str]:
    """Which compensation beats plain 2BW in every regime and seed (the rule for changing the default):
    its final validation loss lower than plain 2BW's of the same seed by more than the regime's noise
    floor (Flush's seed-to-seed spread)."""
    regs = data["regimes"]
    out = []
    for mode in ("predict", "dc"):
        wins, total = 0, 0
        for reg in regs.values():
            floor = reg.get("flush_seed_spread") or 0.0
            base = {r["seed"]: r["final_valid_loss"] for r in reg["runs"] if r["schedule"] == "2bw" and r["compensation"] == "none"}
            for r in reg["runs"]:
                if r["schedule"] == "2bw" and r["compensation"] == mode and r["seed"] in base:
                    total += 1
                    wins += r["final_valid_loss"] < base[r["seed"]] * (1 - floor)
        need = sum(len({r["seed"] for r in reg["runs"] if r["schedule"] == "flush"}) for reg in regs.values())
        out.append(f"- `{mode}` beats plain 2BW's final validation loss by more than the regime's noise floor in {wins} "
                   f"of {total} measured (regime, seed) pairs ({need} needed to change the default): "
                   + ("**better in every pair: meets the rule for the default**" if total == need and wins == total
                      else "does not meet the rule for the default") + ".")
    return out


def _cli_default() -> str:
    from megatron_2bw.cli import FLAGS

    return next(fl.default for fl in FLAGS if fl.name == "--2bw-compensation")


def _regime_advice(data: dict) -> list[str]:
    """Per regime: the best complete mode and whether it meets the regime's target."""
    out = []
    for name, reg in data["regimes"].items():
        rows, best = _regime_rows(name, reg)
        target = REGIME_TARGETS.get(name, T_VALID_RATIO)
        mean = (reg["modes"].get(best) or {}).get("valid_loss_ratio_mean") if best else None
        if mean is None:
            continue
        ok = mean <= target
        out.append(f"- {name}: best 2BW mode `{best}`, {mean:.4f} x Flush: "
                   + ("meets" if ok else "misses") + f" the {target} target"
                   + ("." if ok else "; at these settings Flush (or a smaller learning rate) is the choice for final "
                      "loss per step, 2BW's higher throughput does not make up for it (time columns above)."))
    return out


def regimes_section(data: dict | None, img: str | None, doc: str) -> list[str]:
    """Issue 15: both regimes, every --2bw-compensation mode, two seeds; every setting from the JSON."""
    if not data or not data.get("regimes"):
        return []
    lines = ["### Two regimes and stale-gradient compensation (`--regimes`, `--2bw-compensation`)", ""]
    if not data.get("complete"):
        lines += ["> **Partial**: the benchmark was still running when this was generated; missing runs are shown as "
                  "`-` and means over fewer seeds are marked.", ""]
    for name, reg in data["regimes"].items():
        c, sp = reg["config"], reg.get("measured_speedup") or {}
        rows, best = _regime_rows(name, reg)
        target = REGIME_TARGETS.get(name, T_VALID_RATIO)
        d = ", ".join(str(x) for x in c["d"]) if isinstance(c["d"], list) else c["d"]
        lines += [f"**{name}**: preset `{c['preset']}` at sequence {c['seq']}, d = {d} (2BW's update rule does not "
                  f"depend on d), b = {c['micro_batch']}, m = {c['m']} (global batch {c['global_batch']}), {c['iters']} steps, "
                  f"Adam lr {c['lr']:g} ({c['warmup']} linear warm-up steps, {c['lr_decay']} to {c['min_lr']:g}), weight decay "
                  f"{c['weight_decay']}, clipping {c['clip_grad']}, {c['precision']}, seeds "
                  f"{', '.join(str(x) for x in c['seeds'])}; validation over {c['valid_sequences']} sequences every "
                  f"{c['eval_interval']} steps; dc lambda {c['dc_lambda']:g}. Target: best 2BW mode <= {target} x Flush. "
                  f"Flush's seed-to-seed spread (noise floor): {f(reg.get('flush_seed_spread'), '.4f')}. Time-to-loss uses "
                  f"the measured 2BW/Flush throughput ratio {f(sp.get('ratio'), '.3f')} (d = 2, m = {sp.get('m')}, "
                  f"`{sp.get('source')}`).", "",
                  md_table(["run", "final valid loss (per seed)", "/ Flush (per seed)", "mean ratio", f"within {target}",
                            "steps to Flush's final train loss", "time to it / Flush's",
                            "Flush's steps to this final train loss", "time to this loss / Flush's"], rows), "",
                  f"Best complete 2BW mode here: `{best}`." if best else "No 2BW mode complete on every seed yet.", ""]
    if img:
        lines += [f"![convergence in two regimes]({_rel(img, doc)})", ""]
    lines += ["Default `--2bw-compensation` (changed only for a mode better than plain 2BW in both regimes and both seeds):",
              ""] + _default_advice(data) + [f"- The trainer's default today: `{_cli_default()}` (`config.resolve_compensation`: `ef` with Muon, `predict` with "
                                    "Adam or SGD-momentum in bf16/fp16 without the distributed optimizer, where it costs no memory, "
                                    "`none` otherwise; the Muon and `ef` runs: `docs/data/convergence_optimizers.json`, first section)."] + _regime_advice(data) + [
        "",
        "- **steps to Flush's final train loss**: the first step whose smoothed training loss is at or under the same "
        "seed's Flush final smoothed training loss (`-`: never within the run). **time to it / Flush's**: "
        "(2BW steps / Flush steps) / measured throughput ratio; under 1 means 2BW gets there sooner in wall time.",
        "- **Flush's steps to this final train loss**: the other way round, the first step at which Flush's smoothed "
        "training loss reached this run's final one; **time to this loss / Flush's** = (this run's steps / those Flush "
        "steps) / measured throughput ratio (under 1: 2BW reaches its own final loss sooner in wall time than Flush does).",
        "- Semantics of each mode: `megatron_2bw/pipeline/compensation.py` (module docstring). A mode marked "
        "`(1 seed)` ran on the first seed only (`convergence.py --first-seed-only`).",
        "- Runs at d = 2 come from the single-regime benchmark (`docs/data/convergence.json`, the same settings; reused "
        "with `--resume-from`): 2BW's and Flush's update rules do not depend on d, and the d = 1 and d = 2 Flush runs of "
        "the same seed give the same final validation loss to the printed digits.",
        ""]
    return lines


# ============================================================================ GPU
def gpu_section(data: dict | None, path: str | None) -> str:
    lines = ["## 4. One GPU (`benchmarks/gpu.py`)", ""]
    if data is None:
        lines += ["Not run here: no GPU JSON was given. On a GPU node run `python benchmarks/gpu.py --json gpu.json` and "
                  "rebuild this document with `python benchmarks/report.py --from-json DIR --gpu-json gpu.json`.", ""]
        return "\n".join(lines)
    mach = data.get("machine") or {}
    if data.get("skipped"):
        lines += [f"Skipped: {data.get('reason', 'no CUDA device')} (from `{path}`).", ""]
        return "\n".join(lines)
    cfg = data.get("config") or {}
    peak = mach.get("peak_tflops") or (mach["peak_bf16_flops"] / 1e12 if mach.get("peak_bf16_flops") else None)
    lines += [f"Device {mach.get('device', mach.get('cuda_device', '?'))} (dense bf16 peak "
              f"{f(peak, '.0f')} TFLOP/s), torch {mach.get('torch')}, {mach.get('date_utc')}; "
              f"m = {cfg.get('m')}, {cfg.get('steps')} timed steps after {cfg.get('warmup')} warm-up; kernels "
              f"{cfg.get('kernels')}.", ""]
    rows = []
    for r in data.get("results") or []:
        if r.get("error"):
            rows.append([r.get("model"), r.get("system"), "-", "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        rows.append([r.get("model"), r.get("system"), f(r.get("params") / 1e6 if r.get("params") else None, ".0f"),
                     r.get("micro_batch"), r.get("dtype"), f(r.get("tokens_per_sec"), ".0f"),
                     f(r.get("model_tflops_per_sec"), ".1f"), f(r.get("mfu"), ".3f"), f(r.get("peak_memory_GiB"), ".1f"), ""])
    lines += [md_table(["model", "system", "params (M)", "b", "dtype", "tokens/s", "model TFLOP/s", "MFU", "peak GiB", "note"],
                       rows), ""]
    lines += [
        "What the numbers mean: **tokens/s** over the timed steps; **model TFLOP/s** = "
        + (f"steps/s x `{cfg['flops_per_step']}` FLOPs per step" if cfg.get("flops_per_step") else
           f"tokens/s x `{cfg.get('flops_per_token', '6N + 12 L s h')}` FLOPs per token")
        + " (no recomputation counted); **MFU** = that over the device's dense peak in the run's precision. "
        "`engine_flush_d1` / `engine_2bw_d1` are our trainer's path (bf16 weights, bf16 gradients unless the run "
        "says fp32, fp32 master weights and Adam state, clipping); `plain` is a pure-bf16 plain loop over the same "
        "layers (its roofline).",
        "",
    ]
    return "\n".join(lines)


# ============================================================================ document
def _missing(name: str, st: dict | None) -> str:
    if st and not st.get("ok"):
        return (f"**Not available: `{name}` failed** ({st.get('error')}; log `{st.get('log')}`). The rest of the report "
                "was generated without it.")
    return f"**Not available**: no `{name}` result JSON was found."


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def machine_section(datas: dict, status: dict) -> str:
    rows = []
    for name, data in datas.items():
        if not data:
            continue
        m = dict(data.get("machine") or {})  # status.json may describe another run: times come from the data
        rows.append([name, m.get("cpu", "?"), f"{m.get('logical_cpus')} / {m.get('cpus_usable')}", m.get("torch"),
                     m.get("python"), m.get("date_utc"), ", ".join(f(x, ".2f") for x in m.get("loadavg_at_start") or []) or "-",
                     f(m.get("elapsed_s"), ".0f")])
    if not rows:
        return ""
    return "\n".join(["## Machine", "", md_table(["benchmark", "CPU", "logical / usable CPUs", "torch", "python",
                                                   "date (UTC)", "load average at start", "seconds"], rows), "",
                      "Each benchmark process runs one torch thread (`OMP_NUM_THREADS=1`); a d = 2 pipeline uses two "
                      "processes, so on a 2-core machine it has exactly one core per stage when nothing else runs. "
                      "The machine is shared with other jobs: timings are noisy (see the *other load* columns).", ""])


# Flags of each benchmark script and the config key that records each; a value equal to the flag's
# default is still written, so the command states every setting.
REPRO_FLAGS = {
    "throughput": [("d", "--d"), ("m", "--m"), ("rounds", "--rounds"), ("steps", "--steps"),
                   ("window_microbatches", "--window-microbatches"), ("warmup_steps", "--warmup-steps"),
                   ("quiet_cpus", "--quiet-cpus"), ("wait_quiet_s", "--wait-quiet"), ("retry_noisy", "--retry-noisy"),
                   ("p2p_mode", "--p2p-mode")],
    "memory": [("d", "--d"), ("ms", "--m"), ("steps", "--steps")],
    "convergence": [("preset", "--preset"), ("seq", "--seq"), ("micro_batch", "--micro-batch"), ("m", "--m"),
                    ("iters", "--iters"), ("lr", "--lr"), ("min_lr", "--min-lr"), ("warmup", "--warmup"),
                    ("seeds", "--seeds"), ("eval_interval", "--eval-interval"), ("eval_iters", "--eval-iters"),
                    ("log_interval", "--log-interval"), ("smooth_window", "--smooth"), ("target_factor", "--target-factor"),
                    ("vocab", "--vocab")],
}


def _flag_value(v) -> str | None:
    if isinstance(v, bool) or v is None or isinstance(v, dict) or v == "auto":  # "auto": the flag's default
        return None
    if isinstance(v, list):
        return " ".join(format(x, "g") if isinstance(x, float) else str(x) for x in v) or None
    return format(v, "g") if isinstance(v, float) else str(v)


def reproduce_command(name: str, data: dict, json_path: str) -> str:
    """The command that measures what ``data`` holds, rebuilt from the settings the data records."""
    cfg = dict(data.get("config") or {})
    if name == "memory" and "d" not in cfg:
        cfg["d"] = sorted({r["d"] for r in data.get("results") or [] if "d" in r})
    parts = ["python", f"benchmarks/{SCRIPTS[name]}"]
    for key, flag in REPRO_FLAGS[name]:
        v = _flag_value(cfg.get(key))
        if v is not None:
            parts += [flag, v]
    if name == "throughput" and cfg.get("track_memory"):
        parts.append("--track-memory")
    if name == "convergence":
        sweep = [e["lr"] for e in data.get("lr_sweep") or [] if e.get("lr") != cfg.get("lr")]
        if sweep:
            parts += ["--sweep-lr", _flag_value(sweep)]
    if cfg.get("quick"):
        parts.append("--quick")
    return " ".join(parts + ["--json", _show(json_path)])


def produced_section(datas: dict, status: dict, json_dir: str) -> str:
    """How each result was measured: the command, when and how long, all from the result's own JSON."""
    lines = []
    for name, data in datas.items():
        st = status.get(name) or {}
        if data is None:
            if st and not st.get("ok"):
                lines.append(f"- `{name}`: failed ({st.get('error')}; log `{st.get('log')}`)")
            continue
        m = data.get("machine") or {}
        took = f", took {f(m.get('elapsed_s'), '.0f')} s" if m.get("elapsed_s") is not None else ""
        lines.append(f"- `{name}` ({m.get('date_utc', 'date not recorded')}{took}): "
                     f"`{reproduce_command(name, data, os.path.join(json_dir, name + '.json'))}`")
        note = (data.get("config") or {}).get("lr_sweep_note")
        if note:
            lines.append(f"  ({note})")
    if not lines:
        return ""
    return "\n".join(["## How these numbers were produced", "",
                      "Each command is rebuilt from the settings recorded in its JSON file, so it measures what the "
                      "tables above show; after running them, `python benchmarks/report.py --from-json docs/data` "
                      "rebuilds this document.", ""] + lines + [""])


def summary_section(tp_targets, conv: dict | None, mem_summary, status: dict) -> str:
    rows = []
    by_kind: dict[str, list] = {}
    for t in tp_targets:
        key = t["target"].rsplit(", m=", 1)[0]
        by_kind.setdefault(key, []).append(t)
    for key, ts in by_kind.items():
        rel = "<=" if ts[0].get("lower_is_better") else ">="
        spec = "+.1f" if ts[0].get("lower_is_better") else ".3f"
        unit = "%" if ts[0].get("lower_is_better") else ""
        meas = ", ".join(f"m={t['target'].rsplit('m=', 1)[-1]}: {f(t['measured'], spec)}{unit}" if "m=" in t["target"]
                         else f(t["measured"], spec) + unit for t in ts)
        oks = [t["ok"] for t in ts]
        ok = None if any(o is None for o in oks) else all(oks)
        rows.append([key, f"{rel} {ts[0]['goal']}" + (" at every m" if len(ts) > 1 else ""), meas, verdict(ok)])
    if not tp_targets:
        rows.append(["throughput targets", "-", "not measured (" + (status.get("throughput", {}).get("error") or "no JSON") + ")", "-"])
    if conv is not None:
        r = conv.get("valid_loss_ratio_2bw_over_flush")
        finals = {x["schedule"]: x.get("final_valid_loss") for x in conv.get("runs") or []}
        noise = conv.get("seed_noise") or {}
        if len(noise.get("per_seed") or []) > 1:  # several seeds: the mean losses behind the mean ratio
            finals = noise.get("mean_final_valid_loss") or finals
        lr = (conv.get("config") or {}).get("lr")
        others = [e for e in conv.get("lr_sweep") or [] if e["lr"] != lr]
        extra = ("; other peak lr: " + ", ".join(f"{e['lr']:g}: {f(e.get('valid_loss_ratio_2bw_over_flush'), '.4f')}"
                                                  for e in others)) if others else ""
        rows.append([f"convergence: 2BW final valid loss / Flush's (peak lr {lr if lr is None else format(lr, 'g')})",
                     f"<= {T_VALID_RATIO}",
                     f"{f(r, '.4f')} (2BW {f(finals.get('2bw'), '.4f')}, Flush {f(finals.get('flush'), '.4f')}"
                     + (f"; mean of {len(noise['per_seed'])} seeds, Flush seed-to-seed spread "
                        f"{f(noise.get('flush_seed_spread'), '.4f')}" if len(noise.get("per_seed") or []) > 1 else "")
                     + f"){extra}",
                     verdict(None if r is None else r <= T_VALID_RATIO)])
    else:
        rows.append(["convergence", f"<= {T_VALID_RATIO}", "not measured (" + (status.get("convergence", {}).get("error") or "no JSON") + ")", "-"])
    if mem_summary:
        wok = all(s[3] == "yes" for s in mem_summary)
        iok = all(s[4] == "yes" for s in mem_summary)
        rows.append(["memory: weights = versions x W_r and in-flight counts = the formulas", "exact",
                     f"weights {'match' if wok else 'differ'}, in-flight {'match' if iok else 'differ'}",
                     verdict(wok and iok)])
    return "\n".join(["## Summary", "", md_table(["target (from the issue)", "goal", "measured", "verdict"], rows), "",
                      "Throughput values are medians over alternating rounds on a shared machine; a verdict near its "
                      "threshold can flip between runs. The per-round ranges are in section 1.", ""])


def build_doc(json_dir: str, doc: str, img_dir: str, gpu_json: str | None, status: dict | None, quick_note: bool) -> str:
    status = status or load_json(os.path.join(json_dir, "status.json")) or {}
    tp = load_json(os.path.join(json_dir, "throughput.json"))
    mem = load_json(os.path.join(json_dir, "memory.json"))
    conv = load_json(os.path.join(json_dir, "convergence.json"))
    regimes = load_json(os.path.join(json_dir, "convergence_regimes.json")) if os.path.exists(
        os.path.join(json_dir, "convergence_regimes.json")) else None
    gpu_path = gpu_json or (os.path.join(json_dir, "gpu.json") if os.path.exists(os.path.join(json_dir, "gpu.json")) else None)
    gpu = load_json(gpu_path) if gpu_path else None
    imgs = {}
    for name, data, fn in (("throughput", tp, plot_throughput), ("memory", mem, plot_memory),
                           ("convergence", conv, plot_convergence), ("convergence_lr", conv, plot_convergence_sweep),
                           ("convergence_regimes", regimes, plot_regimes)):
        path = os.path.join(img_dir, f"{name}.png")
        try:
            imgs[name] = path if data is not None and fn(data, path) else None
        except Exception as exc:  # noqa: BLE001 - a plot must not cost the tables
            print(f"[report] {name} plot failed: {exc}", file=sys.stderr)
            imgs[name] = None
    later = {}
    for fact in speed_rows(json_dir, str)[1]:  # a newer run of the same model and split meeting the 2BW target
        if (fact["model"], fact["split"]) == ("gpt-4x256", "uniform") and tp and fact["date"] > (
                (tp.get("machine") or {}).get("date_utc", "")[:10]) and fact["speedup"] >= T_2BW_VS_SINGLE:
            later[f"2BW (d=2) vs single process, m={fact['m']}"] = (fact["file"], fact["speedup"], fact["date"])
    tp_text, tp_targets = throughput_section(tp, status.get("throughput"), imgs["throughput"], doc, later)
    mem_text, mem_summary = memory_section(mem, status.get("memory"), imgs["memory"], doc)
    conv_text = convergence_section(conv, status.get("convergence"), imgs["convergence"], doc, imgs["convergence_lr"],
                                    regimes, imgs["convergence_regimes"])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = ["# Benchmarks", "",
            f"Generated by `python benchmarks/report.py` on {now} from the JSON files in `{_show(json_dir)}/`"
            + (f" and `{_show(gpu_path)}`" if gpu else "") + ". Do not edit by hand: rerun the command (or "
            "`python benchmarks/report.py --from-json DIR [--gpu-json FILE]` to rebuild it from saved JSON); measurements "
            "made by hand stand between `<!-- kept: NAME -->` and `<!-- /kept -->` and a rebuild carries them over "
            "(`benchmarks/kept_notes.py`).", ""]
    if quick_note:
        head += ["> **Quick smoke settings** (`--quick`): tiny models and a few steps; the numbers check the code paths, "
                 "not the performance.", ""]
    datas = {"throughput": tp, "memory": mem, "convergence": conv}
    failed = [n for n, s in status.items() if not s.get("ok") and datas.get(n) is None]
    if failed:
        head += ["> **Incomplete**: " + "; ".join(f"`{n}` failed ({status[n].get('error')})" for n in failed)
                 + ". Its section says so; the other sections are complete.", ""]
    parts = head + [answers_section(json_dir, lambda name: _rel(os.path.join(json_dir, name), doc)),
                    machine_section(datas, status), tp_text,
                    mem_text, conv_text, gpu_section(gpu, gpu_path), produced_section(datas, status, json_dir)]
    text = kept_notes.restore("\n".join(parts).rstrip() + "\n", kept_notes.read_kept(doc))
    write_text_atomic(doc, text)
    print(f"wrote {doc}")
    return text


def splice_convergence(json_dir: str, doc: str, img_dir: str) -> str:
    """Rebuild only section 3 of an existing ``doc`` from ``json_dir`` (plots: only the regimes one is
    redrawn; the others are referenced where they already exist), leaving every other section as it is."""
    conv = load_json(os.path.join(json_dir, "convergence.json"))
    path = os.path.join(json_dir, "convergence_regimes.json")
    regimes = load_json(path) if os.path.exists(path) else None
    img = os.path.join(img_dir, "convergence_regimes.png")
    img = img if regimes is not None and plot_regimes(regimes, img) else None
    old = {n: os.path.join(img_dir, f"{n}.png") for n in ("convergence", "convergence_lr")}
    old = {n: (q if os.path.exists(q) else None) for n, q in old.items()}
    status = load_json(os.path.join(json_dir, "status.json")) or {}
    section = convergence_section(conv, status.get("convergence"), old["convergence"], doc, old["convergence_lr"],
                                  regimes, img)
    with open(doc) as fh:
        text = fh.read()
    start = text.index("## 3. Convergence")
    end = text.index("\n## 4.", start) + 1
    text = kept_notes.restore(text[:start] + section.rstrip() + "\n\n" + text[end:], kept_notes.extract(text))
    write_text_atomic(doc, text)
    print(f"wrote section 3 of {doc}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="every benchmark with --quick (a smoke run, about a minute)")
    p.add_argument("--from-json", metavar="DIR", help="do not run anything: rebuild from DIR/{throughput,memory,convergence}.json")
    p.add_argument("--convergence-only", action="store_true",
                   help="with --from-json: rebuild only the convergence section of the existing --doc")
    p.add_argument("--gpu-json", metavar="FILE", help="benchmarks/gpu.py's JSON from a GPU machine (default: DIR/gpu.json if present)")
    p.add_argument("--out-dir", metavar="DIR", help="where the JSON files and logs go (default runs/benchmarks[_quick])")
    p.add_argument("--doc", help="markdown to write (default docs/benchmarks.md; quick: DIR/benchmarks.md)")
    p.add_argument("--img-dir", help="plots (default docs/img; quick: DIR/img)")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS), help="run only these benchmarks")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark before it is killed")
    p.add_argument("--sweep-lr", type=float, nargs="*", default=[5e-4, 1e-3], metavar="LR",
                   help="convergence: extra peak learning rates for the sensitivity table (full mode; none: no sweep)")
    p.add_argument("--throughput-args", default="", help="extra flags for pipeline_throughput.py (one string)")
    p.add_argument("--memory-args", default="", help="extra flags for memory.py (one string)")
    p.add_argument("--convergence-args", default="", help="extra flags for convergence.py (one string)")
    args = p.parse_args(argv)
    json_dir = os.path.abspath(args.from_json or args.out_dir or os.path.join(ROOT, "runs", "benchmarks_quick" if args.quick else "benchmarks"))
    quick_out = args.quick and not args.doc
    doc = os.path.abspath(args.doc or (os.path.join(json_dir, "benchmarks.md") if quick_out else os.path.join(ROOT, "docs", "benchmarks.md")))
    img_dir = os.path.abspath(args.img_dir or (os.path.join(json_dir, "img") if quick_out else os.path.join(os.path.dirname(doc), "img")))
    status = None
    if args.from_json:
        if not os.path.isdir(json_dir):
            p.error(f"--from-json {args.from_json}: no such directory")
        if args.convergence_only:
            splice_convergence(json_dir, doc, img_dir)
            return 0
    else:
        if args.out_dir:  # a directory given: new, empty or this report's earlier output (the default is its own)
            common.out_dir(json_dir, "report")
        os.makedirs(json_dir, exist_ok=True)
        status = run_benchmarks(args, json_dir, img_dir)
    conv = load_json(os.path.join(json_dir, "convergence.json")) or {}
    tp = load_json(os.path.join(json_dir, "throughput.json")) or {}
    quick = args.quick or bool((conv.get("config") or {}).get("quick")) or bool((tp.get("config") or {}).get("quick"))
    build_doc(json_dir, doc, img_dir, args.gpu_json, status, quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
