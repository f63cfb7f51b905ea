"""Convert and reshard checkpoints: Megatron-LM v2.x layouts of any t x d, and Hugging Face models.

    python tools/checkpoint_util.py --load-dir ckpt --save-dir ckpt_t1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
    python tools/checkpoint_util.py --load-dir ckpt --save-dir hf_model --saver hf
    python tools/checkpoint_util.py --loader hf --load-dir hf_model --save-dir ckpt --target-tensor-parallel-size 2
    python tools/checkpoint_util.py --load-dir ckpt --save-dir ckpt_mcore --saver mcore --target-tensor-parallel-size 2

Flags follow Megatron-LM's tools/checkpoint_util.py. The model is read whole (every shard
merged), then split again for the target layout: QKV rows by head, the vocabulary padded to a
multiple of 128 * t, pipeline stages restacked with local layer numbers. ``model`` always holds
the newest weights, so 2BW -> flush keeps the newest version and flush -> 2BW starts both
versions equal (``--target-schedule``). A trainer checkpoint's optimizer state (Adam moments or
SGD momentum, the fp32 master copy) and 2BW's older version are resharded with the weights, so
the trainer resumes from the result at the new layout; ``--no-optimizer`` writes the weights only
(a plain Megatron-LM checkpoint, for --finetune or other tools). ``--saver hf`` always writes the
weights only (the output line says the optimizer state was left out) and, when the checkpoint names
its tokenizer and the files are there, the tokenizer beside them. ``--saver mcore`` (or ``core``) writes
Megatron-Core's torch format (``decoder.layers.N.self_attention.linear_qkv.weight``, ...; norms fused into
the linears for ``--saver-transformer-impl transformer_engine``, Megatron's default, or modules of their
own for ``local``), weights only; ``--loader mcore`` reads it (also found by itself). A model with experts goes to
and from ``--saver hf`` as MixtralForCausalLM or Qwen2MoeForCausalLM and ``--saver mcore`` as Megatron-Core's MoE
layers; a trainer checkpoint keeps them in either format, whole (every expert: any expert-parallel size resumes);
Megatron-LM v2.x's weights-only layout (``--saver megatron --no-optimizer``) has none and refuses it.

Between the trainer's two formats: a ``--ckpt-format torch_dist`` source is read whole (its global
tensors are the t = 1 model's) and written at the target layout in the torch format, or the other
way with ``--ckpt-format torch_dist`` (no target sizes: any layout resumes from it)::

    python tools/checkpoint_util.py --load-dir ckpt_dist --save-dir ckpt_t2 --target-tensor-parallel-size 2
    python tools/checkpoint_util.py --load-dir ckpt --save-dir ckpt_dist --ckpt-format torch_dist
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_2bw.checkpoint.dist_checkpoint import CKPT_FORMATS
from megatron_2bw.checkpoint.trainer_reshard import (
    read_dist_checkpoint,
    read_trainer_checkpoint,
    write_dist_checkpoint,
    write_trainer_checkpoint,
)
from megatron_2bw.cli import OneLineParser, run_cli
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.checkpoints import (
    LOADERS,
    SAVERS,
    dist_exported,
    is_dist_path,
    load_checkpoint,
    save_checkpoint,
)
from megatron_2bw.export.mcore_format import TRANSFORMER_IMPLS
from megatron_2bw.export.outputs import OVERWRITE_HELP, check_dir, staged_dir
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, get_schedule
from megatron_2bw.schedule.stages import check_virtual_split


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load-dir", required=True, help="checkpoint root, iteration dir, or Hugging Face model dir")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--loader", choices=LOADERS[1:],
                   help="source format (default: Hugging Face if config.json is there)")
    p.add_argument("--saver", choices=SAVERS, default="megatron")
    p.add_argument("--saver-transformer-impl", choices=TRANSFORMER_IMPLS, default=TRANSFORMER_IMPLS[0],
                   help="--saver mcore: Megatron-Core's layer names for Transformer Engine layers (norms fused into "
                        "linear_qkv/linear_fc1) or local ones (input_layernorm, pre_mlp_layernorm)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-schedule", choices=SCHEDULE_NAMES, help="pipeline schedule the trainer resumes with")
    p.add_argument("--target-virtual-pipeline-parallel-size", type=int,
                   help="model chunks per pipeline rank of the target (interleaved-1f1b: model0, model1, ... per "
                        "file); default: the source's when the schedule stays, else the target schedule's")
    p.add_argument("--no-optimizer", action="store_true", help="convert the weights only")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch",
                   help="what a trainer checkpoint is written as (the trainer's --ckpt-format; the source's is read "
                        "from its files): torch_dist holds no layout, so the target sizes do not apply")
    return p.parse_args(argv)


def refuse_writing_into_source(load_dir: str, save_dir: str) -> None:
    """Never write into the checkpoint being read: its manifest and pointer would be replaced (also when the
    two paths differ only by symlinks or ``..``, or one lies inside the other)."""
    src, dst = os.path.realpath(load_dir), os.path.realpath(save_dir)
    if src == dst or src.startswith(dst + os.sep) or dst.startswith(src + os.sep):
        raise ConfigError(f"--save-dir {save_dir} is (or overlaps) --load-dir {load_dir}"
                          f"{f' (both {src})' if src == dst else ''}: checkpoint_util never writes into its source; "
                          "give another --save-dir")


def run(argv: list[str]) -> str:
    args = parse_args(argv)
    t, d = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    if t < 1 or d < 1:
        raise ConfigError(f"target sizes must be >= 1, got tensor {t} and pipeline {d}")
    refuse_writing_into_source(args.load_dir, args.save_dir)
    request = {"tool": "checkpoint_util", "load_dir": os.path.realpath(args.load_dir), "saver": args.saver,
               "ckpt_format": args.ckpt_format}
    check_dir(args.save_dir, request, overwrite=args.overwrite, flag="--save-dir")
    final = os.path.abspath(args.save_dir)
    with staged_dir(args.save_dir, request) as tmp:
        line, where = convert(args, tmp)
    return line.replace("{where}", where.replace(tmp, final))


def convert(args: argparse.Namespace, out: str) -> tuple[str, str]:
    """Read ``--load-dir`` and write it under ``out`` (the staging directory): (the summary line with a
    ``{where}`` placeholder, the path it names)."""
    t, d = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    dist_source = is_dist_path(args.load_dir) and args.loader in (None, "megatron")
    if dist_source:
        ckpt = read_dist_checkpoint(args.load_dir)
        ex, has_optimizer = dist_exported(ckpt), True
    else:
        ex, has_optimizer = load_checkpoint(args.load_dir, args.loader or "auto")
    if args.ckpt_format == "torch_dist" and (args.saver != "megatron" or args.no_optimizer or not has_optimizer):
        raise ConfigError("--ckpt-format torch_dist writes a trainer checkpoint with its engine state: it needs a "
                          "trainer checkpoint, --saver megatron and no --no-optimizer")
    dropped = ""
    if has_optimizer and not args.no_optimizer and args.saver != "megatron":
        # a Hugging Face model never holds optimizer state: export the newest weights and say what was left
        dropped = ("; the optimizer state was left out (a Hugging Face model holds none: the source keeps it)"
                   if args.saver == "hf" else "; the optimizer state was left out (--saver mcore writes the weights "
                   "only: the source keeps it)")
    elif has_optimizer and not args.no_optimizer:
        ckpt = ckpt if dist_source else read_trainer_checkpoint(args.load_dir)
        moved = ", ".join(n for n in sorted(ckpt.families) if n != "model")
        schedule = args.target_schedule or ckpt.first["layout"]["schedule"]
        if args.ckpt_format == "torch_dist":
            where = write_dist_checkpoint(out, ckpt, schedule=args.target_schedule)
            return (f"wrote torch_dist trainer checkpoint at iteration {ex.iteration} to {{where}} (any layout) "
                    f"schedule {schedule} with its engine state ({moved})"), where
        where = write_trainer_checkpoint(out, ckpt, t=t, d=d, schedule=args.target_schedule,
                                         chunks=args.target_virtual_pipeline_parallel_size)
        return (f"wrote trainer checkpoint at iteration {ex.iteration} to {{where}} t={t} d={d} schedule "
                f"{schedule} with its engine state ({moved})"), where
    chunks = get_schedule(args.target_schedule or "flush", args.target_virtual_pipeline_parallel_size).chunks \
        if args.target_schedule or args.target_virtual_pipeline_parallel_size else 1
    if chunks > 1:
        check_virtual_split(ex.cfg.num_layers, d, chunks)
    where = save_checkpoint(ex, out, args.saver, t=t, d=d, schedule=args.target_schedule, chunks=chunks,
                            transformer_impl=args.saver_transformer_impl)
    cfg = ex.cfg
    return (f"wrote {cfg.kind} model ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}) "
            f"at iteration {ex.iteration} to {{where}} as {args.saver}"
            + (f" t={t} d={d}" if args.saver != "hf" else "") + dropped), where


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
