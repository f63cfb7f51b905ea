"""The shared main of ``pretrain_gpt.py`` and ``pretrain_bert.py``: parse -> validate -> init -> build -> train.

Everything that can be wrong with the input is checked before ``init_process_group``:
flags and layout (``cli.build_config``, no torch needed), then files and the machine (kernels,
tokenizer, ``--save`` writable, data and vocabulary, the data index's memory, the checkpoint to
resume and whether its data and schedule settings still hold: ``startup_checks``). ``--validate-only``
stops there with one ``config OK: ...`` line, so launch scripts validate once before torchrun.
A mistake prints one line, ``error: ...``, and exits with status 2 before any collective exists
(``cli.run_cli``), so no peer is left waiting. Failures after start-up (a dead peer, a bug)
print one line per rank and exit 1 without waiting on teardown (``session.run``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ..checkpoint import save_guard
from ..checkpoint.checkpoint_args import apply_checkpoint_args
from ..checkpoint.manifest import clean_stale_temporaries
from ..cli import build_config, env_world, parse_args, run_cli, schedule_note
from ..config import RunConfig
from ..errors import ConfigError
from . import signals, supervision
from .auto_layout import plan_layout
from .launcher_errors import report_under_torchrun, torchrun_parent
from .startup_checks import (
    check_index_memory,
    check_load_path,
    check_output_paths,
    check_resume,
    check_save_dir,
    logged_changes,
)
from .tb_writer import require_tensorboard
from .wandb_writer import require_wandb, wandb_settings

if TYPE_CHECKING:  # types only: this module stays light until a rank starts
    from ..data import BertDataset, BlendedDataset, GPTDataset
    from ..data.tokenizers import Tokenizer
    from ..fused import Kernels

    Dataset = Union[GPTDataset, BertDataset, BlendedDataset]

log = logging.getLogger("megatron_2bw")
QUIET_ENV = "MEGATRON_2BW_VALIDATE_QUIET"  # set by scripts/run_local.sh for its validation pass


@dataclass
class Prepared:
    """A validated run: configs (vocabulary from the tokenizer), kernels, datasets, the checkpoint to resume."""

    cfg: RunConfig
    rank: int
    kernels: Kernels
    tokenizer: Tokenizer | None
    train_ds: Dataset | None  # a GPT, BERT or blended dataset (data/build.py); None where a split is empty
    valid_ds: Dataset | None
    test_ds: Dataset | None
    checkpoint: dict | None = None
    resumed_from: int | None = None
    start_step: int = 0
    start_sample: int = 0
    exit_handler: signals.ExitSignalHandler | None = None  # records exit signals for the loop's boundaries
    exit_duration: signals.ExitDuration | None = None  # --exit-duration-in-mins, started at launch
    loaded_iteration: int | None = None  # the iteration this rank read from --load (ranks must agree)
    save_lock: save_guard.SaveLock | None = None  # rank 0: this job's lock on --save
    fingerprints: dict | None = None  # the data's and the tokenizer's (data/fingerprint.py), saved in checkpoints


def dataset_sizes(cfg: RunConfig, start_step: int, start_sample: int) -> tuple[int, int, int]:
    """Samples needed per split: the remaining training batches, one valid slot per evaluation, one test pass."""
    tc = cfg.training
    B = tc.global_batch_size
    train = start_sample + max(tc.train_iters - start_step, 0) * B
    valid = (tc.train_iters // tc.eval_interval + 1) * tc.eval_iters * B
    test = tc.eval_iters * B
    return train, valid, test


def prepare(cfg: RunConfig, rank: int, tokenizer: object | None = None, *, validate_only: bool = False) -> Prepared:
    """File checks, before any process group: kernels, tokenizer (unless given), checkpoint, datasets.

    Rank 0 takes the lock on ``--save`` (``--validate-only``: checks it) and releases it if a check fails.
    """
    holder: list[Prepared] = []
    try:
        return _prepare(cfg, rank, tokenizer, validate_only, holder)
    except BaseException:
        if holder and holder[0].save_lock is not None:
            holder[0].save_lock.release()
        raise


def _prepare(cfg: RunConfig, rank: int, tokenizer: object | None, validate_only: bool,
             holder: list[Prepared]) -> Prepared:
    # torch is imported only where needed (checkpoint, kernels), so most bad input fails fast.
    from ..data import build_datasets, build_tokenizer

    dc = cfg.data
    if tokenizer is None:
        tokenizer = build_tokenizer(dc.tokenizer_type, dc.tokenizer_model, dc.vocab_file, dc.merge_file, dc.vocab_size)
    cfg = cfg.with_vocab(tokenizer.vocab_size)
    cfg.model.check_tensor_parallel(cfg.parallel.tensor)
    prep = Prepared(cfg, rank, None, tokenizer, None, None, None, fingerprints=_fingerprints(dc, tokenizer))
    holder.append(prep)
    tc = cfg.training
    check_output_paths(tc)
    if tc.save:
        check_save_dir(tc.save)
        if rank == 0:
            if validate_only:
                save_guard.check_lock(tc.save)
            else:
                prep.save_lock = save_guard.acquire(tc.save)
            for path in clean_stale_temporaries(tc.save):
                log.info(" removed stale temporary %s (left by a save that was killed)", path)
            from ..checkpoint.dist_checkpoint import clean_stale_temporaries as clean_stale_folders

            for path in clean_stale_folders(tc.save):
                log.info(" removed stale temporary folder %s (left by a torch_dist save that was killed)", path)
    if tc.load:
        check_load_path(tc.load)
        _find_resume(prep)
    if tc.save and not tc.skip_train:
        resumes = prep.resumed_from is not None and save_guard.same_dir(tc.save, tc.load)
        _note_overwrite_ignored(prep, resumes)
        if save_guard.check_fresh_start(tc.save, tc.load, resumes, tc.overwrite_save) and rank == 0 \
                and not validate_only:
            save_guard.clear_checkpoints(tc.save)

    sizes = dataset_sizes(cfg, prep.start_step, prep.start_sample)
    check_index_memory(cfg, sizes)
    extra = {"masked_lm_prob": dc.mask_prob, "short_seq_prob": dc.short_seq_prob} if cfg.kind == "bert" else {}
    extra.update(mock_data=dc.mock_data, cache_dir=dc.data_cache_path, split_paths=dc.split_paths)
    _check_eod(cfg, tokenizer)
    prep.train_ds, prep.valid_ds, prep.test_ds = build_datasets(
        cfg.kind, list(dc.data_path), dc.split, cfg.model.seq_length, sizes, tc.seed, tokenizer, **extra)
    if prep.train_ds is None and tc.train_iters > prep.start_step:
        raise ConfigError(f"--split {dc.split!r} leaves no training documents")
    if tc.eval_iters > 0 and prep.valid_ds is None:
        log.info(" --split %r leaves no validation documents: no evaluation", dc.split)
    distinct = getattr(prep.valid_ds, "block", None)  # GPT: the validation split's windows (one epoch)
    if rank == 0 and distinct and tc.eval_iters > 0 and tc.eval_iters * tc.global_batch_size > distinct:
        log.warning(" --eval-iters %d x --global-batch-size %d = %d samples per evaluation, more than the %d distinct "
                    "windows of the validation split: each evaluation repeats validation samples", tc.eval_iters,
                    tc.global_batch_size, tc.eval_iters * tc.global_batch_size, distinct)
    from ..fused import select_kernels

    prep.kernels = select_kernels(cfg.system.fused_kernels, cfg.system.device, cfg.system.attention_backend)
    if rank == 0:
        log.info(attention_line(cfg))
    return prep


def attention_line(cfg: RunConfig) -> str:
    """What ``--attention-backend`` runs in this run, said at start-up (the kernel the planner prices, N8)."""
    from ..config.attention_choice import grouped, startup_line, takes_mask

    m = cfg.model
    return startup_line(cfg.system.attention_backend, cfg.system.device, grouped(m),
                        takes_mask(m, cfg.data.reset_attention_mask), m.attention_dropout > 0, cfg.parallel.context,
                        cfg.parallel.cp_comm_type)


def _note_overwrite_ignored(prep: Prepared, resumes: bool) -> None:
    """--overwrite-save with --load equal to --save resumes that run: say so, it is not an error."""
    tc = prep.cfg.training
    if resumes and tc.overwrite_save and prep.rank == 0:
        log.warning(" --overwrite-save ignored: --load is --save, so this run resumes %s at iteration %d and "
                    "keeps its checkpoints", tc.load, prep.resumed_from)


def _fingerprints(dc, tokenizer) -> dict | None:
    """Refuse data made with another tokenizer (its sidecar); the fingerprints a checkpoint records."""
    from ..data import fingerprint
    from ..data.blend import parse_data_path

    try:
        tok = fingerprint.tokenizer_fingerprint(tokenizer)
    except (NotImplementedError, AttributeError):
        return None
    # no files (--mock-data): nothing to fingerprint; per-split paths: each split's prefixes in turn
    prefixes = [p for paths in (dc.split_paths or (dc.data_path,)) if paths for p in parse_data_path(paths)[0]]
    fingerprint.check_data_tokenizer(prefixes, tok)
    try:
        data = [fingerprint.data_fingerprint(p) for p in prefixes]
    except OSError:
        return None  # a missing file: build_datasets names it
    fingerprint.check_data_unchanged(data)
    return {"tokenizer": tok, "data": data}


def _check_fingerprints(prep: Prepared, sd: dict, where: str) -> None:
    """A resume on data or a tokenizer replaced at the same paths is refused unless --override-resumed-settings."""
    from ..data.fingerprint import changed_fingerprints

    if prep.fingerprints is None:
        return
    changes = changed_fingerprints(sd.get("fingerprints"), prep.fingerprints)
    if not changes:
        return
    if not prep.cfg.training.override_resumed_settings:
        raise ConfigError(f"resuming {where}: {'; '.join(changes)}: give the data and tokenizer of the checkpoint, "
                          "or --override-resumed-settings to resume anyway")
    if prep.rank == 0:
        log.warning(" --override-resumed-settings: resuming with %s", "; ".join(changes))


def _check_eod(cfg: RunConfig, tokenizer) -> None:
    """--eod-mask-loss and the --reset-* flags key on the tokenizer's end-of-document id."""
    dc = cfg.data
    used = [f for f, on in (("--eod-mask-loss", dc.eod_mask_loss), ("--reset-position-ids", dc.reset_position_ids),
                            ("--reset-attention-mask", dc.reset_attention_mask)) if on]
    if used and getattr(tokenizer, "eod", None) is None:
        raise ConfigError(f"{used[0]} needs an end-of-document token, but the {cfg.data.tokenizer_type} tokenizer "
                          "has none")


def _find_resume(prep: Prepared) -> None:
    """Read this rank's file of the checkpoint ``--load`` names (if any) and check it fits this run."""
    from ..checkpoint import checkpointing, formats

    cfg, tc = prep.cfg, prep.cfg.training
    it = checkpointing.find_checkpoint(tc.load, tc.save) if tc.ckpt_step is None else _ckpt_step(tc.load, tc.ckpt_step)
    if it is None:
        log.info(" no checkpoint in %s yet: starting from scratch", tc.load)
        return
    prep.loaded_iteration = it
    w = cfg.parallel.data
    fmt = formats.detect(tc.load, it)  # torch_dist: any layout; torch: this one
    sd = fmt.read_before_init(tc.load, it, prep.rank, cfg)
    fmt.check_compatible(sd, cfg, weights_only=tc.finetune or tc.no_load_optim)
    if tc.finetune:  # the weights only: a new run from iteration 0 on this run's data and settings
        _check_finetune_tokenizer(prep, sd, f"{tc.load} at iteration {it}")
        log.info(" --finetune: starting from the weights of %s at iteration %d", tc.load, it)
        prep.checkpoint = sd
        return
    start_step = checkpointing.saved_step(sd)  # a weights-only file is refused here (it needs --finetune)
    changes = check_resume(sd.get("args") or {}, cfg, f"{tc.load} at iteration {it}")
    applied = logged_changes(sd.get("args") or {}, cfg)
    if applied and prep.rank == 0:
        log.warning(" resuming %s at iteration %d with %s: applied from the first resumed step", tc.load, it,
                    "; ".join(applied))
    saved_args = sd.get("args") or {}
    saved_args = vars(saved_args) if isinstance(saved_args, argparse.Namespace) else saved_args
    old_eval = saved_args.get("eval_interval") if isinstance(saved_args, dict) else None
    if prep.rank == 0 and old_eval is not None and old_eval != tc.eval_interval:
        log.warning(" --eval-interval %s -> %s on resume: the evaluations use other validation samples than the first "
                    "run's, so the validation losses of the two parts are not comparable", old_eval, tc.eval_interval)
    _check_fingerprints(prep, sd, f"{tc.load} at iteration {it}")
    if changes and prep.rank == 0:
        log.warning(" --override-resumed-settings: resuming with changed settings: %s", "; ".join(changes))
    prep.checkpoint, prep.resumed_from = sd, it
    prep.start_step = start_step
    prep.start_sample = int(sd["data"]["consumed_train_samples"])
    if sd["layout"]["w"] != w:
        log.info(" checkpoint was written with data-parallel size %d; this run uses %d (replicas are identical)",
                 sd["layout"]["w"], w)


def _ckpt_step(load: str, step: int) -> int:
    """``--ckpt-step``: that iteration of ``--load``, which must hold a complete checkpoint of it."""
    from ..checkpoint import manifest

    held = manifest.list_checkpoints(load) if os.path.isdir(load) else []
    if step not in held:
        shown = ", ".join(map(str, held[-5:])) or "none"
        raise ConfigError(f"--ckpt-step {step}: --load {load} holds no checkpoint of iteration {step} (it holds "
                          f"{shown})")
    return step


def _check_finetune_tokenizer(prep: Prepared, sd: dict, where: str) -> None:
    """--finetune from a checkpoint trained with another tokenizer: its embedding rows mean other pieces, so it
    is refused in one line, or (--finetune-ignore-tokenizer) loaded with a warning naming both tokenizers."""
    from ..data.fingerprint import changed_fingerprints, recorded_tokenizer

    # torch files record "fingerprints", torch_dist's arguments the tokenizer's
    saved = recorded_tokenizer(sd.get("args"), sd.get("fingerprints")).get("fingerprint")
    if prep.fingerprints is None or saved is None:
        return
    changes = changed_fingerprints({"tokenizer": saved}, {**prep.fingerprints, "data": []})
    if not changes:
        return
    if not prep.cfg.training.finetune_ignore_tokenizer:
        raise ConfigError(f"--finetune from {where}: {changes[0]} (the checkpoint's embedding rows mean other "
                          "pieces): give the checkpoint's tokenizer, or --finetune-ignore-tokenizer to fine-tune "
                          "anyway")
    if prep.rank == 0:
        log.warning(" --finetune-ignore-tokenizer: fine-tuning %s, trained with another tokenizer: %s", where,
                    changes[0])


def configure(kind: str, argv: list[str]) -> tuple[Prepared, argparse.Namespace]:
    """Parse, plan (``--auto-plan``), validate and check the files of ``pretrain_{kind}.py``'s run."""
    from .metrics import setup_logging

    rank, world = env_world()
    setup_logging(rank)
    args = parse_args(argv, kind)
    with startup_warnings(rank, bool(args.validate_only)):
        return _configure(kind, args, rank, world)


@contextlib.contextmanager
def startup_warnings(rank: int, validate_only: bool):
    """Start-up warnings once, not once per rank (and the validation pass): every rank runs the same checks,
    so only rank 0 prints their warnings; ``scripts/run_local.sh``'s validation pass (QUIET_ENV) leaves them
    to the run's rank 0. Errors always print."""
    root = logging.getLogger()
    quiet = rank != 0 or (validate_only and os.environ.get(QUIET_ENV) == "1")
    level = root.level
    if quiet:
        root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _configure(kind: str, args: argparse.Namespace, rank: int, world: int) -> tuple[Prepared, argparse.Namespace]:
    taken = apply_checkpoint_args(args)
    if taken and rank == 0:
        log.info(" %s", taken)
    layout, tokenizer = plan_layout(args, kind, world) if args.auto_plan else (None, None)
    cfg = build_config(args, kind, world, layout=layout)
    check_writers(cfg)
    note = schedule_note(args)
    if note:
        log.info(" %s", note)
    return prepare(cfg, rank, tokenizer, validate_only=bool(args.validate_only)), args


def check_writers(cfg: RunConfig) -> None:
    """wandb and TensorBoard flags and packages, before any process group (one line when missing)."""
    tc = cfg.training
    if wandb_settings(tc.wandb_project, tc.wandb_exp_name, tc.wandb_save_dir, tc.save) is not None:
        require_wandb()
    if tc.tensorboard_dir:
        require_tensorboard()


def early_exit_handling() -> signals.ExitSignalHandler:
    """Record a stop signal that arrives during start-up (before the flags are read): under a launcher a
    worker killed there would be restarted by torchrun, so the stop would be lost."""
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
    return signals.ExitSignalHandler(sigs, handle_sigint=under_launcher(), rank=int(os.environ.get("RANK", "0")),
                                     announce=lambda line: None).install()


def install_exit_handling(prep: Prepared, early: signals.ExitSignalHandler | None = None) -> None:
    """Record SIGTERM, SIGHUP (a closed terminal or ssh session) and --exit-signal (unless
    --no-exit-signal-handler) and SIGINT for the loop's next boundary.

    SIGINT is always handled: the first Ctrl-C saves at the next boundary (with --save) and exits
    without a traceback; a second one exits at once (status 130).
    """
    tc = prep.cfg.training
    sigs = (signal.SIGTERM, signal.SIGHUP, signals.parse_signal(tc.exit_signal)) if tc.exit_signal_handler else ()
    got = None
    if early is not None:
        early.restore()
        got = early.received
    prep.exit_handler = signals.ExitSignalHandler(sigs, rank=prep.rank).install()
    if got is not None:  # a stop during start-up: exit at the first boundary (as its handler would have)
        if got not in {s.name for s in prep.exit_handler.signals}:
            signal.raise_signal(signal.Signals[got])  # its default action, as without the handler
        prep.exit_handler._handle(signal.Signals[got], None)
    prep.exit_duration = signals.ExitDuration(tc.exit_duration_in_mins)


def under_launcher() -> bool:
    """Whether a launcher (torchrun) started this process: then it must die with that launcher."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def summary(prep: Prepared) -> str:
    """The one line ``--validate-only`` prints: what the run would do."""
    from .report import model_name
    cfg, tc, pc = prep.cfg, prep.cfg.training, prep.cfg.pipeline
    par = cfg.parallel
    resume = "starting from scratch" if prep.resumed_from is None else f"resuming from iteration {prep.resumed_from}"
    train = len(prep.train_ds) if prep.train_ds is not None else 0
    return (
        f"config OK: {model_name(cfg.model)} {cfg.model.num_parameters() / 1e6:.2f}M parameters | "
        f"layout {par.describe()}, "
        f"{cfg.system.backend} on {cfg.system.device}) | "
        f"schedule {pc.schedule}, b={pc.micro_batch_size} m={pc.num_microbatches} B={tc.global_batch_size} | "
        f"{tc.train_iters} iterations, {train} training samples | precision {cfg.optimizer.dtype} | {resume}"
    )


def main(kind: str, argv: list[str] | None = None) -> int:
    """Run ``pretrain_{kind}.py``; returns the exit status (2: bad input, before any collective).

    ``--validate-only`` stops after every start-up check with one ``config OK: ...`` line (status 0).
    """

    def train(argv: list[str]) -> int | str:
        agent = torchrun_parent() if under_launcher() else None
        if under_launcher():
            supervision.install_parent_death_signal()
        early = early_exit_handling()
        try:
            prep, args = configure(kind, argv)
        except ConfigError as e:
            if report_under_torchrun(str(e), agent):  # one line, no torchrun traceback
                return 2
            raise
        if args.validate_only:
            early.restore()
            return summary(prep)
        install_exit_handling(prep, early)
        from .session import run

        try:
            return run(prep)
        finally:
            if prep.save_lock is not None:
                prep.save_lock.release()

    try:
        return run_cli(train, argv)
    except KeyboardInterrupt:  # Ctrl-C before the exit handler is installed (start-up): no traceback
        print("interrupted during start-up: nothing to save", file=sys.stderr, flush=True)
        return signals.EXIT_INTERRUPTED
