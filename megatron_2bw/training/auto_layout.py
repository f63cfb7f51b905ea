"""``--auto-plan``: let the planner choose t, d, the microbatch size, recomputation and schedule.

It runs before validation and before any process group, like every other input check, so every
rank must reach the same choice on its own. One process profiles its device (or loads
``--auto-plan-profile``); a multi-process job plans from a profile file made beforehand (by a
single-process ``--auto-plan`` run or ``tools/profile_model.py``): ranks that profiled apart could
pick different layouts and hang each other.
"""

from __future__ import annotations

import argparse
import logging
import os

from ..arguments import model_config
from ..errors import ConfigError

log = logging.getLogger("megatron_2bw")


def _vocab_size(args: argparse.Namespace, preset_vocab: int) -> int:
    if not args.tokenizer_type:
        return preset_vocab
    from ..data.tokenizers import build_tokenizer  # noqa: PLC0415

    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file).vocab_size


def apply_auto_plan(args: argparse.Namespace, kind: str, world: int) -> argparse.Namespace:
    """Fill the layout flags from the planner's best configuration for ``world`` processes."""
    if not args.auto_plan:
        return args
    if args.global_batch_size is None:
        raise ConfigError("--auto-plan needs --global-batch-size (the planner sets the microbatch size)")
    path = args.auto_plan_profile
    if world > 1 and not (path and os.path.isfile(path)):
        raise ConfigError(
            f"--auto-plan with {world} processes needs --auto-plan-profile FILE made beforehand "
            "(a single-process --auto-plan run or tools/profile_model.py writes it): ranks must not profile apart"
        )
    from dataclasses import replace  # noqa: PLC0415

    from ..planner.auto_plan import auto_plan  # noqa: PLC0415 - imports torch and the models

    model = model_config(args, kind)
    model = replace(model, vocab_size=_vocab_size(args, model.vocab_size))
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    device = None if args.device in (None, "auto") else args.device
    choice = auto_plan(model, world, args.global_batch_size, cluster=args.cluster, profile_path=path,
                       device=device, precision=precision)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = choice.t, choice.d
    args.micro_batch_size, args.recompute_activations = choice.b, choice.recompute
    args.pipeline_schedule, args.pipeline_no_flushes, args.gpipe = choice.schedule, False, False
    log.info(" --auto-plan chose t=%d d=%d w=%d micro-batch %d%s, schedule %s", choice.t, choice.d, choice.w,
             choice.b, " +recompute" if choice.recompute else "", choice.schedule)
    return args
