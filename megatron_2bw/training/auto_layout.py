"""``--auto-plan``: let the planner choose t, d, c (context parallelism), the microbatch size, recomputation,
schedule and stage split.

It runs before validation and before any process group, like every other input check, so every
rank must reach the same choice on its own. One process profiles its device (or loads
``--auto-plan-profile``); a multi-process job plans from a profile file made beforehand (by a
single-process ``--auto-plan`` run or ``tools/profile_model.py``): ranks that profiled apart could
pick different layouts and hang each other. The choice is a :class:`~megatron_2bw.config.Layout`
that ``cli.build_config`` uses in place of the layout flags.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace

from ..cli import data_config, lr_config, model_config, optimizer_config, precision_of, training_config
from ..config import Layout
from ..errors import ConfigError
from ..schedule.stages import format_split, split_flags_given

log = logging.getLogger("megatron_2bw")


def _tokenizer(args: argparse.Namespace) -> object | None:
    """The run's tokenizer (its vocabulary sizes the model), or None without ``--tokenizer-type``."""
    if not args.tokenizer_type:
        return None
    from ..data.tokenizers import build_tokenizer  # noqa: PLC0415

    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                           getattr(args, "vocab_size", None))


def plan_layout(args: argparse.Namespace, kind: str, world: int) -> tuple[Layout, object | None]:
    """The planner's best layout for ``world`` processes, and the tokenizer built to size the model."""
    if args.global_batch_size is None:
        raise ConfigError("--auto-plan needs --global-batch-size (the planner sets the microbatch size)")
    given = split_flags_given(args)
    if given:
        raise ConfigError(f"--auto-plan chooses the stage split itself; drop {' '.join(given)}")
    # Every check that needs no layout before the planner, which may profile for a while.
    optimizer_config(args), training_config(args, args.global_batch_size), lr_config(args), data_config(args)
    path = args.auto_plan_profile
    if world > 1 and not (path and os.path.isfile(path)):
        raise ConfigError(
            f"--auto-plan with {world} processes needs --auto-plan-profile FILE made beforehand "
            "(a single-process --auto-plan run or tools/profile_model.py writes it): ranks must not profile apart"
        )
    from ..planner.auto_plan import auto_plan  # noqa: PLC0415 - imports torch and the models

    model = model_config(args, kind)
    tokenizer = _tokenizer(args)
    if tokenizer is not None:
        model = replace(model, vocab_size=tokenizer.vocab_size)
    device = None if args.device in (None, "auto") else args.device
    opt = optimizer_config(args)
    # --use-distributed-optimizer given: the planner keeps it; otherwise it may choose it
    sharding = (True,) if opt.use_distributed_optimizer else (False, True)
    # --recompute-granularity given: it applies to whatever layout is chosen, so the planner searches neither
    # whole-stage recomputation (the two exclude each other) nor other policies (its memory is over-counted)
    user_policy = getattr(args, "recompute_granularity", None) is not None
    finer = {"recompute_options": (False,), "recompute_policies": ()} if user_policy else {}
    choice = auto_plan(model, world, args.global_batch_size, cluster=args.cluster, profile_path=path,
                       device=device, precision=precision_of(args), fp32_grads=opt.fp32_grads,
                       distributed_optimizer_options=sharding,
                       compensation=getattr(args, "2bw_compensation", None) or "none", optimizer=opt.optimizer,
                       attention_backend=args.attention_backend,
                       reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)), **finer)
    inner = f" +recompute {choice.recompute_policy.label}" if choice.recompute_policy else ""
    cp = f" c={choice.context} ({choice.cp_comm_type})" if choice.context > 1 else ""  # Layout carries both
    log.info(" --auto-plan chose t=%d%s d=%d w=%d micro-batch %d%s, schedule %s, layers per stage %s%s", choice.t, cp,
             choice.d, choice.w, choice.b, " +recompute" if choice.recompute else inner, choice.schedule,
             format_split(choice.split) if choice.split else "even",
             ", distributed optimizer" if choice.distributed_optimizer else "")
    return choice.layout, tokenizer
