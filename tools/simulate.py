"""Simulate a pipeline schedule: step time, bubble, memory per stage, a Chrome trace and a PNG.

    python tools/simulate.py --schedule 2bw --d 4 --m 8 --profile gpt-2.2b.h200.json \\
        --cluster dgx-h200 --trace out.json --png out.png
    python tools/simulate.py --schedule flush --d 4 --m 8 --model-preset gpt-2.2b --cluster dgx-h200 \\
        --precision bf16 --b 4 --recompute --png flush.png

It runs the engine's own per-stage action lists (``schedule/schedules.py``) with per-action times:
forward/backward from the profile (or the analytic estimate of ``layer_costs.py`` without one),
transfers over the cluster's links, the optimizer step and the gradient all-reduces (which 2BW
overlaps with the next step). The cost model's closed-form prediction is printed beside it.
Open the trace in chrome://tracing or https://ui.perfetto.dev. Bad input: one ``error:`` line, status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from megatron_2bw.cli import OneLineParser, add_model_flags, model_config, run_cli
from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.cost_model import predict
from megatron_2bw.planner.hardware import GiB, load_cluster
from megatron_2bw.planner.layer_costs import analytic_microbatch_costs, read_profile_json
from megatron_2bw.planner.memory_model import Candidate, ParamBytes
from megatron_2bw.planner.profile_check import check_profile_fits
from megatron_2bw.planner.profiler import load_full_profile
from megatron_2bw.planner.simulator import RECOMPUTE_SCOPES, simulate_plan
from megatron_2bw.planner.split import balanced_split
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES
from megatron_2bw.schedule.stages import canonical_split, format_split, parse_split

DEFAULT_CLUSTER = "aws-p3.16xlarge"


def _split_arg(text: str) -> str | tuple[int, ...]:
    """``balanced`` or comma-separated layer counts."""
    return text if text == "balanced" else parse_split(text)


def _candidate(args: argparse.Namespace, b: int, num_layers: int, costs, cluster, pb: ParamBytes) -> Candidate:
    """The simulated layout, with the split asked for (``balanced``: the planner's)."""
    cand = Candidate(args.t, args.d, args.w, b, args.m, args.recompute, args.schedule)
    split = args.pipeline_layer_split
    if split == "balanced":
        split = balanced_split(costs, cand, num_layers, cluster, pb)
    return replace(cand, layer_split=canonical_split(num_layers, args.d, split) if split else None)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("pipeline")
    s.add_argument("--schedule", choices=SCHEDULE_NAMES, required=True)
    s.add_argument("--d", type=int, required=True, help="pipeline depth (stages)")
    s.add_argument("--m", type=int, required=True, help="microbatches per step per pipeline")
    s.add_argument("--b", type=int, help="microbatch size (default: the profile's smallest, else 1)")
    s.add_argument("--t", type=int, default=1, help="tensor-parallel size")
    s.add_argument("--w", type=int, default=1, help="data-parallel width (sets the all-reduce cost)")
    s.add_argument("--recompute", action="store_true")
    s.add_argument("--pipeline-layer-split", type=_split_arg, metavar="N,N,...",
                   help="transformer layers of each stage (default: even; 'balanced': the planner's split)")
    s.add_argument("--recompute-scope", choices=RECOMPUTE_SCOPES, default="stage",
                   help="stage: our engine re-runs the whole stage; layers: Megatron re-runs only the transformer "
                        "layers")
    s.add_argument("--steps", type=int, default=6, help="steps in the simulated segment (>= 3 for a steady state)")
    add_model_flags(p)
    m = p.add_argument_group("costs")
    m.add_argument("--profile", help="a profile from tools/profile_model.py (else the analytic estimate); "
                                     "without --model-preset its model is the base the model flags override")
    m.add_argument("--cluster", default=DEFAULT_CLUSTER, help=f"preset or JSON file (default {DEFAULT_CLUSTER})")
    m.add_argument("--precision", choices=("fp16", "bf16", "fp32"),
                   help="default: the profile's, else fp16 (sets bytes per parameter and activation)")
    o = p.add_argument_group("output")
    o.add_argument("--trace", help="write a Chrome trace (JSON) here")
    o.add_argument("--png", help="write a timeline PNG here")
    o.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def model_from_args(args: argparse.Namespace, from_profile: ModelConfig | None = None) -> ModelConfig:
    """The model of the flags by the trainer's rule, a profile's model standing in for a preset."""
    return model_config(args, base=from_profile)


def over_memory(peak_bytes, usable_bytes: int) -> list[int]:
    """The stages whose simulated peak exceeds what a process can fill on the device."""
    return [i for i, x in enumerate(peak_bytes) if x > usable_bytes]


def run(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    for k in ("d", "m", "t", "w", "steps"):
        if getattr(args, k) < 1:
            raise ConfigError(f"--{k} must be >= 1, got {getattr(args, k)}")
    if args.png:  # the plot extra: say so before any work, not as a traceback after it
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError:
            raise ConfigError("--png needs matplotlib, an optional extra: pip install -e '.[plot]'") from None
    cluster = load_cluster(args.cluster)
    loaded = load_full_profile(args.profile) if args.profile else None
    model = model_from_args(args, loaded.model if loaded else None)
    optimizer = None
    nograd = None
    precision = args.precision or (loaded.meta.get("dtype") if loaded else None) or "fp16"
    if loaded is not None:  # the planner's own check: a profile of another model, precision or device is refused
        check_profile_fits(args.profile, read_profile_json(args.profile), model, precision, cluster.device)
        sizes = loaded.costs.micro_batch_sizes(args.t)
        if not sizes:
            raise ConfigError(f"profile {args.profile} has no entries for t={args.t} "
                              f"(has t in {loaded.costs.tensor_sizes()})")
        b = args.b or sizes[0]
        costs = loaded.costs.at(args.t, b)
        if costs is None:
            raise ConfigError(f"profile {args.profile} has no b={b} at t={args.t} (has b in {sizes})")
        optimizer = loaded.optimizer
        nograd = {blk: v for blk in ("embedding", "layer", "head")
                  if (v := loaded.forward_nograd_s(args.t, b, blk)) is not None}
        source = loaded.costs.source
    else:
        b = args.b or 1
        costs = analytic_microbatch_costs(model, cluster, precision, args.t, b)
        source = f"analytic estimate ({cluster.device}, {precision})"
    pb = ParamBytes.for_precision(precision)
    cand = _candidate(args, b, model.num_layers, costs, cluster, pb)
    res = simulate_plan(costs, cand, model.num_layers, cluster, num_steps=args.steps, param_bytes=pb,
                        recompute_scope=args.recompute_scope, forward_nograd_s=nograd, optimizer=optimizer)
    pred = predict(costs, cand, model.num_layers, cluster, pb)
    title = f"{args.schedule} d={args.d} m={args.m} b={b} t={args.t} w={args.w}"
    title += " recompute" if args.recompute else ""
    if cand.layer_split:
        title += f" layers {format_split(cand.layer_split)}"
    if args.trace:
        from megatron_2bw.planner.timeline import write_chrome_trace  # noqa: PLC0415

        write_chrome_trace(res, args.trace, title=title)
    if args.png:
        from megatron_2bw.planner.timeline import write_png  # noqa: PLC0415

        write_png(res, args.png, title=title)
    summary = res.summary()
    summary.update(samples_per_sec=cand.global_batch_size / res.step_time_s if res.step_time_s else None,
                   cost_model_batch_s=pred.batch_s, costs_source=source, micro_batch_size=b)
    lines = [
        f"{title}; {model.kind}, {model.num_layers} layers, hidden {model.hidden_size}, seq {model.seq_length}",
        f"costs: {source}",
        f"simulated step time (steady state): {res.step_time_s * 1e3:.3f} ms   "
        f"({summary['samples_per_sec']:.1f} samples/s at global batch {cand.global_batch_size})",
        f"bubble: {100 * res.bubble_fraction:.1f}% of stage time idle in steady state",
        f"cost model (closed form): {pred.batch_s * 1e3:.3f} ms per batch",
        "peak memory per stage (GiB, weights+grads+optimizer + activations): "
        + " ".join(f"{x / GiB:.2f}" for x in res.peak_bytes),
        "peak stashed activations per stage (MiB): " + " ".join(f"{x / 2**20:.1f}" for x in res.peak_activation_bytes),
    ]
    over = over_memory(res.peak_bytes, cluster.usable_memory_bytes)
    summary.update(usable_memory_bytes=cluster.usable_memory_bytes, stages_over_memory=over)
    if over:
        lines.append(
            f"warning: stage{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} "
            f"({', '.join(f'{res.peak_bytes[i] / GiB:.2f}' for i in over)} GiB) "
            f"exceed{'' if len(over) > 1 else 's'} the "
            f"{cluster.usable_memory_bytes / GiB:.1f} GiB usable of a {cluster.device_memory_bytes / GiB:.1f} GiB "
            f"{cluster.device}: this plan does not fit (raise --d or --t, recompute, or lower --b)")
    if args.trace:
        lines.append(f"trace: {args.trace}")
    if args.png:
        lines.append(f"png: {args.png}")
    return json.dumps(summary, indent=2) if args.json else "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
