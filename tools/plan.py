"""Plan a parallel layout: ranked (t, d, w, b, recompute, schedule) and the flags of the best one.

    python tools/plan.py --model-preset gpt-2.2b --num-gpus 64 --cluster aws-p3.16xlarge \\
        --global-batch-size 512 [--profile FILE] [--top 10] [--json]
    python tools/plan.py --paper-comparison [--json]
    python tools/plan.py --new-options [--json]
    python tools/plan.py --max-model --model-preset gpt-3.8b --num-gpus 64 [--json]
    python tools/plan.py --calibration [--json]
    python tools/plan.py --schedule-calibration [--json]
    python tools/plan.py --tensor-calibration [--json]
    python tools/plan.py --model-preset mixtral-8x7b --num-gpus 64 --cluster dgx-h100 --precision bf16 \\
        --global-batch-size 512 [--expert-model-parallel-size E] [--moe-router-force-load-balancing]
    python tools/plan.py --moe-ranking [--moe-router-force-load-balancing | --moe-expert-load F] [--json]

The search tries every schedule (``--schedules``) with no recomputation, the engine's whole-stage
recomputation and Megatron's selective and per-layer ones (``--recompute-granularity selective``,
``full --recompute-method uniform --recompute-num-layers 1``; ``--no-finer-recompute``: whole stages
only), and prints each plan's staleness (none for synchronous schedules; for 2BW the loss ratio
measured on a small model) beside its throughput. It tries the distributed optimizer (ZeRO-1)
wherever there is more than one replica (``--use-distributed-optimizer``: only it;
``--no-distributed-optimizer``: never), and for GPT with t > 1 sequence parallelism on and off
(``--sequence-parallel``: only on; ``--no-sequence-parallel-search``: only off; the table's ``seq-par``
column), and context parallelism at the sizes that leave each rank 4,096 tokens or more
(``--context-parallel-size C``: only C; ``--cp-comm-type``: only that exchange). Gradients accumulate
in the precision's default (fp32 for bf16, fp16 for fp16) unless ``--accumulate-allreduce-grads-in-fp32``
or ``--grad-reduce-in-bf16`` says otherwise, as in the trainer. A model with experts (``--num-experts`` and
Megatron-Core's ``--moe-*`` flags, or a planner-scale MoE preset: mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-class)
is planned with the expert-parallel size searched (``--expert-model-parallel-size E``: only E), compute from
its active parameters, memory from the E/e experts each rank holds, and the token all-to-all on each MoE
layer's critical path (``planner/moe_costs.py``); ``--moe-router-force-load-balancing`` prices tokens spread
evenly (how published MoE throughputs are taken), otherwise the busiest expert at ``--moe-expert-load`` times
the mean (default 1.25, an assumption).

Without ``--profile`` the per-layer times are an analytic estimate from FLOPs and bytes (the output
says so); its activation memory follows ``--attention-backend`` (the trainer's flag: which attention
kernel runs, so whether the ``s^2`` scores are kept). The model flags follow the trainer's rule
(``cli.model_config``). Bad input prints one ``error: ...`` line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from megatron_2bw.cli import OneLineParser, add_flags, add_model_flags, model_config, run_cli
from megatron_2bw.config import ATTENTION_BACKENDS, ModelConfig
from megatron_2bw.config.moe_presets import MOE_PRESETS, get_moe_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.flags import FLAGS, MOE
from megatron_2bw.planner import moe_report
from megatron_2bw.planner.calibration import (
    calibration,
    calibration_json,
    format_calibration,
    format_schedule_ratios,
    schedule_ratio_calibration,
    schedule_ratios_json,
)
from megatron_2bw.planner.calibration_tp import (
    format_tensor_calibration,
    korthikanti,
    paper_systems,
    tensor_calibration_json,
    tensor_mp_64,
)
from megatron_2bw.planner.context_costs import PLANNED_CP_COMM_TYPES
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.moe_ranking import PRESETS as MOE_RANKING_PRESETS
from megatron_2bw.planner.moe_ranking import format_moe_ranking, moe_ranking, moe_ranking_json
from megatron_2bw.planner.options_report import format_options, options_comparison, options_json, options_max_model
from megatron_2bw.planner.profile_check import load_checked_profile
from megatron_2bw.planner.report import (
    PAPER_CLUSTER,
    describe,
    format_max_model,
    format_paper_comparison,
    format_table,
    max_model_size,
    paper_comparison,
    plan_json,
    recompute_text,
    split_text,
)
from megatron_2bw.planner.search import DEFAULT_MEMORY_MARGIN, FINER_RECOMPUTE, PlanRequest, search
from megatron_2bw.schedule.schedules import PLANNED_SCHEDULES, PV_SUFFIX, SCHEDULE_NAMES, spec_of


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_flags(p, [f for f in FLAGS if f.group == MOE])
    add_moe_plan_flags(p)
    r = p.add_argument_group("run")
    r.add_argument("--num-gpus", type=int)
    r.add_argument("--cluster", default=PAPER_CLUSTER,
                   help=f"preset name or JSON file (default {PAPER_CLUSTER}; {MOE_RANKING_CLUSTER} for --moe-ranking)")
    r.add_argument("--global-batch-size", type=int)
    r.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    r.add_argument("--optimizer", choices=("adam", "sgd", "muon"), default="adam",
                   help="the trainer's --optimizer: Muon keeps 4 bytes less state per layer weight")
    r.add_argument("--2bw-compensation", dest="compensation", default="auto",
                   choices=("auto", "none", "predict", "dc", "ef", "extrapolate"),
                   help="the trainer's --2bw-compensation (default auto, as the trainer's): its memory on 2BW "
                        "stages and its measured loss ratio in the staleness column")
    r.add_argument("--profile", help="measured per-layer costs (schema in megatron_2bw/planner/layer_costs.py)")
    r.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="the trainer's --attention-backend, for the activation memory (default: the cluster's, auto: "
                        "scaled_dot_product_attention's kernel on that device; flash/fused keep no s^2 tensor, "
                        "unfused/local keep Korthikanti's 5as^2b)")
    r.add_argument("--reset-attention-mask", action="store_true",
                   help="the trainer's --reset-attention-mask (documents): at c = 1 auto with grouped-query heads "
                        "runs SDPA's math kernel; under context parallelism the ring's blocks take the documents' "
                        "mask in tiles")
    r.add_argument("--max-micro-batch-size", type=int, default=64)
    r.add_argument("--memory-margin", type=parse_margin, default=None, metavar="FRACTION|N%",
                   help=f"memory a plan leaves free, of the usable memory (default {DEFAULT_MEMORY_MARGIN:.0%}%; "
                        "--max-model and --paper-comparison reproduce the paper's planner without one unless given)")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--accumulate-allreduce-grads-in-fp32", dest="fp32_grads", action="store_const", const=True)
    g.add_argument("--grad-reduce-in-bf16", dest="fp32_grads", action="store_const", const=False,
                   help="accumulate gradients in the model's half precision (fp16 does by default)")
    r.add_argument("--async-save", action="store_true",
                   help="the trainer's --async-save (--ckpt-format torch_dist): show the host memory its copy of "
                        "what each rank writes holds (the save-host column; host memory, not the GPU's)")
    z = r.add_mutually_exclusive_group()
    z.add_argument("--use-distributed-optimizer", dest="zero", action="store_const", const=(True,),
                   default=(False, True), help="shard the optimizer in every layout with replicas")
    z.add_argument("--no-distributed-optimizer", dest="zero", action="store_const", const=(False,),
                   help="replicate the optimizer, as the paper")
    s = p.add_argument_group("search")
    s.add_argument("--schedules", type=_schedule_list, default=PLANNED_SCHEDULES,
                   help=f"comma-separated schedules to search (default {','.join(PLANNED_SCHEDULES)}; a name with "
                        f"{PV_SUFFIX} runs it with --enable-optimizer-post-validation; flush,gpipe: only synchronous "
                        "ones, no stale gradients)")
    s.add_argument("--no-finer-recompute", dest="finer_recompute", action="store_false",
                   help="search only the engine's whole-stage recomputation, not Megatron's selective "
                        "and per-layer (--recompute-granularity) ones")
    s.add_argument("--no-sequence-parallel-search", dest="sp_search", action="store_false",
                   help="do not try --sequence-parallel (tried by default for GPT wherever t > 1)")
    s.add_argument("--context-parallel-size", dest="context", type=int, default=None, metavar="C",
                   help="plan only this context-parallel size (the trainer's flag; 1: none). Default: 1 and every "
                        "power of two whose 2c chunks divide --seq-length and leave each rank >= 4096 tokens")
    s.add_argument("--cp-comm-type", dest="cp_comm_type", choices=PLANNED_CP_COMM_TYPES, default=None,
                   help="plan only this context-parallel exchange (the trainer's flag); default: both at c > 1")
    add_output_flags(p)
    return p


def add_moe_plan_flags(p: argparse.ArgumentParser) -> None:
    """How a model with experts is planned: its experts' load (the expert-parallel size is searched unless
    --expert-model-parallel-size fixes it)."""
    g = p.add_argument_group("mixture of experts (planner)")
    g.add_argument("--moe-router-force-load-balancing", dest="moe_force_balanced", action="store_true",
                   help="Megatron-Core's benchmark mode: tokens spread evenly over the experts (how published MoE "
                        "throughputs are taken); default: the busiest expert at --moe-expert-load x the mean")
    g.add_argument("--moe-expert-load", type=float, default=None, metavar="MAX/MEAN",
                   help="the busiest expert's tokens over the mean (the max/mean of tokens per expert the trainer "
                        "logs); default 1.25, an assumption (docs/planner.md section 12)")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """What to print: the ranked plans (how many, JSON, every plan) or one of the paper's and published tables."""
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10)
    o.add_argument("--json", action="store_true")
    o.add_argument("--exhaustive", action="store_true",
                   help="price every candidate and rank all that fit (--json lists them all); by default the search "
                        "prunes what provably cannot enter the --top plans or be the best plan with t = 1 (the same "
                        "answer, in a fraction of the time)")
    o.add_argument("--paper-comparison", action="store_true",
                   help="the paper's 2BW-vs-baselines table, predicted, then what --new-options changes")
    o.add_argument("--new-options", action="store_true",
                   help="fp32 gradients and the distributed optimizer for GPT-2.2B/3.8B on 64 V100s")
    o.add_argument("--max-model", action="store_true", help="largest model of this shape that fits, per pipeline depth")
    o.add_argument("--calibration", action="store_true",
                   help="the cost model on published layouts (megatron_2bw/planner/published.json), "
                        "predicted vs published")
    o.add_argument("--tensor-calibration", action="store_true",
                   help="tensor and sequence parallelism against published runs: Korthikanti et al. 2022, the "
                        "PipeDream-2BW paper's Figure 6a and its 64-GPU tensor-MP result (docs/planner.md 7.2)")
    o.add_argument("--moe-ranking", action="store_true",
                   help="2BW vs Flush vs the best zero-bubble schedule for the planner-scale MoE presets on 64 to "
                        "1,024 GPUs (docs/planner.md section 12; --moe-router-force-load-balancing, --moe-expert-load "
                        "apply)")
    o.add_argument("--schedule-calibration", action="store_true",
                   help="the Zero Bubble paper's ZB-1p/ZB-2p vs 1F1B throughput ratios (published.json "
                        "schedule_ratios), predicted vs published")


def _schedule_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = []
    for n in names:
        try:
            spec_of(n)
        except ConfigError:
            bad.append(n)
    if bad or not names:
        raise argparse.ArgumentTypeError(f"choose among {', '.join(PLANNED_SCHEDULES)} (a zero-bubble one with "
                                         f"{PV_SUFFIX}: post-validation), got {text!r}")
    return names


def parse_margin(text: str) -> float:
    """``0.1`` or ``10%``."""
    try:
        return float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction or percentage: {text!r}") from None


def moe_ranking_text(args: argparse.Namespace, cluster_name: str) -> str:
    """``--moe-ranking``: the table, or its JSON."""
    cluster = load_cluster(cluster_name)
    req = PlanRequest(get_moe_preset(MOE_RANKING_PRESETS[0]), cluster, 1, 1, moe_force_balanced=args.moe_force_balanced,
                      moe_expert_load=args.moe_expert_load)  # the flags checked once, before the searches
    rows = moe_ranking(cluster, args.moe_force_balanced, args.moe_expert_load)
    if args.json:
        return json.dumps(moe_ranking_json(rows), indent=2)
    return format_moe_ranking(rows, moe_report.load_text(req))


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model of the flags, by the trainer's rule; a planner-scale MoE preset (``--model-preset
    mixtral-8x7b``, ``config/moe_presets.py``) takes the MoE flags given as overrides of its experts."""
    preset = getattr(args, "model_preset", None)
    if preset not in MOE_PRESETS:
        return model_config(args)
    base, given, rest = get_moe_preset(preset), {}, argparse.Namespace(**vars(args))
    for f in (f for f in FLAGS if f.group == MOE):
        value = getattr(args, f.dest, None)
        if value is not None and value is not False:
            given[f.targets[0].split(".")[1]] = f.const if f.const is not None else value
        setattr(rest, f.dest, None)
    rest.model_preset = None
    moe = replace(base.moe, **given)
    return model_config(rest, base=replace(base, moe=moe))


def expert_parallel_options(args: argparse.Namespace, model: ModelConfig) -> tuple[int, ...] | None:
    """``--expert-model-parallel-size`` given: that size only; else None (searched, for a model with experts)."""
    if getattr(args, "expert_model_parallel_size", None) is None:
        return None
    return (model.moe.expert_model_parallel_size,) if model.moe else (args.expert_model_parallel_size,)


def _require(value, flag: str) -> None:
    if value is None:
        raise ConfigError(f"{flag} is required")


def run(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    if args.calibration:
        rows = calibration()
        return json.dumps(calibration_json(rows), indent=2) if args.json else format_calibration(rows)
    if args.tensor_calibration:
        kor, systems, tmp = korthikanti(), paper_systems(), tensor_mp_64()
        if args.json:
            return json.dumps(tensor_calibration_json(kor, systems, tmp), indent=2)
        return format_tensor_calibration(kor, systems, tmp)
    if args.schedule_calibration:
        ratios = schedule_ratio_calibration()
        return json.dumps(schedule_ratios_json(ratios), indent=2) if args.json else format_schedule_ratios(ratios)
    if args.moe_ranking:
        given = any(a == "--cluster" or a.startswith("--cluster=") for a in argv)
        return moe_ranking_text(args, args.cluster if given else MOE_RANKING_CLUSTER)
    cluster = load_cluster(args.cluster)
    if args.attention_backend is not None:
        cluster = replace(cluster, attention_backend=args.attention_backend)
    if args.reset_attention_mask:
        cluster = replace(cluster, reset_attention_mask=True)
    if args.new_options:
        opts, largest = options_comparison(cluster), options_max_model(cluster)
        return json.dumps(options_json(opts, largest), indent=2) if args.json else format_options(opts, largest)
    if args.paper_comparison:
        rows = paper_comparison(cluster)
        if args.json:
            return json.dumps([{"model": r.model_name, "num_gpus": r.num_gpus, "global_batch_size": r.global_batch_size,
                                "best": {s: (describe(e) if e else None) for s, e in r.best.items()},
                                "speedup_2bw": {s: r.ratio(s) for s in r.best if s != "2BW"}} for r in rows], indent=2)
        opts = format_options(options_comparison(cluster), options_max_model(cluster))
        return format_paper_comparison(rows) + "\n\n" + opts
    model = model_from_args(args)
    _require(args.num_gpus, "--num-gpus")
    if args.num_gpus < 1:
        raise ConfigError(f"--num-gpus must be positive, got {args.num_gpus}")
    if args.max_model:
        depths = [d for d in (2**i for i in range(args.num_gpus.bit_length())) if args.num_gpus % d == 0]
        # the paper's Figure: its three systems (the chunked and zero-bubble schedules have layout rules,
        # m >= 2d - 1 or m a multiple of d, that its m = d sweep does not meet)
        paper = tuple(n for n in SCHEDULE_NAMES if n in ("2bw", "flush", "gpipe"))
        rows = [r for sched in paper for zero in args.zero
                for r in max_model_size(model, cluster, args.num_gpus, depths, sched, args.precision,
                                        distributed_optimizer=zero, fp32_grads=args.fp32_grads,
                                        memory_margin=args.memory_margin or 0.0)]
        if args.json:
            return json.dumps([asdict(r) for r in rows], indent=2)
        return format_max_model(rows, model, cluster, args.num_gpus)
    _require(args.global_batch_size, "--global-batch-size")
    if args.top < 1:
        raise ConfigError(f"--top must be positive, got {args.top}")
    request = plan_request(args, model, cluster)
    costs = load_checked_profile(args.profile, model, args.precision, cluster.device) if args.profile else None
    result = search(request, costs, top=None if args.exhaustive else args.top, keep={PAPER_SPACE: paper_space})
    if args.json:
        return json.dumps({**plan_json(result), **paper_space_json(result)}, indent=2)
    return format_table(result, args.top) + "\n\n" + paper_space_text(result)


MOE_RANKING_CLUSTER = "dgx-h100"  # the planner's H100 cluster description (planner/clusters)

# The paper's planner searched t = 1 only (d, w, b and recomputation); the best plan there, beside the best overall,
# shows what the extra axes (tensor and sequence parallelism, the later schedules, the distributed optimizer, finer
# recomputation, uneven splits) are predicted to add.
PAPER_SPACE = "t=1"


def paper_space(c) -> bool:
    return c.tensor_parallel == 1


def paper_space_gain(result) -> float | None:
    """The best plan's predicted samples/s over the best with t = 1, less 1 (None: nothing with t = 1 fits)."""
    t1 = result.best_of.get(PAPER_SPACE)
    return None if t1 is None else result.best.samples_per_sec / t1.samples_per_sec - 1


def paper_space_text(result) -> str:
    """The best plan with t = 1 (the paper's search space) and what the best plan is predicted to gain over it."""
    t1, gain = result.best_of.get(PAPER_SPACE), paper_space_gain(result)
    if t1 is None:
        return "best with t = 1 (the paper's search space): none fits"
    c = t1.candidate
    head = (f"best with t = 1 (the paper's search space): d = {c.pipeline_parallel}, w = {c.data_parallel}, "
            f"b = {c.micro_batch_size}, recompute {recompute_text(c)}, "
            f"{c.schedule if c.pipeline_parallel > 1 else 'no pipeline'}"
            f"{', distributed optimizer' if c.distributed_optimizer else ''}, {split_text(c)} split: "
            f"{t1.samples_per_sec:.1f} samples/s")
    if gain is not None and gain > 1e-9:
        return head + f"; the extra axes of the best plan are predicted to add {100 * gain:.1f}%"
    return head + "; it is the best plan: the extra axes are predicted to add nothing here"


def paper_space_json(result) -> dict:
    t1 = result.best_of.get(PAPER_SPACE)
    gain = paper_space_gain(result)
    return {"best_t1": describe(t1, result.request) if t1 else None,
            "extra_axes_gain": None if gain is None else round(gain, 4)}


def plan_request(args: argparse.Namespace, model: ModelConfig, cluster) -> PlanRequest:
    """The search's request from the flags (a ranked table's)."""
    return PlanRequest(model, cluster, args.num_gpus, args.global_batch_size, args.precision,
                       max_micro_batch_size=args.max_micro_batch_size, fp32_grads=args.fp32_grads,
                       distributed_optimizer_options=args.zero, schedules=args.schedules,
                       recompute_policies=FINER_RECOMPUTE if args.finer_recompute else (),
                       memory_margin=DEFAULT_MEMORY_MARGIN if args.memory_margin is None else args.memory_margin,
                       sequence_parallel_options=sequence_parallel_options(model, args.sp_search),
                       compensation=args.compensation, optimizer=args.optimizer, async_save=args.async_save,
                       context_parallel_options=context_parallel_options(args, model),
                       cp_comm_types=PLANNED_CP_COMM_TYPES if args.cp_comm_type is None else (args.cp_comm_type,),
                       expert_parallel_options=expert_parallel_options(args, model),
                       moe_force_balanced=args.moe_force_balanced, moe_expert_load=args.moe_expert_load)


def context_parallel_options(args: argparse.Namespace, model: ModelConfig) -> tuple[int, ...] | None:
    """``--context-parallel-size`` given: that size only, checked as the trainer checks it; else None (searched)."""
    c = args.context
    if c is None:
        return None
    if c < 1:
        raise ConfigError(f"--context-parallel-size must be positive, got {c}")
    if args.num_gpus % c:
        raise ConfigError(f"--num-gpus {args.num_gpus} is not divisible by --context-parallel-size {c}")
    model.check_context_parallel(c, 1, args.cp_comm_type or "p2p")
    return (c,)


def sequence_parallel_options(model: ModelConfig, search: bool) -> tuple[bool, ...]:
    """``--sequence-parallel`` given: only on; else off and on for GPT (``search``), off for BERT."""
    if model.sequence_parallel:
        return (True,)
    return (False, True) if search and model.kind == "gpt" else (False,)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
