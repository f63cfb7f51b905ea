"""The MoE + 2BW convergence study in ``docs/benchmarks.md`` (issue 43): the ratio table with the seed spread,
the signs of Zmushko et al.'s gaps, the aim, and the figure of the expert load, from ``convergence_moe.py``'s JSON
(``docs/data/convergence_moe.json``). ``report.py`` puts it at the end of section 3's generated part:

    python benchmarks/report.py --from-json docs/data --convergence-only     # rebuild section 3 only
"""

from __future__ import annotations

from report_format import f, md_table, rel_link, save_figure

PIPE_TEXT = {"flush": "Flush", "2bw": "2BW", "2bw-ef": "2BW + ef"}
PIPE_STYLE = {"flush": ("tab:orange", "-"), "2bw": ("tab:blue", "-"), "2bw-ef": ("tab:purple", "-")}
OPT_STYLE = {"adamw": "-", "muon": "--"}


def _load_curves(data: dict, regime: str) -> dict:
    """Per (optimizer, pipeline): the steps and, per layer, the max/mean tokens per expert averaged over seeds
    (only the steps every seed logged)."""
    out = {}
    for r in data["rows"]:
        if r["model"] != "moe" or r["regime"] != regime or not r.get("expert_load"):
            continue
        out.setdefault((r["optimizer"], r["pipeline"]), []).append(r["expert_load"])
    curves = {}
    for key, loads in out.items():
        n = min(len(ld["step"]) for ld in loads)
        layers = sorted(loads[0]["max_over_mean"], key=int)
        curves[key] = {"step": loads[0]["step"][:n],
                       "layers": {ly: [sum(ld["max_over_mean"][ly][i] for ld in loads) / len(loads) for i in range(n)]
                                  for ly in layers},
                       "seeds": len(loads)}
    return curves


def plot_expert_load(data: dict, path: str) -> bool:
    """One row per regime, one panel per MoE layer: max/mean tokens per expert over training, per optimizer
    (line style) and pipeline (colour), the mean over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = [g for g in data["config"]["regimes"] if _load_curves(data, g)]
    if not regimes:
        return False
    layers = data["config"]["model"]["layers"]
    fig, axes = plt.subplots(len(regimes), layers, figsize=(5.2 * layers, 3.6 * len(regimes)), squeeze=False,
                             sharey=True)
    for row, g in zip(axes, regimes, strict=True):
        curves = _load_curves(data, g)
        for ly, ax in enumerate(row):
            for (opt, pipe), c in sorted(curves.items()):
                color, _ = PIPE_STYLE[pipe]
                ax.plot(c["step"], c["layers"][str(ly)], OPT_STYLE[opt], color=color, lw=1.3,
                        label=f"{opt} {PIPE_TEXT[pipe]}")
            ax.axhline(1.0, color="gray", lw=0.8, ls=":")  # balanced
            m = data["config"]["model"]  # the ceiling: every token of the batch sends one of its k choices here
            ax.axhline(m["num_experts"] / m["topk"], color="gray", lw=0.8, ls="--")
            ax.set_title(f"{g}: layer {ly}", fontsize=9)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("max / mean tokens per expert\n(dashed: the ceiling E / k)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    m = data["config"]["model"]
    fig.suptitle(f"Expert load, {m['num_experts']} experts top-{m['topk']} (aux loss {m['aux_loss_coeff']:g}); "
                 f"mean over seeds {', '.join(str(s) for s in data['config']['seeds'])}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    return True


def _ratio_rows(data: dict) -> list[list]:
    """One row per (regime, model, optimizer, pipeline): losses and ratios per seed, mean, spread."""
    seeds = data["config"]["seeds"]
    rows = []
    for s in data["summary"]:
        by = {r["seed"]: r for r in data["rows"] if all(r[k] == s[k] for k in ("model", "optimizer", "pipeline",
                                                                                "regime"))}
        loss = " / ".join(f(by[sd]["final_valid_loss"] if sd in by else None, ".4f") for sd in seeds)
        ratio = " / ".join(f(by[sd]["valid_loss_ratio_vs_flush"] if sd in by else None, ".4f") for sd in seeds)
        fs = data["flush_seed_spread"].get(f"{s['model']}/{s['optimizer']}/{s['regime']}")
        flush = s["pipeline"] == "flush"
        rows.append([s["regime"], s["model"], s["optimizer"], PIPE_TEXT[s["pipeline"]], loss,
                     "1 (reference)" if flush else ratio, "-" if flush else f(s["valid_loss_ratio_mean"], ".4f"),
                     "-" if flush else f(s["valid_loss_ratio_spread"], ".4f"), f(fs, ".4f") if flush else ""])
    order = {g: i for i, g in enumerate(data["config"]["regimes"])}
    return sorted(rows, key=lambda r: (order.get(r[0], 9), r[1], r[2], list(PIPE_TEXT.values()).index(r[3])))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _recovered(e: dict, opt: str) -> str:
    """The share of ``opt``'s 2BW gap that ef recovers, or why there is none."""
    if e[f"{opt}_ef_recovered"] is not None:
        return f"{100 * e[f'{opt}_ef_recovered']:.0f}%"
    if e[f"{opt}_2bw_gap"] is None or e[f"{opt}_ef_gap"] is None:
        return "-"
    return "- (2BW has no gap)"


def _sign_rows(data: dict) -> list[list]:
    rows = []
    for e in data["signs"]:
        rec = [_recovered(e, o) for o in ("adamw", "muon")]
        rows.append([e["regime"], e["model"], _pct(e["adamw_2bw_gap"]), _pct(e["adamw_ef_gap"]), rec[0],
                     _pct(e["muon_2bw_gap"]), _pct(e["muon_ef_gap"]), rec[1], f(e["muon_gap_smaller"])])
    return rows


def _load_rows(data: dict) -> list[list]:
    """Per (regime, optimizer, pipeline): the max/mean tokens per expert of each layer, first logged interval,
    peak and last, mean over the seeds."""
    rows = []
    for g in data["config"]["regimes"]:
        for (opt, pipe), c in sorted(_load_curves(data, g).items()):
            cells = [f"{v[0]:.2f} / {max(v):.2f} / {v[-1]:.2f}" for _, v in sorted(c["layers"].items(),
                                                                                   key=lambda kv: int(kv[0]))]
            rows.append([g, opt, PIPE_TEXT[pipe], *cells])
    return rows


def _setup(data: dict) -> str:
    c, m = data["config"], data["config"]["model"]
    h, k, fe = m["hidden"], m["topk"], m["expert_ffn"]
    moe_ffn, dense_ffn = k * 2 * h * fe + h * m["num_experts"], 2 * h * k * fe + k * fe + h  # dense: with biases
    regs = "; ".join(f"**{g}**: b = {r['micro_batch']}, m = {r['m']} (global batch {r['global_batch']}), "
                     f"{r['iters']} steps, lr {r['lr']:g} ({r['warmup']} warm-up steps, cosine to {r['min_lr']:g}), "
                     f"validation over {r['valid_sequences']} sequences every {r['eval_interval']} steps"
                     for g, r in c["regimes"].items())
    return (f"Every run is `pretrain_gpt.py` in one process at d = 1 (2BW's update rule does not depend on d) on the "
            f"demo corpus ({c['vocab']}-token SentencePiece), {m['layers']} layers, hidden {m['hidden']}, "
            f"{m['heads']} heads, sequence {m['seq']}, fp32, weight decay {c['weight_decay']}, clipping "
            f"{c['clip_grad']}. **MoE**: {m['num_experts']} experts of FFN size {m['expert_ffn']} per layer, top-"
            f"{m['topk']}, softmax router, aux-loss load balancing at coefficient {m['aux_loss_coeff']:g}, "
            f"`--moe-grouped-gemm`, dropless, no expert bias. **Dense**: FFN size {m['topk'] * m['expert_ffn']} "
            f"(top-k x the expert's), so the active parameters match (the experts have no linear biases and the "
            f"router adds {m['hidden'] * m['num_experts']} weights per layer: {moe_ffn:,} active FFN parameters per "
            f"layer against the dense {dense_ffn:,}). AdamW (betas 0.9, 0.999) or Muon (`--optimizer muon`, peak "
            f"{c['muon_lr']:g} on the matrices, AdamW on the rest). {regs}. Seeds "
            f"{', '.join(str(s) for s in c['seeds'])}. Each ratio is the final validation loss over the Flush run's "
            f"of the same model, optimizer, regime and seed.")


def _aim_line(data: dict) -> str:
    a = data["aim"]
    per = ", ".join(f"{g} {f(v, '.4f')} (per seed {' / '.join(f(x, '.4f') for x in a['ratio_per_seed'][g])}; "
                    f"{len(a['ratio_per_seed'][g])} of {len(data['config']['seeds'])} seeds)"
                    for g, v in a["mean_ratio"].items())
    verdict = {True: "**met**", False: "**not met**", None: "not measured yet"}[a["met"]]
    every = {True: "every seed within it too", False: "not every seed within it", None: ""}[a["met_by_every_seed"]]
    return (f"The aim stated before the runs, MoE + Muon + 2BW + ef within {100 * (a['max_ratio'] - 1):.1f}% of "
            f"Flush in both regimes (mean over seeds): {per}: {verdict}" + (f" ({every})." if every else "."))


def moe_section(data: dict | None, img: str | None, doc: str, json_path: str) -> list[str]:
    """Setup, ratio table, signs, aim, expert load (nothing without the JSON)."""
    if not data:
        return []
    lines = ["### MoE under 2BW: the convergence study (issue 43, `convergence_moe.py`)", ""]
    if not data.get("complete"):
        lines += [f"> **Partial**: {len(data['rows'])} runs finished when this was generated.", ""]
    lines += [_setup(data), "",
              md_table(["regime", "model", "optimizer", "pipeline", "final valid loss (per seed)",
                        "/ Flush (per seed)", "mean ratio", "ratio spread over seeds", "Flush seed spread"],
                       _ratio_rows(data)), "",
              "Gaps to Flush (mean ratio - 1) and the share of 2BW's gap that `ef` recovers ((gap 2BW - gap ef) / "
              "gap 2BW):", "",
              md_table(["regime", "model", "AdamW 2BW", "AdamW 2BW + ef", "ef recovers", "Muon 2BW", "Muon 2BW + ef",
                        "ef recovers", "Muon's 2BW gap smaller"], _sign_rows(data)), "",
              _aim_line(data), "",
              "Expert load (max / mean tokens per expert, first logged interval / peak / last, mean over seeds):", "",
              md_table(["regime", "optimizer", "pipeline"] + [f"layer {i}" for i in
                                                               range(data["config"]["model"]["layers"])],
                       _load_rows(data)), ""]
    if img:
        lines += [f"![expert load over training]({rel_link(img, doc)})", ""]
    lines += [f"Data: [convergence_moe.json]({rel_link(json_path, doc)}); `python benchmarks/convergence_moe.py --json "
              "docs/data/convergence_moe.json`.", ""]
    return lines
