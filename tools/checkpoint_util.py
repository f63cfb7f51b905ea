"""Convert and reshard checkpoints: Megatron-LM v2.x layouts of any t x d, and Hugging Face models.

    python tools/checkpoint_util.py --load-dir ckpt --save-dir ckpt_t1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
    python tools/checkpoint_util.py --load-dir ckpt --save-dir hf_model --saver hf
    python tools/checkpoint_util.py --loader hf --load-dir hf_model --save-dir ckpt --target-tensor-parallel-size 2

Flags follow Megatron-LM's tools/checkpoint_util.py. The model is read whole (every shard
merged), then split again for the target layout: QKV rows by head, the vocabulary padded to a
multiple of 128 * t, pipeline stages restacked with local layer numbers. ``model`` always holds
the newest weights, so 2BW -> flush keeps the newest version and flush -> 2BW starts both
versions equal (``--target-schedule``). A trainer checkpoint's optimizer state (Adam moments or
SGD momentum, the fp32 master copy) and 2BW's older version are resharded with the weights, so
the trainer resumes from the result at the new layout; ``--no-optimizer`` writes the weights only
(a plain Megatron-LM checkpoint, for --finetune or other tools). ``--saver hf`` always writes the
weights only (the output line says the optimizer state was left out) and, when the checkpoint names
its tokenizer and the files are there, the tokenizer beside them.
"""

from __future__ import annotations

import argparse
import sys

from megatron_2bw.cli import OneLineParser, run_cli
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.checkpoints import LOADERS, SAVERS, load_checkpoint, save_checkpoint
from megatron_2bw.export.trainer_reshard import read_trainer_checkpoint, write_trainer_checkpoint
from megatron_2bw.pipeline.schedules import SCHEDULE_NAMES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load-dir", required=True, help="checkpoint root, iteration dir, or Hugging Face model dir")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--loader", choices=LOADERS[1:], help="source format (default: Hugging Face if config.json is there)")
    p.add_argument("--saver", choices=SAVERS, default="megatron")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-schedule", choices=SCHEDULE_NAMES, help="pipeline schedule the trainer resumes with")
    p.add_argument("--no-optimizer", action="store_true", help="convert the weights only")
    return p.parse_args(argv)


def run(argv: list[str]) -> str:
    args = parse_args(argv)
    t, d = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    if t < 1 or d < 1:
        raise ConfigError(f"target sizes must be >= 1, got tensor {t} and pipeline {d}")
    ex, has_optimizer = load_checkpoint(args.load_dir, args.loader or "auto")
    dropped = ""
    if has_optimizer and not args.no_optimizer and args.saver != "megatron":
        # a Hugging Face model never holds optimizer state: export the newest weights and say what was left
        dropped = "; the optimizer state was left out (a Hugging Face model holds none: the source keeps it)"
    elif has_optimizer and not args.no_optimizer:
        ckpt = read_trainer_checkpoint(args.load_dir)
        where = write_trainer_checkpoint(args.save_dir, ckpt, t=t, d=d, schedule=args.target_schedule)
        moved = ", ".join(n for n in sorted(ckpt.families) if n != "model")
        return (f"wrote trainer checkpoint at iteration {ex.iteration} to {where} t={t} d={d} schedule "
                f"{args.target_schedule or ckpt.first['layout']['schedule']} with its engine state ({moved})")
    where = save_checkpoint(ex, args.save_dir, args.saver, t=t, d=d, schedule=args.target_schedule)
    cfg = ex.cfg
    return (f"wrote {cfg.kind} model ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}) "
            f"at iteration {ex.iteration} to {where} as {args.saver}"
            + (f" t={t} d={d}" if args.saver == "megatron" else "") + dropped)


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
