"""Profile a model's blocks on this device and write a planner profile (``--profile FILE``).

    python tools/profile_model.py --model-preset gpt-2.2b --micro-batch-sizes 1 2 4 8 --precision bf16 \\
        --out gpt-2.2b.h200.json [--tensor-parallel 1 2 4 8] [--reps 10 --warmup 3]
    python tools/plan.py --model-preset gpt-2.2b --num-gpus 64 --global-batch-size 512 \\
        --cluster dgx-h200 --precision bf16 --profile gpt-2.2b.h200.json

Per microbatch size it measures the embedding, one transformer layer and the head (with the loss):
forward and backward time (median of ``--reps`` after ``--warmup``, CUDA-synchronized), parameters,
input/output bytes and the bytes autograd stashes, plus the optimizer step's time per parameter.
The file follows ``megatron_2bw/planner/layer_costs.py``'s schema (with extra keys its loader
ignores). Sizes at ``t > 1`` spawn ``t`` processes, one per local GPU (gloo processes on a CPU).
Model flags follow the trainer's rule (``cli.model_config``). Bad input prints one ``error: ...`` line and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_2bw.cli import OneLineParser, add_model_flags, model_config, run_cli
from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.outputs import check_files, write_text_atomic
from megatron_2bw.planner.layer_costs import PROFILE_FORMAT


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    r = p.add_argument_group("measurement")
    r.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    r.add_argument("--tensor-parallel", type=int, nargs="+", default=[1],
                   help="tensor-parallel sizes (t > 1 spawns t processes)")
    r.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    r.add_argument("--device", help="cuda, cuda:1 or cpu (default: CUDA when available)")
    r.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--no-optimizer", action="store_true", help="skip timing the optimizer step")
    r.add_argument("--keep-going", action="store_true",
                   help="on CUDA, when a b runs out of memory, write the smaller sizes measured so far "
                        "instead of failing")
    o = p.add_argument_group("output")
    o.add_argument("--out", required=True, help="profile JSON to write")
    o.add_argument("--overwrite", action="store_true", help="replace an --out that is not a profile")
    return p


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The model of the flags, by the trainer's rule."""
    return model_config(args)


def _is_profile(path: str) -> bool:
    """Whether ``path`` holds a profile (this tool's earlier output, which it replaces)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("format") == PROFILE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def run(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    cfg = model_from_args(args)
    check_files([args.out], overwrite=args.overwrite, flag="--out", is_own=lambda: _is_profile(args.out),
                tool="profile_model.py")
    import torch  # noqa: PLC0415

    from megatron_2bw.planner import profiler  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda but CUDA is not available")
    start = time.perf_counter()
    parts = []
    for t in sorted(set(args.tensor_parallel)):
        kw = dict(dtype=args.precision, warmup=args.warmup, reps=args.reps, optimizer=not args.no_optimizer)
        if t == 1:
            parts.append(profiler.profile_model(cfg, args.micro_batch_sizes, device=args.device,
                                                skip_oom=args.keep_going,
                                                log=lambda s: print(f"t=1 {s}", file=sys.stderr), **kw))
        else:
            dev = torch.device(args.device) if args.device else None
            parts.append(profiler.profile_tensor_parallel(cfg, t, args.micro_batch_sizes,
                                                          device_type=dev.type if dev else None,
                                                          threads=args.threads or 1, skip_oom=args.keep_going, **kw))
    prof = profiler.merge_profiles(parts)
    write_text_atomic(args.out, json.dumps(prof.to_json(), indent=1) + "\n")
    lines = [f"wrote {args.out}: {len(prof.entries)} (t, b) entries in {time.perf_counter() - start:.1f} s; "
             f"{prof.source}"]
    for (t, b), e in sorted(prof.entries.items()):
        lines.append(f"  t={t} b={b}: layer fwd {e.layer.forward_s * 1e3:.3f} ms bwd {e.layer.backward_s * 1e3:.3f} ms "
                     f"(split: I {e.layer.backward_input_s * 1e3:.3f} ms + W {e.layer.backward_weight_s * 1e3:.3f} ms) "
                     f"stash {e.layer.stash_bytes / 2**20:.2f} MiB; head fwd {e.head.forward_s * 1e3:.3f} ms "
                     f"bwd {e.head.backward_s * 1e3:.3f} ms stash {e.head.stash_bytes / 2**20:.2f} MiB")
    if prof.optimizer:
        lines.append(f"  optimizer step: {prof.optimizer.fixed_s * 1e6:.1f} us + "
                     f"{prof.optimizer.per_param_s * 1e9:.3f} ns/param")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
