"""Start-up checks that need the file system or the machine, run on every rank before any process group.

Each refuses with one ``ConfigError`` line, so a job that would fail at its first save, run out of
memory building its data index, or silently train on another data order after a resume stops
before it starts: ``--save`` must be a writable directory, ``--load`` a directory, the data
index must fit in memory, and a resumed run must keep the data and schedule settings of the
checkpoint unless ``--override-resumed-settings``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..argv import megatron_args
from ..config import RunConfig
from ..errors import ConfigError
from . import supervision
from .supervision import check_save_dir  # noqa: F401 - one implementation, re-exported for the launcher

log = logging.getLogger("megatron_2bw")

# Peak bytes of index arrays per sample while a dataset is built (numpy, measured with tracemalloc
# on the demo corpus): GPT's window starts, offsets and shuffle; BERT's block order; a blend's
# dataset/sample indices on top of its components'.
INDEX_BYTES_PER_SAMPLE = {"gpt": 40, "bert": 17}
BLEND_BYTES_PER_SAMPLE = 56
# The index may take at most this share of the machine's memory (the model and activations need the rest).
INDEX_MEMORY_SHARE = 0.5

# Flags (checkpoint ``args`` keys) that fix the data order, the batches or the schedule of a run.
RESUME_SETTINGS = (
    "data_path", "split", "seq_length", "seed", "global_batch_size", "micro_batch_size", "pipeline_schedule",
    "train_iters", "lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "tokenizer_type",
    "tokenizer_model", "vocab_file", "merge_file", "mask_prob", "short_seq_prob", "2bw_compensation", "2bw_dc_lambda",
    "2bw_ef_scale",
)
# Megatron's data and schedule flags of issue 19: they change the batches or the rates like the above.
# (not vocab_size: Megatron's args name the model's vocabulary so; the model shape check compares it)
RESUME_SETTINGS += ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "mock_data",
                    "lr_wsd_decay_style", "lr_wsd_decay_iters")
# Megatron's per-split data paths (issue 45)
RESUME_SETTINGS += ("train_data_path", "valid_data_path", "test_data_path")
_PATH_SETTINGS = ("data_path", "tokenizer_model", "vocab_file", "merge_file", "train_data_path", "valid_data_path",
                  "test_data_path")
# Settings a resume takes from this run with one log line (R13): they change the updates from here on, not
# the data order or the batches (Megatron applies them silently).
LOGGED_SETTINGS = ("weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum",
                   "hidden_dropout", "attention_dropout", "muon_momentum", "muon_lr", "muon_ns_steps")


# --------------------------------------------------------------------------- directories
def _file_above(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` (or ``path``) when it is not a directory."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return None if os.path.isdir(p) else p


def check_load_path(load: str) -> None:
    """``--load`` names a checkpoint directory, not a file (a missing one is a first run: ``--load`` = ``--save``)."""
    if os.path.exists(load) or _file_above(load) is not None:
        supervision.check_load_path(load)


def check_output_paths(tc) -> None:
    """--metrics-file, --tensorboard-dir and --wandb-save-dir can be written where they point (S06, S17): a
    mistake is one line at start-up and under --validate-only, not a traceback after the model is built."""
    if tc.metrics_file:
        if os.path.isdir(tc.metrics_file):
            raise ConfigError(f"--metrics-file {tc.metrics_file} is a directory: give a file path")
        above = _file_above(os.path.dirname(os.path.abspath(tc.metrics_file)))
        if above is not None:
            raise ConfigError(f"--metrics-file {tc.metrics_file}: {above} is a file, not a directory")
    for flag, path in (("--tensorboard-dir", tc.tensorboard_dir), ("--wandb-save-dir", tc.wandb_save_dir)):
        above = _file_above(path) if path else None
        if above is not None:
            where = "is a file" if os.path.abspath(above) == os.path.abspath(path) else f"is under the file {above}"
            raise ConfigError(f"{flag} {path} {where}: give a directory path")


# --------------------------------------------------------------------------- data index memory
def physical_memory() -> int | None:
    """Bytes of physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def index_bytes(cfg: RunConfig, sizes: tuple[int, int, int]) -> int:
    """Estimated peak bytes of the train/valid/test sample indices of ``sizes`` samples."""
    per = INDEX_BYTES_PER_SAMPLE[cfg.kind]
    if len(cfg.data.data_path) > 1:  # a blend: W1 PREFIX1 W2 PREFIX2 ...
        per += BLEND_BYTES_PER_SAMPLE
    return sum(sizes) * per


def check_index_memory(cfg: RunConfig, sizes: tuple[int, int, int], memory: int | None = None) -> None:
    """Refuse a run whose sample index would not fit in memory, before it is built."""
    memory = physical_memory() if memory is None else memory
    need = index_bytes(cfg, sizes)
    if memory is None or need <= INDEX_MEMORY_SHARE * memory:
        return
    tc = cfg.training
    raise ConfigError(
        f"--train-iters {tc.train_iters} x --global-batch-size {tc.global_batch_size} asks for {sum(sizes):,} samples "
        f"(train {sizes[0]:,}, valid {sizes[1]:,}, test {sizes[2]:,}): indexing them needs about "
        f"{need / 2**30:.1f} GiB, more than {INDEX_MEMORY_SHARE:.0%} of this machine's {memory / 2**30:.1f} GiB; "
        "lower --train-iters (or --eval-iters, or raise --eval-interval)"
    )


# --------------------------------------------------------------------------- resume
def _same(name: str, old: Any, new: Any) -> bool:
    if old == new:
        return True
    if name in _PATH_SETTINGS and old is not None and new is not None:
        olds, news = (old, new) if name.endswith("data_path") else ([old], [new])
        return len(olds) == len(news) and all(os.path.realpath(str(a)) == os.path.realpath(str(b))
                                              for a, b in zip(olds, news))
    return False


def _text(v: Any) -> str:
    return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def changed_settings(saved_args: Mapping[str, Any] | argparse.Namespace, cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(flag, checkpoint's value, this run's value) of each data or schedule setting that differs.

    A setting the checkpoint does not record (an older file) is not compared.
    """
    saved = vars(saved_args) if isinstance(saved_args, argparse.Namespace) else saved_args
    if not isinstance(saved, Mapping):
        return []
    now = megatron_args(cfg)
    return [("--" + n.replace("_", "-"), saved[n], now[n]) for n in RESUME_SETTINGS
            if n in saved and n in now and not _same(n, saved[n], now[n])]


def logged_changes(saved_args: Mapping[str, Any] | argparse.Namespace, cfg: RunConfig) -> list[str]:
    """``"--flag old -> new"`` of each optimizer or dropout setting this resume changes (they apply from the
    first resumed step on; the caller logs them in one line)."""
    saved = vars(saved_args) if isinstance(saved_args, argparse.Namespace) else saved_args
    if not isinstance(saved, Mapping):
        return []
    now = megatron_args(cfg)
    return [f"--{n.replace('_', '-')} {_text(saved[n])} -> {_text(now[n])}" for n in LOGGED_SETTINGS
            if n in saved and n in now and saved[n] is not None and saved[n] != now[n]]


def _warmup_follows(sw: int, sd: int, nw: int, nd: int) -> bool:
    """Whether one --lr-warmup-fraction f gives both warm-ups: int(f * sd) == sw and int(f * nd) == nw."""
    if sd <= 0 or nd <= 0:
        return sw == nw
    return max(sw / sd, nw / nd) < min((sw + 1) / sd, (nw + 1) / nd)


def extension(changed: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """The changes that only extend the run, as Megatron allows: ``--train-iters`` raised, and the
    schedule lengths that follow from it (``--lr-decay-iters`` left at its default ``--train-iters``,
    ``--lr-warmup-iters`` from the same ``--lr-warmup-fraction``). The data order of the samples already
    trained on does not depend on ``--train-iters`` (``GPTDataset``'s blocks), so nothing is reshuffled."""
    by = {flag: (old, new) for flag, old, new in changed}
    if "--train-iters" not in by:
        return []
    (st, nt) = by["--train-iters"]
    if not (isinstance(st, int) and isinstance(nt, int) and nt > st):
        return []
    ok = {"--train-iters"}
    decay = by.get("--lr-decay-iters")
    if decay is not None and decay == (st, nt):
        ok.add("--lr-decay-iters")
    warm = by.get("--lr-warmup-iters")
    sd, nd = decay if decay is not None else (None, None)
    if warm is not None and "--lr-decay-iters" in ok and _warmup_follows(int(warm[0]), sd, int(warm[1]), nd):
        ok.add("--lr-warmup-iters")
    return [c for c in changed if c[0] in ok]


def check_resume(saved_args: Mapping[str, Any] | argparse.Namespace, cfg: RunConfig, where: str) -> list[str]:
    """Refuse resuming ``where`` with changed data or schedule settings unless ``--override-resumed-settings``.

    Raising ``--train-iters`` (with the schedule lengths that follow it) is accepted and logged. Returns
    the changes (``"--flag old -> new"``) that the override or the extension let through, for the caller to log.
    """
    changed = changed_settings(saved_args, cfg)
    extended = extension(changed)
    if extended:
        log.info(" resuming %s with the run extended: %s", where,
                 "; ".join(f"{flag} {_text(old)} -> {_text(new)}" for flag, old, new in extended))
    changes = [f"{flag} {_text(old)} -> {_text(new)}" for flag, old, new in changed if (flag, old, new) not in extended]
    if not changes:
        return []
    listed = "; ".join(changes)
    if not cfg.training.override_resumed_settings:
        raise ConfigError(
            f"resuming {where} with changed settings: {listed} (they change the data order, the batches or the "
            "schedule): give the checkpoint's values, or --override-resumed-settings to resume anyway"
        )
    return changes
