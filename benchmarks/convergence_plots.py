"""The convergence benchmark's plots: loss curves per schedule and seed, the learning-rate sweep, and one
panel per regime (``convergence.py``, ``report.py``)."""

from __future__ import annotations

import os


def plot_sweep(sweep: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.4))
    cmap = plt.get_cmap("viridis")
    lo = []
    for i, e in enumerate(sweep):
        color = cmap(i / max(1, len(sweep) - 1) * 0.85)
        for r in e["runs"]:
            ls = "-" if r["schedule"] == "2bw" else "--"
            ax.plot(r["curve"]["step"], r["curve"]["train_loss_smoothed"], ls, color=color, lw=1.4,
                    label=f"lr {e['lr']:g} {LABELS.get(r['schedule'], r['schedule'])}")
            ax.plot(r["valid"]["step"], r["valid"]["loss"], "o" if r["schedule"] == "2bw" else "s", color=color, ms=4,
                    mfc="none" if r["schedule"] == "flush" else color)
            lo += [x for x in r["curve"]["train_loss_smoothed"] if x == x]
    if lo:
        a, b = min(lo), max(lo)
        ax.set_ylim(a - 0.1 * (b - a) - 0.05, min(b, a + 0.6 * (b - a) + 0.5))
    ax.set_xlabel("training step")
    ax.set_ylabel("LM loss (smoothed train: lines; validation: markers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


COLORS = {"2bw": "tab:blue", "flush": "tab:orange"}
LABELS = {"2bw": "PipeDream-2BW", "flush": "PipeDream-Flush"}


def plot(runs: list[dict], path: str, title: str) -> None:
    """Loss against step (left) and training wall time (right). With several seeds the first
    seed's runs are drawn in full (raw and smoothed training loss, validation markers, time-to-loss
    lines) and every further seed's as a thinner smoothed line with hollow validation markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(dict.fromkeys(r.get("seed") for r in runs))
    styles = ["-", "--", "-.", ":"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, xkey, xlabel in ((axes[0], "step", "training step"), (axes[1], "seconds", "training wall time (s)")):
        for r in runs:
            s, c, v = r["schedule"], r["curve"], r["valid"]
            k = seeds.index(r.get("seed"))
            tag = f"{LABELS.get(s, s)}" + (f" seed {r.get('seed')}" if len(seeds) > 1 else "")
            color = COLORS.get(s)
            if k == 0:
                ax.plot(c[xkey], c["train_loss"], color=color, alpha=0.2, lw=0.8)
            ax.plot(c[xkey], c["train_loss_smoothed"], styles[k % len(styles)], color=color, lw=1.6 if k == 0 else 1.1,
                    label=f"{tag} train (smoothed)")
            vx = [x for x in v[xkey] if x is not None]
            ax.plot(vx, v["loss"][: len(vx)], "o" if k == 0 else "s", ls="--" if k == 0 else "none", color=color, ms=5,
                    lw=1, mfc=color if k == 0 else "none", label=f"{tag} validation")
            t = r.get("time_to_loss") or {}
            if k == 0 and t.get(xkey) is not None:
                ax.axvline(t[xkey], color=color, ls=":", lw=1)
        tgt = (runs[0].get("time_to_loss") or {}).get("target")
        if tgt is not None:
            ax.axhline(tgt, color="gray", ls=":", lw=1,
                       label="time-to-loss target" + (f" (seed {seeds[0]})" if len(seeds) > 1 else ""))
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("LM loss (nats/token)")
    all_losses = [x for r in runs for x in r["curve"]["train_loss_smoothed"] if x == x]
    if all_losses:  # hide the first steps' ~9.0 so the end of the curves is readable
        lo, hi = min(all_losses), max(all_losses)
        axes[0].set_ylim(lo - 0.1 * (hi - lo) - 0.05, min(hi, lo + 0.6 * (hi - lo) + 0.5))
    fig.suptitle(title, fontsize=10)
    if len(seeds) > 1:  # many entries: one legend under both panels, clear of the curves
        handles, labels = axes[1].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3, frameon=False)
        fig.set_size_inches(11, 5.4)
        fig.tight_layout(rect=(0, 0.14, 1, 1))
    else:
        axes[1].legend(fontsize=8, loc="upper right")
        fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


MODE_STYLE = {("flush", "none"): ("tab:orange", "PipeDream-Flush"), ("2bw", "none"): ("tab:blue", "2BW"),
              ("2bw", "predict"): ("tab:green", "2BW + predict"), ("2bw", "dc"): ("tab:red", "2BW + dc"),
              ("2bw", "ef"): ("tab:purple", "2BW + ef"), ("2bw", "extrapolate"): ("tab:brown", "2BW + extrapolate")}


def plot_regimes(data: dict, path: str) -> None:
    """One panel per regime: smoothed training loss per (schedule, compensation), seeds as line styles;
    validation losses as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regs = data["regimes"]
    fig, axes = plt.subplots(1, len(regs), figsize=(6 * len(regs), 4.6), squeeze=False)
    for ax, (name, reg) in zip(axes[0], regs.items(), strict=False):
        seeds = list(dict.fromkeys(r["seed"] for r in reg["runs"]))
        lo = []
        for r in sorted(reg["runs"], key=lambda r: r["compensation"] == "dc"):  # dc (often on plain 2BW's) on top
            color, label = MODE_STYLE.get((r["schedule"], r["compensation"]), ("gray", r["schedule"]))
            if r.get("optimizer", "adamw") != "adamw":
                label = f"{r['optimizer']} {label}"
            k = seeds.index(r["seed"])
            c = r["curve"]
            dotted = r["compensation"] == "dc"  # dotted: visible where it lies on plain 2BW's curve
            muon = r.get("optimizer") == "muon"  # Muon: dash-dotted lines
            ax.plot(c["step"], c["train_loss_smoothed"], "-." if muon else (":" if dotted else "-") if k == 0 else "--",
                    color=color, lw=2.0 if dotted else 1.3,
                    label=f"{label} seed {r['seed']}" + (f" (d={r['d']})" if r.get("d") else ""))
            ax.plot(r["valid"]["step"], r["valid"]["loss"], "o" if k == 0 else "s", color=color, ms=3.5,
                    mfc=color if k == 0 else "none")
            lo += [x for x in c["train_loss_smoothed"] if x == x]
        if lo:
            a, b = min(lo), max(lo)
            ax.set_ylim(a - 0.05 * (b - a) - 0.05, min(b, a + 0.5 * (b - a) + 0.5))
        cfg = reg["config"]
        ax.set_title(f"{name}: global batch {cfg['global_batch']} (b={cfg['micro_batch']}, m={cfg['m']}), "
                     f"lr {cfg['lr']:g}, warm-up {cfg['warmup']}, {cfg['iters']} steps", fontsize=8.5)
        ax.set_xlabel("training step")
        ax.set_ylabel("LM loss (smoothed train: lines; validation: markers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
