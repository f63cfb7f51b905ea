"""Section 3 of ``docs/benchmarks.md``: 2BW vs Flush at equal steps (``convergence.py``), its plots and the
learning-rate sensitivity; the two regimes follow it (``report_regimes.py``)."""

from __future__ import annotations

import convergence_plots
from report_format import f, md_table, missing_note, rel_link, verdict
from report_regimes import regimes_section
from report_throughput import T_VALID_RATIO


def plot_convergence(data: dict, path: str) -> bool:
    runs = data.get("runs") or []
    if not runs or not all("curve" in r for r in runs):
        return False
    cfg, mach = data.get("config") or {}, data.get("machine") or {}
    nseeds = len({r.get("seed") for r in runs})
    title = (f"{cfg.get('preset')} (seq {cfg.get('seq')}), d=2, b={cfg.get('micro_batch')}, m={cfg.get('m')}, "
             f"{cfg.get('iters')} steps, {nseeds} seed(s) on {mach.get('cpus_usable')} CPUs; valid loss 2BW/Flush = "
             f"{f(data.get('valid_loss_ratio_2bw_over_flush'), '.4f')}")
    convergence_plots.plot(runs, path, title)
    return True


def plot_convergence_sweep(data: dict, path: str) -> bool:
    sweep = data.get("lr_sweep") or []
    if len(sweep) < 2:
        return False
    cfg = data.get("config") or {}
    convergence_plots.plot_sweep(sweep, path, f"{cfg.get('preset')} (seq {cfg.get('seq')}), d=2, "
                                        f"b={cfg.get('micro_batch')}, m={cfg.get('m')}, {cfg.get('iters')} steps: 2BW "
                                        f"(solid) vs Flush (dashed) per peak lr")
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


def _setting_lines(cfg: dict, mach: dict, seeds: list) -> list[str]:
    """The trainer's settings both runs of a seed share."""
    nvalid = cfg.get("valid_sequences") or ((cfg.get("eval_iters") or 0) * (cfg.get("global_batch") or 0) or None)
    return [f"The real trainer (`pretrain_gpt.py`, torchrun, 2 processes, d = 2, w = 1), preset `{cfg.get('preset')}` "
              f"at sequence {cfg.get('seq')}, b = {cfg.get('micro_batch')}, m = {cfg.get('m')} (global batch "
              f"{cfg.get('global_batch')}), {cfg.get('iters')} steps, Adam lr {cfg.get('lr')} (cosine to "
              f"{cfg.get('min_lr')}, {cfg.get('warmup')} linear warm-up steps), weight decay "
              f"{cfg.get('weight_decay')}, clipping {cfg.get('clip_grad')}, {cfg.get('precision')}, seeds "
              f"{', '.join(str(x) for x in seeds)}, data `{cfg.get('data')}` (vocabulary {cfg.get('vocab')}); "
              f"validation every {cfg.get('eval_interval')} steps over {cfg.get('eval_iters')} global batches "
              f"({f(nvalid)} sequences); logging segments of {cfg.get('log_interval')} steps (2BW drains only "
              f"there){'; QUICK smoke settings, not representative' if cfg.get('quick') else ''}. Only "
              f"`--pipeline-schedule` differs between the two runs of a seed; the seed sets the initialization, the "
              f"training data order and which validation sequences are drawn. Took {f(mach.get('elapsed_s'), '.0f')} "
              f"s.", ""]


def _runs_lines(data: dict, cfg: dict) -> list[str]:
    """One row per run: losses, times and the time-to-loss target."""
    table = []
    for r in data.get("runs") or []:
        t = r.get("time_to_loss") or {}
        table.append([r["schedule"], f(r.get("seed", cfg.get("seed"))), r.get("steps"),
                      f(r.get("final_valid_loss"), ".4f"),
                      f(r.get("final_train_loss"), ".4f"), f(r.get("seconds"), ".1f"), f(r.get("wall_seconds"), ".1f"),
                      f(r.get("samples_per_sec_median"), ".1f"), f(t.get("target"), ".4f"), f(t.get("step")),
                      f(t.get("seconds"), ".1f"), f(r.get("foreign_load_cpus"), ".2f")])
    return [md_table(["schedule", "seed", "steps", "final valid loss", "final train loss (smoothed)", "training s",
                      "process wall s", "samples/s (median)", "time-to-loss target", "step reached",
                      "seconds to target", "other load (CPUs)"], table), ""]


def _seed_lines(noise: dict) -> list[str]:
    """Each seed's paired ratio, and the mean (nothing with one seed's run)."""
    if not noise.get("per_seed"):
        return []
    rows = [[f(e["seed"]), f(e["final_valid_loss"].get("2bw"), ".4f"), f(e["final_valid_loss"].get("flush"), ".4f"),
             f(e.get("valid_loss_ratio_2bw_over_flush"), ".4f")] for e in noise["per_seed"]]
    means = noise.get("mean_final_valid_loss") or {}
    rows.append(["mean", f(means.get("2bw"), ".4f"), f(means.get("flush"), ".4f"),
                 f(noise.get("valid_loss_ratio_mean"), ".4f")])
    return ["Per seed (each ratio is paired: same initialization, data order and validation sequences):", "",
              md_table(["seed", "2BW final valid", "Flush final valid", "2BW / Flush"], rows), ""]


def _targets_lines(data: dict, seeds: list, noise: dict) -> list[str]:
    """The issue's target (the mean ratio) beside the noise floor and the speedups."""
    ratio = data.get("valid_loss_ratio_2bw_over_flush")
    fs = noise.get("flush_seed_spread", data.get("flush_seed_spread"))
    gap = noise.get("gap_above_noise")
    return [md_table(["target", "goal", "measured", "verdict"], [
        ["2BW final valid loss / Flush final valid loss (equal steps"
         + (", mean over seeds)" if len(seeds) > 1 else ")"),
         f"<= {T_VALID_RATIO}", f(ratio, ".4f"), verdict(None if ratio is None else ratio <= T_VALID_RATIO)],
        ["noise floor: Flush seed-to-seed spread (max - min) / mean of its final valid loss", "(info)", f(fs, ".4f"),
         "-"],
        ["2BW's excess (mean ratio - 1) above that noise floor", "(info)",
         "-" if gap is None else ("yes" if gap else "no") + f" ({f(None if ratio is None else ratio - 1, '+.4f')} vs "
                                                            f"{f(fs, '.4f')})", "-"],
        ["spread of the per-seed ratios (max - min)", "(info)", f(noise.get("ratio_spread"), ".4f"), "-"],
        ["training-time speedup 2BW vs Flush (same steps" + (", mean over seeds)" if len(seeds) > 1 else ")"), "(info)",
         f(data.get("train_time_speedup_2bw_vs_flush"), ".3f"), "-"],
        ["time-to-loss speedup 2BW vs Flush", "(info)", f(data.get("time_to_loss_speedup_2bw_vs_flush"), ".3f"), "-"],
    ]), ""]


def _sweep_lines(data: dict, cfg: dict, seeds: list, sweep_img: str | None, doc: str) -> list[str]:
    """The same pair at other peak learning rates (nothing without a sweep)."""
    sweep = data.get("lr_sweep") or []
    if len(sweep) < 2:
        return []
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
    lines = ["### Learning-rate sensitivity", "",
              f"The same pair of runs (seed {seeds[0]} only) at other peak learning rates (cosine decay to the same "
              "fraction, everything else unchanged), to show how the gap between the 1-stale-gradient rule and "
              "vanilla updates depends on the step size in this short, small-batch regime.", "",
              md_table(["peak lr", "min lr", "2BW final valid", "Flush final valid", "2BW / Flush", "within 1%",
                        "2BW train (sm)", "Flush train (sm)"], rows), ""]
    if sweep_img:
        lines += [f"![convergence vs learning rate]({rel_link(sweep_img, doc)})", ""]
    return lines


def _meaning_lines(cfg: dict) -> list[str]:
    """What each column means (the smoothing window, the time-to-loss factor and the segment from ``cfg``)."""
    return [
        "What the numbers mean:",
        "",
        "- **final valid loss**: mean LM loss (nats/token) of the last validation evaluation, after the last step, on "
        "the newest weights; both runs of a seed see the same validation samples at the same steps, so each per-seed "
        "ratio is a paired comparison. Flush has vanilla semantics `W(t+1) = W(t) - lr*grad f_t(W(t))`; 2BW applies "
        "the 1-stale gradient `grad f_t(W(t-1))`; a (mean) ratio at or under 1.01 is the issue's convergence target.",
        "- **noise floor**: the Flush-vs-Flush difference between seeds, `(max - min) / mean` of Flush's final "
        "validation loss (for two seeds `|flush(s1) - flush(s2)| / flush`). A 2BW excess (mean ratio - 1) below it is "
        "not distinguishable from changing the seed; the paired per-seed ratios are less noisy than that, so their own "
        "spread is listed too.",
        f"- **final train loss**: trailing mean of the training loss over the last {cfg.get('smooth_window')} steps "
        "(2BW's training loss of step t is computed on `W(t-1)`).",
        "- The losses are deterministic for a given configuration (same seed, data order and fp32 arithmetic; a rerun "
        "reproduces them to the printed digits); the times are not.",
        "- **training s**: the sum of the trainer's per-step times (each logging segment's wall time, fill and drain "
        "included; evaluations, start-up and process launch excluded); **process wall s** is the whole torchrun "
        "subprocess. Both are noisy on a shared 2-core machine (see *other load*).",
        f"- **time-to-loss**: target = {cfg.get('target_factor')} x Flush's final smoothed training loss of the same "
        f"seed; the first step whose smoothed training loss is at or under it, and the training seconds up to it (step "
        f"times inside a {cfg.get('log_interval')}-step segment are the segment's mean).",
        "",
    ]


def convergence_section(data: dict | None, st: dict | None, img: str | None, doc: str, sweep_img: str | None = None,
                        regimes: dict | None = None, regimes_img: str | None = None) -> str:
    lines = ["## 3. Convergence: 2BW vs Flush at equal steps (CPU, `benchmarks/convergence.py`)", ""]
    if data is None:
        lines += [missing_note("convergence", st), ""] + regimes_section(regimes, regimes_img, doc)
        return "\n".join(lines)
    cfg, mach = data.get("config") or {}, data.get("machine") or {}
    seeds = cfg.get("seeds") or [cfg.get("seed")]
    noise = data.get("seed_noise") or {}
    lines += _setting_lines(cfg, mach, seeds) + _runs_lines(data, cfg) + _seed_lines(noise)
    lines += _targets_lines(data, seeds, noise)
    if img:
        lines += [f"![convergence]({rel_link(img, doc)})", ""]
    lines += _sweep_lines(data, cfg, seeds, sweep_img, doc)
    expl = data.get("exploration") or []
    if expl:
        lines += ["### How the defaults were chosen (measured settings)", "",
                  "Pairs of runs (2BW and Flush, same seed) measured with this script while choosing the defaults; "
                  "everything not listed is as above (seq 64, b = 2, cosine decay to lr/10, weight decay 0.01, "
                  "clipping 1.0). Settings where 2BW misses 1% are kept.", ""] + _exploration_table(expl)
    lines += _meaning_lines(cfg)
    return "\n".join(lines + regimes_section(regimes, regimes_img, doc))
