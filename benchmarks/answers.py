"""The opening of docs/benchmarks.md: the questions a user asks, answered from every saved run.

One section per question (how much faster than Flush and torch, at what memory, at what loss). Each
figure stands beside its ceiling (for a speed-up: the stage split's, ``sum / max`` of the measured
stage times, not the number of stages) and names the JSON file and date it comes from. Verdicts
against the issue's targets take the newest run that measured the configuration, so a target an
older run missed but a later one meets is not reported as failed. Plain data in, markdown out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

THROUGHPUT_FILES = ("throughput.json", "throughput_split.json", "throughput_split_m4.json")


def _load(json_dir: str, name: str) -> dict | None:
    path = os.path.join(json_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _date(data: dict) -> str:
    return str((data.get("machine") or {}).get("date_utc", "?"))[:10]


def _table(header: list[str], rows: Iterable[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _ceiling(data: dict, r: dict) -> float | None:
    """The stage split's ceiling of a 2-stage run: measured per-split, else the run's balance ceiling."""
    if r.get("ideal_vs_single_with_split") is not None and r["system"] == "2bw":
        return r["ideal_vs_single_with_split"]
    per_d = (data.get("per_d") or {}).get(str(r.get("d")), {})
    return per_d.get("balance_ceiling_vs_single")


def speed_rows(json_dir: str, link) -> tuple[list[list], list[dict]]:
    """(table rows, facts) of 2BW vs single, Flush and torch 1F1B in every throughput JSON, newest last."""
    rows, facts = [], []
    for name in THROUGHPUT_FILES:
        data = _load(json_dir, name)
        if data is None:
            continue
        res = [r for r in data.get("results") or [] if r.get("d") == 2 or r.get("system") == "2bw"]
        key = lambda r: (r.get("model", "gpt-4x256"), r.get("split", "uniform"), r["m"])  # noqa: E731
        by = {(key(r), r["system"]): r for r in res}
        for k in sorted({key(r) for r in res if r["system"] == "2bw"}):
            b, fl = by[(k, "2bw")], by.get((k, "flush"))
            ceiling = _ceiling(data, b)
            vs_flush = b["samples_per_sec"] / fl["samples_per_sec"] if fl and fl.get("samples_per_sec") else None
            share = b["speedup_vs_single"] / ceiling if ceiling else None
            layers = "x".join(map(str, b.get("layers_per_stage") or []))
            rows.append([f"{k[0]}, {k[1]}" + (f" ({layers})" if layers else ""), k[2], _fmt(b["speedup_vs_single"]),
                         _fmt(ceiling),
                         _fmt(share, ".0%"), _fmt(vs_flush), _fmt(b.get("ratio_vs_torch_1f1b")),
                         f"[{name}]({link(name)}) {_date(data)}"])
            facts.append({"file": name, "date": _date(data), "model": k[0], "split": k[1], "m": k[2],
                          "speedup": b["speedup_vs_single"], "ceiling": ceiling, "vs_flush": vs_flush,
                          "vs_torch": b.get("ratio_vs_torch_1f1b")})
    return rows, facts


def newest_verdicts(facts: list[dict], target: float) -> list[str]:
    """The 2BW >= target x single verdict of each (model, split, m), from the newest run that measured it."""
    newest: dict = {}
    for fct in facts:
        k = (fct["model"], fct["split"], fct["m"])
        if k not in newest or fct["date"] >= newest[k]["date"]:
            newest[k] = fct
    out = []
    for (model, split, m), fct in sorted(newest.items()):
        c = fct["ceiling"]
        if c is not None and c < target:
            verdict = (f"the stage split caps it at {c:.3f}x, below the {target}x target "
                       f"({fct['speedup'] / c:.0%} of it)")
        else:
            verdict = (f"{'**meets**' if fct['speedup'] >= target else 'misses'} the {target}x target "
                       f"(ceiling {_fmt(c)})")
        out.append(f"- {model}, {split} split, m = {m}: {fct['speedup']:.3f}x single: {verdict} "
                   f"({fct['file']}, {fct['date']})")
    return out


def _speed_lines(json_dir: str, link, target_speedup: float) -> list[str]:
    """How much faster than Flush and torch: the throughput rows, the newest verdicts, logging and Muon."""
    lines = []
    rows, facts = speed_rows(json_dir, link)
    lines += ["### How much faster than Flush and torch?", ""]
    if rows:
        lines += _table(["model, split (layers per stage)", "m", "2BW x single", "ceiling", "of ceiling",
                         "2BW / Flush", "2BW / torch 1F1B", "from"], rows)
        lines += ["", f"Against the issue's {target_speedup}x target, newest run of each configuration:", ""]
        lines += newest_verdicts(facts, target_speedup)
    else:
        lines.append("No throughput JSON saved.")
    li = _load(json_dir, "log_interval.json")
    if li:
        lines += ["", f"Logging every step costs nothing measurable: samples/s at `--log-interval 1` over "
                      f"`--log-interval 100` = {_fmt(li.get('ratio_log1_over_log100'))} (target >= {li.get('target')}; "
                      f"[log_interval.json]({link('log_interval.json')}) {_date(li)})."]
    mu = _load(json_dir, "muon_throughput.json")
    if mu and mu.get("step_s_2bw_d2"):
        st, tp = mu["step_s_2bw_d2"], mu.get("tp2_one_layer") or {}
        ups = {u["optimizer"]: u["update_s"] for u in mu.get("update", []) if u.get("stage") == 0}
        ms = lambda d, k: _fmt(1e3 * d[k], ".0f") if k in d else "-"  # noqa: E731
        lines += ["", f"Muon against AdamW, side by side (2BW, d = 2, gpt-demo, CPU): training step "
                      f"{_fmt(st.get('muon'), '.2f')} s against {_fmt(st.get('adam'), '.2f')} s "
                      f"(x{_fmt(mu.get('step_ratio_muon_over_adam'))}); stage 0's update alone {ms(ups, 'muon')} ms "
                      f"against {ms(ups, 'adam')} ms. At t = 2, one layer's matrices: the exact gather + whole "
                      f"Newton-Schulz (the one used) {ms(tp, 'gather')} ms, of which the all-gather "
                      f"{ms(tp, 'allgather_only')} ms; distributed Newton-Schulz {ms(tp, 'distributed')} ms "
                      f"([muon_throughput.json]({link('muon_throughput.json')}) {_date(mu)})."]
    return lines


def _memory_lines(json_dir: str, link) -> list[str]:
    """At what memory: weight versions and in-flight microbatches per schedule, the stage states."""
    lines = []
    mem, states = _load(json_dir, "memory.json"), _load(json_dir, "memory_states.json")
    if mem:
        by = {}
        for r in mem.get("results") or []:
            if r["stage"] == 0 and not r["recompute"]:
                by.setdefault(r["schedule"], r)
        mrows = [[s, r["d"], r["m"], r["weight_versions"], _fmt(r["measured_weight_bytes"] / 2**20, ".1f"),
                  r["max_inflight"], r["expected_inflight"], _fmt(r.get("measured_over_exact"), ".3f")]
                 for s, r in sorted(by.items())]
        lines += _table(["schedule", "d", "m", "weight versions", "weights MiB (stage 0)", "in flight",
                         "formula", "stash / exact"], mrows)
        lines += ["", f"([memory.json]({link('memory.json')}) {_date(mem)}.) 2BW keeps two weight versions and up to d "
                      "microbatches in flight per stage, as the paper's formulas say; Flush and GPipe keep one "
                      "version."]
    if states:
        lines += ["", f"Weights, gradients, fp32 master and optimizer state per stage, precision and distributed "
                      f"optimizer, against the formulas and the planner: largest relative difference "
                      f"{_fmt((states.get('largest_rel_diff') or {}).get('formula'), '.1%')} / "
                      f"{_fmt((states.get('largest_rel_diff') or {}).get('planner'), '.1%')} over "
                      f"{len(states.get('states') or [])} stage states ([memory_states.json]"
                      f"({link('memory_states.json')}) {_date(states)})."]
    return lines


def _loss_lines(json_dir: str, link, target_loss: float) -> list[str]:
    """At what loss: 2BW over Flush per setting and compensation."""
    lines = []
    conv, reg = _load(json_dir, "convergence.json"), _load(json_dir, "convergence_regimes.json")
    lrows = []
    if conv:
        lr = (conv.get("config") or {}).get("lr")
        lrows.append([f"d = 2, peak lr {lr:g}", "none", _fmt(conv.get("valid_loss_ratio_2bw_over_flush"), ".4f"),
                      f"[convergence.json]({link('convergence.json')}) {_date(conv)}"])
        for e in conv.get("lr_sweep") or []:
            if e.get("lr") != lr:
                lrows.append([f"d = 2, peak lr {e['lr']:g}", "none",
                              _fmt(e.get("valid_loss_ratio_2bw_over_flush"), ".4f"),
                              f"[convergence.json]({link('convergence.json')}) {_date(conv)}"])
    if reg:
        for name, r in (reg.get("regimes") or {}).items():
            for mode, mo in (r.get("modes") or {}).items():
                n = len(mo.get("valid_loss_ratio_per_seed") or [])
                lrows.append([f"regime `{name}`", mode, f"{_fmt(mo.get('valid_loss_ratio_mean'), '.4f')} ({n} seed"
                              f"{'s' if n != 1 else ''})",
                              f"[convergence_regimes.json]({link('convergence_regimes.json')}) {_date(reg)}"])
    if lrows:
        lines += _table(["setting", "2BW compensation", "final valid loss, 2BW / Flush", "from"], lrows)
        lines += ["", f"1.0 is Flush's loss (no staleness; the ceiling). The issue's target is <= {target_loss}: 2BW's "
                      "one-step-stale gradient costs more at a high learning rate; weight prediction "
                      "(`--2bw-compensation predict`) recovers most of it (section 3)."]
    else:
        lines.append("No convergence JSON saved.")
    return lines


def answers_section(json_dir: str, link, target_speedup: float = 1.8, target_loss: float = 1.01) -> str:
    """The three questions, answered from ``json_dir``; ``link(name)`` is the markdown path of a JSON file."""
    lines = ["## What a user asks", "",
             "Every saved run in `docs/data/` answers one of three questions below; each figure names its JSON file "
             "and the date it was measured (CPU, one core per stage, a shared machine: read the ranges in the "
             "sections after this one). A speed-up stands beside its **ceiling**: the stage split's `sum / max` of "
             "the measured stage times (1.83x for the 4-layer model's 2-stage split, whose last stage carries the LM "
             "head), not the stage count 2.0.", ""]
    lines += _speed_lines(json_dir, link, target_speedup)
    lines += ["", "### At what memory?", ""] + _memory_lines(json_dir, link)
    lines += ["", "### At what loss?", ""] + _loss_lines(json_dir, link, target_loss)
    lines += _optimizer_rows(_load(json_dir, "convergence_optimizers.json"), link, target_loss)
    lines += _ef_published_rows(_load(json_dir, "convergence_ef_published.json"), link)
    return "\n".join(lines + [""])


def _ef_published_rows(ef: dict | None, link) -> list[str]:
    """The ``ef`` rows rerun with the published rule (issue 33; ``convergence_ef_published.json``): the mean over
    seeds of each (regime, optimizer)'s final validation loss over its paired Flush."""
    if not ef or not ef.get("results"):
        return []
    groups: dict[tuple, list[float]] = {}
    for r in ef["results"]:
        if r.get("ef_rule") == "published" and r.get("valid_loss_ratio_vs_flush") is not None:
            groups.setdefault((r["regime"], r["optimizer"]), []).append(r["valid_loss_ratio_vs_flush"])
    if not groups:
        return []
    seeds = {len(v) for v in groups.values()}
    by_regime: dict[str, list[str]] = {}
    for (regime, optimizer), ratios in sorted(groups.items(), key=lambda kv: (kv[0][0] != "paper", kv[0])):
        name = {"adamw": "AdamW", "muon": "Muon"}.get(optimizer, optimizer)
        by_regime.setdefault(regime, []).append(f"{name} {sum(ratios) / len(ratios):.4f}")
    means = "; ".join(f"{regime} {', '.join(parts)}" for regime, parts in by_regime.items())
    return [f"- `ef` rows above: the former rule (the first update corrected too). With the published rule, "
            f"{'all' if ef.get('complete') else 'some of the'} {sum(len(v) for v in groups.values())} rerun and each "
            f"paired with a Flush on the same data (mean of {'/'.join(map(str, sorted(seeds)))} seed"
            f"{'s' if seeds != {1} else ''}): {means} (section 3, \"`ef` as published\"; "
            f"[convergence_ef_published.json]({link('convergence_ef_published.json')}) {_date(ef)})."]


def _optimizer_rows(opt: dict | None, link, target_loss: float) -> list[str]:
    """AdamW and Muon, Flush and 2BW with each compensation (``convergence.py --optimizers``): the mean over the
    saved seeds of each run's final validation loss over the Flush run of the same optimizer and seed, and over
    the best Flush run of any optimizer."""
    if not opt or not opt.get("results"):
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in opt["results"]:
        if r.get("schedule") == "2bw":
            groups.setdefault((r["regime"], r["optimizer"], r.get("compensation", "none")), []).append(r)
    rows = []
    for (regime, optimizer, mode), runs in sorted(groups.items()):
        same = [r["valid_loss_ratio_vs_flush"] for r in runs if r.get("valid_loss_ratio_vs_flush") is not None]
        best = [r["valid_loss_ratio_vs_best_flush"] for r in runs
                if r.get("valid_loss_ratio_vs_best_flush") is not None]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        rows.append([f"regime `{regime}`", optimizer, mode, f"{_fmt(mean(same), '.4f')} ({len(same)} seed"
                     f"{'s' if len(same) != 1 else ''})", _fmt(mean(best), ".4f"),
                     f"[convergence_optimizers.json]({link('convergence_optimizers.json')}) {_date(opt)}"])
    return ["", "By optimizer (`benchmarks/convergence.py --optimizers adamw muon`, d = 1: 2BW's rule does not "
                "depend on d):", ""] + _table(
        ["setting", "optimizer", "2BW compensation", "2BW / Flush, same optimizer", "2BW / best Flush of any optimizer",
         "from"], rows) + [""] + _optimizer_targets(groups) + (
        [f"- Data: {opt['data_note']}"] if opt.get("data_note") else [])


# issue 24's targets: the best 2BW run within this factor of Flush (same optimizer, and the best Flush of any)
OPTIMIZER_TARGETS = {"aggressive": 1.01, "paper": 1.005}


def _optimizer_targets(groups: dict[tuple, list[dict]]) -> list[str]:
    """Per regime: the best 2BW (optimizer, mode) by its mean ratio to the best Flush of any optimizer, over the
    modes measured on the most seeds, against the targets; by how much each is met or missed."""
    out = []
    for regime, target in OPTIMIZER_TARGETS.items():
        cand = {(o, m): runs for (r, o, m), runs in groups.items() if r == regime}
        if not cand:
            continue
        most = max(len(runs) for runs in cand.values())
        full = {k: v for k, v in cand.items() if len(v) == most}

        def mean(runs, key):
            xs = [r[key] for r in runs if r.get(key) is not None]
            return sum(xs) / len(xs) if xs else float("inf")

        (o, m), runs = min(full.items(), key=lambda kv: mean(kv[1], "valid_loss_ratio_vs_best_flush"))
        same, best = mean(runs, "valid_loss_ratio_vs_flush"), mean(runs, "valid_loss_ratio_vs_best_flush")
        verdict = lambda x, target=target: (f"meets it by {100 * (target - x):.2f} points" if x <= target  # noqa: E731
                                            else f"misses it by {100 * (x - target):.2f} points")
        out.append(f"- `{regime}` (target {target}): best 2BW is {o} + `{m}` ({most} seed{'s' if most != 1 else ''}): "
                   f"{same:.4f} x its optimizer's Flush ({verdict(same)}), {best:.4f} x the best Flush of any "
                   f"optimizer ({verdict(best)}).")
    return out
