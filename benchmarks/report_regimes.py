"""Section 3's two regimes (``convergence.py --regimes``): every ``--2bw-compensation`` mode against Flush,
and whether a mode meets the rule for changing the default."""

from __future__ import annotations

import convergence_plots
from report_format import f, md_table, rel_link, verdict
from report_throughput import T_VALID_RATIO

REGIME_TARGETS = {"paper": 1.01, "aggressive": 1.02}  # issue 15: best 2BW mode within 1% / 2% of Flush
MODE_TEXT = {"none": "2BW (plain)", "predict": "2BW + predict", "dc": "2BW + dc"}


def plot_regimes(data: dict, path: str) -> bool:
    if not (data.get("regimes") and all(r.get("runs") for r in data["regimes"].values())):
        return False
    convergence_plots.plot_regimes(data, path)
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
            base = {r["seed"]: r["final_valid_loss"] for r in reg["runs"]
                    if r["schedule"] == "2bw" and r["compensation"] == "none"}
            for r in reg["runs"]:
                if r["schedule"] == "2bw" and r["compensation"] == mode and r["seed"] in base:
                    total += 1
                    wins += r["final_valid_loss"] < base[r["seed"]] * (1 - floor)
        need = sum(len({r["seed"] for r in reg["runs"] if r["schedule"] == "flush"}) for reg in regs.values())
        out.append(f"- `{mode}` beats plain 2BW's final validation loss by more than the regime's noise floor in "
                   f"{wins} of {total} measured (regime, seed) pairs ({need} needed to change the default): "
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
                  f"depend on d), b = {c['micro_batch']}, m = {c['m']} (global batch {c['global_batch']}), "
                  f"{c['iters']} steps, Adam lr {c['lr']:g} ({c['warmup']} linear warm-up steps, {c['lr_decay']} to "
                  f"{c['min_lr']:g}), weight decay {c['weight_decay']}, clipping {c['clip_grad']}, {c['precision']}, "
                  f"seeds {', '.join(str(x) for x in c['seeds'])}; validation over {c['valid_sequences']} sequences "
                  f"every {c['eval_interval']} steps; dc lambda {c['dc_lambda']:g}. Target: best 2BW mode <= {target} "
                  f"x Flush. Flush's seed-to-seed spread (noise floor): {f(reg.get('flush_seed_spread'), '.4f')}. "
                  f"Time-to-loss uses the measured 2BW/Flush throughput ratio {f(sp.get('ratio'), '.3f')} (d = 2, m = "
                  f"{sp.get('m')}, `{sp.get('source')}`).", "",
                  md_table(["run", "final valid loss (per seed)", "/ Flush (per seed)", "mean ratio",
                            f"within {target}",
                            "steps to Flush's final train loss", "time to it / Flush's",
                            "Flush's steps to this final train loss", "time to this loss / Flush's"], rows), "",
                  f"Best complete 2BW mode here: `{best}`." if best else "No 2BW mode complete on every seed yet.", ""]
    if img:
        lines += [f"![convergence in two regimes]({rel_link(img, doc)})", ""]
    today = (f"- The trainer's default today: `{_cli_default()}` (`config.resolve_compensation`: `ef` with Muon, "
             "`predict` with Adam or SGD-momentum in bf16/fp16 without the distributed optimizer, where it costs no "
             "memory, `none` otherwise; the Muon and `ef` runs: `docs/data/convergence_optimizers.json`, first "
             "section).")
    lines += ["Default `--2bw-compensation` (changed only for a mode better than plain 2BW in both regimes and both "
              "seeds):", ""] + _default_advice(data) + [today] + _regime_advice(data) + [
        "",
        "- **steps to Flush's final train loss**: the first step whose smoothed training loss is at or under the same "
        "seed's Flush final smoothed training loss (`-`: never within the run). **time to it / Flush's**: "
        "(2BW steps / Flush steps) / measured throughput ratio; under 1 means 2BW gets there sooner in wall time.",
        "- **Flush's steps to this final train loss**: the other way round, the first step at which Flush's smoothed "
        "training loss reached this run's final one; **time to this loss / Flush's** = (this run's steps / those Flush "
        "steps) / measured throughput ratio (under 1: 2BW reaches its own final loss sooner in wall time than Flush "
        "does).",
        "- Semantics of each mode: `megatron_2bw/pipeline/compensation.py` (module docstring). A mode marked "
        "`(1 seed)` ran on the first seed only (`convergence.py --first-seed-only`).",
        "- Runs at d = 2 come from the single-regime benchmark (`docs/data/convergence.json`, the same settings; "
        "reused with `--resume-from`): 2BW's and Flush's update rules do not depend on d, and the d = 1 and d = 2 "
        "Flush runs of the same seed give the same final validation loss to the printed digits.",
        ""]
    return lines
