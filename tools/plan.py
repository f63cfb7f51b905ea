"""Plan a parallel layout: ranked (t, d, w, b, recompute, schedule) and the flags of the best one.

    python tools/plan.py --model-preset gpt-2.2b --num-gpus 64 --cluster aws-p3.16xlarge \\
        --global-batch-size 512 [--profile FILE] [--top 10] [--json]
    python tools/plan.py --paper-comparison [--json]
    python tools/plan.py --max-model --model-preset gpt-3.8b --num-gpus 64 [--json]

Without ``--profile`` the per-layer times are an analytic estimate from FLOPs and bytes (the output
says so). Bad input prints one ``error: ...`` line on stderr and exits with status 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
from dataclasses import asdict  # noqa: E402

from megatron_2bw.config import ModelConfig  # noqa: E402
from megatron_2bw.errors import ConfigError, run_cli  # noqa: E402
from megatron_2bw.models.presets import GPT2_VOCAB, get_preset  # noqa: E402
from megatron_2bw.planner.hardware import load_cluster  # noqa: E402
from megatron_2bw.planner.layer_costs import load_profile  # noqa: E402
from megatron_2bw.planner.report import (  # noqa: E402
    PAPER_CLUSTER, PAPER_DROPOUT, format_max_model, format_paper_comparison, format_table, max_model_size,
    paper_comparison, plan_json, describe,
)
from megatron_2bw.planner.search import PlanRequest, search  # noqa: E402

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2, like every other bad input
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, or the shape flags; flags override a preset)")
    m.add_argument("--model-preset")
    m.add_argument("--model-kind", choices=("gpt", "bert"))
    for flag in MODEL_FLAGS + ("vocab_size", "ffn_hidden_size", "max_position_embeddings"):
        m.add_argument("--" + flag.replace("_", "-"), type=int)
    m.add_argument("--hidden-dropout", type=float, default=PAPER_DROPOUT, help="default 0.1 (Megatron's and the paper's)")
    m.add_argument("--attention-dropout", type=float, default=PAPER_DROPOUT, help="default 0.1")
    r = p.add_argument_group("run")
    r.add_argument("--num-gpus", type=int)
    r.add_argument("--cluster", default=PAPER_CLUSTER, help=f"preset name or JSON file (default {PAPER_CLUSTER})")
    r.add_argument("--global-batch-size", type=int)
    r.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    r.add_argument("--profile", help="measured per-layer costs (schema in megatron_2bw/planner/layer_costs.py)")
    r.add_argument("--max-micro-batch-size", type=int, default=64)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10)
    o.add_argument("--json", action="store_true")
    o.add_argument("--paper-comparison", action="store_true", help="the paper's 2BW-vs-baselines table, predicted")
    o.add_argument("--max-model", action="store_true", help="largest model of this shape that fits, per pipeline depth")
    return p


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """A preset with flag overrides, or a model entirely from flags."""
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS + ("vocab_size", "ffn_hidden_size", "max_position_embeddings")
                 if getattr(args, k) is not None}
    if args.model_kind:
        overrides["kind"] = args.model_kind
    overrides["hidden_dropout"], overrides["attention_dropout"] = args.hidden_dropout, args.attention_dropout
    if args.model_preset:
        if "seq_length" in overrides and "max_position_embeddings" not in overrides:
            overrides["max_position_embeddings"] = overrides["seq_length"]
        return get_preset(args.model_preset, **overrides)
    missing = [k for k in MODEL_FLAGS if k not in overrides]
    if missing:
        raise ConfigError("give --model-preset, or all of " + " ".join("--" + k.replace("_", "-") for k in MODEL_FLAGS)
                          + f" (missing {' '.join('--' + k.replace('_', '-') for k in missing)})")
    overrides.setdefault("vocab_size", GPT2_VOCAB)
    return ModelConfig(**overrides)


def _require(value, flag: str) -> None:
    if value is None:
        raise ConfigError(f"{flag} is required")


def run(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    cluster = load_cluster(args.cluster)
    if args.paper_comparison:
        rows = paper_comparison(cluster)
        if args.json:
            return json.dumps([{"model": r.model_name, "num_gpus": r.num_gpus, "global_batch_size": r.global_batch_size,
                                "best": {s: (describe(e) if e else None) for s, e in r.best.items()},
                                "speedup_2bw": {s: r.ratio(s) for s in r.best if s != "2BW"}} for r in rows], indent=2)
        return format_paper_comparison(rows)
    model = model_from_args(args)
    _require(args.num_gpus, "--num-gpus")
    if args.num_gpus < 1:
        raise ConfigError(f"--num-gpus must be positive, got {args.num_gpus}")
    if args.max_model:
        depths = [d for d in (2**i for i in range(args.num_gpus.bit_length())) if args.num_gpus % d == 0]
        rows = [r for sched in ("2bw", "flush", "gpipe")
                for r in max_model_size(model, cluster, args.num_gpus, depths, sched, args.precision)]
        if args.json:
            return json.dumps([asdict(r) for r in rows], indent=2)
        return format_max_model(rows, model, cluster, args.num_gpus)
    _require(args.global_batch_size, "--global-batch-size")
    if args.top < 1:
        raise ConfigError(f"--top must be positive, got {args.top}")
    request = PlanRequest(model, cluster, args.num_gpus, args.global_batch_size, args.precision,
                          max_micro_batch_size=args.max_micro_batch_size)
    costs = load_profile(args.profile) if args.profile else None
    result = search(request, costs)
    return json.dumps(plan_json(result), indent=2) if args.json else format_table(result, args.top)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
