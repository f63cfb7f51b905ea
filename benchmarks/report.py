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
import convergence_runs
import kept_notes
from answers import answers_section, speed_rows
from report_convergence import convergence_section, plot_convergence, plot_convergence_sweep
from report_format import f, load_json, md_table, rel_link, show_path, verdict
from report_memory import memory_section, plot_memory
from report_moe import moe_section, plot_expert_load
from report_regimes import plot_regimes
from report_throughput import T_2BW_VS_SINGLE, T_VALID_RATIO, plot_throughput, throughput_section

from megatron_2bw.export.outputs import write_text_atomic

ROOT = common.ROOT
BENCH = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = ("throughput", "memory", "convergence")
SCRIPTS = {"throughput": "pipeline_throughput.py", "memory": "memory.py", "convergence": "convergence.py"}


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
        print(f"[report] {name}: {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}",
              flush=True)
        t0 = time.time()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        st = {"command": " ".join(shlex.quote(c) for c in cmd), "log": os.path.relpath(log, ROOT)}
        with open(log, "w") as f:
            rc = convergence_runs.run_group(cmd, args.timeout, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        st["seconds"] = round(time.time() - t0, 1)
        if rc == 0 and os.path.exists(js):
            st["ok"] = True
        else:
            st["ok"] = False
            with open(log) as f:
                lines = [ln.rstrip() for ln in f if ln.strip()]
            st["error"] = (f"timed out after {args.timeout:.0f} s" if rc is None else f"exit status {rc}") + \
                (": " + lines[-1][:300] if lines else "")
        print(f"[report] {name}: {'ok' if st['ok'] else 'FAILED (' + st['error'] + ')'} in {st['seconds']} s",
              flush=True)
        status[name] = st
    with open(os.path.join(out_dir, "status.json"), "w") as f:
        json.dump(status, f, indent=1)
    return status


# ============================================================================ GPU
def gpu_section(data: dict | None, path: str | None) -> str:
    lines = ["## 4. One GPU (`benchmarks/gpu.py`)", ""]
    if data is None:
        lines += ["Not run here: no GPU JSON was given. On a GPU node run `python benchmarks/gpu.py --json gpu.json` "
                  "and rebuild this document with `python benchmarks/report.py --from-json DIR --gpu-json gpu.json`.",
                  ""]
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
                     f(r.get("model_tflops_per_sec"), ".1f"), f(r.get("mfu"), ".3f"),
                     f(r.get("peak_memory_GiB"), ".1f"), ""])
    lines += [md_table(["model", "system", "params (M)", "b", "dtype", "tokens/s", "model TFLOP/s", "MFU", "peak GiB",
                        "note"], rows), ""]
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


def machine_section(datas: dict, status: dict) -> str:
    rows = []
    for name, data in datas.items():
        if not data:
            continue
        m = dict(data.get("machine") or {})  # status.json may describe another run: times come from the data
        rows.append([name, m.get("cpu", "?"), f"{m.get('logical_cpus')} / {m.get('cpus_usable')}", m.get("torch"),
                     m.get("python"), m.get("date_utc"),
                     ", ".join(f(x, ".2f") for x in m.get("loadavg_at_start") or []) or "-",
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
                    ("log_interval", "--log-interval"), ("smooth_window", "--smooth"),
                    ("target_factor", "--target-factor"),
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
    return " ".join(parts + ["--json", show_path(json_path)])


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
        rows.append(["throughput targets", "-",
                     "not measured (" + (status.get("throughput", {}).get("error") or "no JSON") + ")", "-"])
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
        rows.append(["convergence", f"<= {T_VALID_RATIO}",
                     "not measured (" + (status.get("convergence", {}).get("error") or "no JSON") + ")", "-"])
    if mem_summary:
        wok = all(s[3] == "yes" for s in mem_summary)
        iok = all(s[4] == "yes" for s in mem_summary)
        rows.append(["memory: weights = versions x W_r and in-flight counts = the formulas", "exact",
                     f"weights {'match' if wok else 'differ'}, in-flight {'match' if iok else 'differ'}",
                     verdict(wok and iok)])
    return "\n".join(["## Summary", "", md_table(["target (from the issue)", "goal", "measured", "verdict"], rows), "",
                      "Throughput values are medians over alternating rounds on a shared machine; a verdict near its "
                      "threshold can flip between runs. The per-round ranges are in section 1.", ""])


def build_doc(json_dir: str, doc: str, img_dir: str, gpu_json: str | None, status: dict | None,
              quick_note: bool) -> str:
    status = status or load_json(os.path.join(json_dir, "status.json")) or {}
    tp = load_json(os.path.join(json_dir, "throughput.json"))
    mem = load_json(os.path.join(json_dir, "memory.json"))
    conv = load_json(os.path.join(json_dir, "convergence.json"))
    regimes = load_json(os.path.join(json_dir, "convergence_regimes.json")) if os.path.exists(
        os.path.join(json_dir, "convergence_regimes.json")) else None
    moe_json = os.path.join(json_dir, "convergence_moe.json")
    moe = load_json(moe_json)
    gpu_path = gpu_json or (os.path.join(json_dir, "gpu.json") if os.path.exists(os.path.join(json_dir, "gpu.json"))
                            else None)
    gpu = load_json(gpu_path) if gpu_path else None
    imgs = {}
    for name, data, fn in (("throughput", tp, plot_throughput), ("memory", mem, plot_memory),
                           ("convergence", conv, plot_convergence), ("convergence_lr", conv, plot_convergence_sweep),
                           ("convergence_regimes", regimes, plot_regimes),
                           ("convergence_moe_load", moe, plot_expert_load)):
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
    conv_text += "\n" + "\n".join(moe_section(moe, imgs["convergence_moe_load"], doc, moe_json))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = ["# Benchmarks", "",
            f"Generated by `python benchmarks/report.py` on {now} from the JSON files in `{show_path(json_dir)}/`"
            + (f" and `{show_path(gpu_path)}`" if gpu else "") + ". Do not edit by hand: rerun the command (or "
            "`python benchmarks/report.py --from-json DIR [--gpu-json FILE]` to rebuild it from saved JSON); "
            "measurements made by hand stand between `<!-- kept: NAME -->` and `<!-- /kept -->` and a rebuild carries "
            "them over (`benchmarks/kept_notes.py`).", ""]
    if quick_note:
        head += ["> **Quick smoke settings** (`--quick`): tiny models and a few steps; the numbers check the code "
                 "paths, not the performance.", ""]
    datas = {"throughput": tp, "memory": mem, "convergence": conv}
    failed = [n for n, s in status.items() if not s.get("ok") and datas.get(n) is None]
    if failed:
        head += ["> **Incomplete**: " + "; ".join(f"`{n}` failed ({status[n].get('error')})" for n in failed)
                 + ". Its section says so; the other sections are complete.", ""]
    parts = head + [answers_section(json_dir, lambda name: rel_link(os.path.join(json_dir, name), doc)),
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
    moe_json = os.path.join(json_dir, "convergence_moe.json")
    moe_img = os.path.join(img_dir, "convergence_moe_load.png")
    moe = load_json(moe_json)
    section += "\n" + "\n".join(moe_section(moe, moe_img if moe and plot_expert_load(moe, moe_img) else None, doc,
                                               moe_json))
    with open(doc) as fh:
        text = fh.read()
    start = text.index("## 3. Convergence")
    end = text.index("\n## 4.", start) + 1
    text = kept_notes.restore(text[:start] + section.rstrip() + "\n\n" + text[end:], kept_notes.extract(text))
    write_text_atomic(doc, text)
    print(f"wrote section 3 of {doc}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="every benchmark with --quick (a smoke run, about a minute)")
    p.add_argument("--from-json", metavar="DIR", help="do not run anything: rebuild from "
                                                      "DIR/{throughput,memory,convergence}.json")
    p.add_argument("--convergence-only", action="store_true",
                   help="with --from-json: rebuild only the convergence section of the existing --doc")
    p.add_argument("--gpu-json", metavar="FILE", help="benchmarks/gpu.py's JSON from a GPU machine (default: "
                                                      "DIR/gpu.json if present)")
    p.add_argument("--out-dir", metavar="DIR", help="where the JSON files and logs go (default "
                                                    "runs/benchmarks[_quick])")
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
    json_dir = os.path.abspath(args.from_json or args.out_dir
                               or os.path.join(ROOT, "runs", "benchmarks_quick" if args.quick else "benchmarks"))
    quick_out = args.quick and not args.doc
    doc = os.path.abspath(args.doc or (os.path.join(json_dir, "benchmarks.md") if quick_out
                                       else os.path.join(ROOT, "docs", "benchmarks.md")))
    img_dir = os.path.abspath(args.img_dir or (os.path.join(json_dir, "img") if quick_out
                                               else os.path.join(os.path.dirname(doc), "img")))
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
