"""Megatron-LM's command-line flags <-> the config dataclasses of one run: one table, the rest derived.

Each row of ``FLAGS`` is one flag: its argparse type, default and help, and the config field it
sets (``"section.field"`` of :class:`~megatron_2bw.config.RunConfig`). From the table come the
trainer's parser (``build_parser``), the flags -> config mapping (``build_config``), the flags that
reproduce a config (``megatron_args``, ``to_argv``) and the command the planner prints
(``pretrain_argv``). One rule turns a preset plus shape flags into a ``ModelConfig``
(``model_config``) for the trainer and every tool. Nothing here imports torch or starts a process
group: a mistake is one ``ConfigError`` line (``OneLineParser``, ``errors.run_cli``) before any collective;
an unknown flag's line names the nearest known one. ``--yaml-cfg FILE`` expands into flags placed before
the command line's, so the command line wins (``yaml_cfg.expand_yaml_cfg``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from .config import (
    COMPENSATIONS, DECAY_STYLES, P2P_MODES, DataConfig, Layout, LRConfig, ModelConfig, OptimizerConfig, RunConfig,
    SystemConfig, TrainingConfig, layout_configs, lr_by_samples, train_iters_of,
)

__all__ = [
    "FLAGS", "Flag", "OneLineParser", "add_model_flags", "build_config", "build_parser", "describe", "env_world",
    "megatron_args", "model_config", "parse_args", "pretrain_argv", "run_cli", "to_argv",
]
from .errors import ConfigError, run_cli
from .models.presets import GPT2_VOCAB, PRESETS, get_preset
from .models.stages import format_split, parse_split, split_from_args
from .pipeline.schedules import SCHEDULE_NAMES
from .yaml_cfg import YAML_FLAG, expand_yaml_cfg, explain_unrecognized

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("gloo", "nccl")
KINDS = ("gpt", "bert")
# Without a preset: the shape flags a model needs, and Megatron's dropout.
REQUIRED_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
MEGATRON_DROPOUT = 0.1


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is a ConfigError (one line) instead of usage text and exit.

    An unknown flag's line names the nearest known flag (or says a Megatron flag is not supported).
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(explain_unrecognized(message, self))


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Flag:
    """One flag: how argparse reads it and which config field(s) it sets (``None``: read by a rule)."""

    name: str
    target: str | tuple[str, ...] | None
    group: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    help: str | None = None
    choices: tuple[str, ...] | None = None
    const: Any = None  # a switch (store_true) that sets its target to ``const``
    alias: bool = False  # an older spelling: parsed, never printed
    nargs: str | None = None
    required: bool = False
    kinds: tuple[str, ...] = KINDS
    metavar: str | None = None
    show: Callable[[Any], str] | None = None  # how a value is written back as one token (default: str per item)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def targets(self) -> tuple[str, ...]:
        return () if self.target is None else (self.target,) if isinstance(self.target, str) else self.target

    def add_to(self, group: argparse._ActionsContainer) -> None:
        if self.const is not None:
            group.add_argument(self.name, action="store_true", help=self.help)
            return
        kw = {"type": self.type, "default": self.default, "choices": self.choices, "nargs": self.nargs,
              "metavar": self.metavar}
        group.add_argument(self.name, help=self.help, required=self.required,
                           **{k: v for k, v in kw.items() if v is not None})


MODEL = "model (a --model-preset gives defaults; explicit flags override it)"
PAR, TRAIN = "parallelism and pipeline", "training"
OPT, DATA = "optimizer, learning rate and precision", "data and tokenizer"
CKPT, LOG, SYS = "checkpoints", "logging and evaluation", "system"
_PRESET_HELP = f"named model shape: {', '.join(PRESETS)}"
_DROPOUT_HELP = f"default {MEGATRON_DROPOUT} (a preset's value with --model-preset)"
_EXIT_HELP = "on SIGTERM or --exit-signal: save (with --save) at the next step boundary and exit 0"
_DURATION_HELP = "save (with --save) and exit 0 at the first step boundary after this many minutes"
_SKIP_HELP = "exit 3 after more consecutive skipped steps (default: fp16 20, constant --loss-scale 5, else 0)"
_WANDB_HELP = "turns wandb logging on (offline unless WANDB_MODE/WANDB_API_KEY say otherwise; pip install -e '.[wandb]')"

FLAGS: tuple[Flag, ...] = (
    Flag("--model-preset", None, MODEL, help=_PRESET_HELP),
    Flag("--num-layers", "model.num_layers", MODEL, int),
    Flag("--hidden-size", "model.hidden_size", MODEL, int),
    Flag("--ffn-hidden-size", "model.ffn_hidden_size", MODEL, int, help="default 4 * hidden size"),
    Flag("--num-attention-heads", "model.num_attention_heads", MODEL, int),
    Flag("--seq-length", "model.seq_length", MODEL, int),
    Flag("--max-position-embeddings", "model.max_position_embeddings", MODEL, int, help="default: the sequence length"),
    Flag("--hidden-dropout", "model.hidden_dropout", MODEL, float, help=_DROPOUT_HELP),
    Flag("--attention-dropout", "model.attention_dropout", MODEL, float, help=_DROPOUT_HELP),
    Flag("--layernorm-epsilon", "model.layernorm_epsilon", MODEL, float),
    Flag("--init-method-std", "model.init_method_std", MODEL, float),
    Flag("--tensor-model-parallel-size", "parallel.tensor", PAR, int, 1),
    Flag("--pipeline-model-parallel-size", "parallel.pipeline", PAR, int, 1),
    Flag("--pipeline-layer-split", "pipeline.layer_split", PAR, parse_split, metavar="N,N,...", show=format_split,
         help="layers of each stage, first to last (summing to --num-layers; 0 allowed on the first and last)"),
    Flag("--decoder-first-pipeline-num-layers", None, PAR, int, help="layers of the first stage (Megatron)"),
    Flag("--decoder-last-pipeline-num-layers", None, PAR, int, help="layers of the last stage (Megatron)"),
    Flag("--account-for-embedding-in-pipeline-split", None, PAR, const=True, help="embedding = one layer (Megatron)"),
    Flag("--account-for-loss-in-pipeline-split", None, PAR, const=True, help="head and loss = one layer (Megatron)"),
    Flag("--pipeline-schedule", "pipeline.schedule", PAR, choices=SCHEDULE_NAMES,
         help="default: 2bw with more than one pipeline stage, flush with one (where 2BW would only add a stale "
              "gradient and a second weight copy)"),
    Flag("--p2p-mode", "pipeline.p2p_mode", PAR, choices=P2P_MODES, default="auto",
         help="stage-to-stage transfers: prefetch (receives posted ahead; gloo), grouped (batch_isend_irecv "
              "per peer, as NCCL requires) or auto (grouped except on gloo)"),
    Flag("--2bw-compensation", "pipeline.compensation", PAR, choices=COMPENSATIONS, default="none",
         help="2BW's stale gradient: predict (run on predicted weights; fp32: +1 weight copy) or dc (DC-ASGD)"),
    Flag("--2bw-dc-lambda", "pipeline.dc_lambda", PAR, float, 0.04, help="dc: g + lambda * g * g * (W(t) - W(t-1))"),
    Flag("--pipeline-no-flushes", "pipeline.schedule", PAR, const="2bw", alias=True,
         help="2021 spelling of --pipeline-schedule 2bw"),
    Flag("--gpipe", "pipeline.schedule", PAR, const="gpipe", alias=True,
         help="2021 spelling of --pipeline-schedule gpipe"),
    Flag("--micro-batch-size", "pipeline.micro_batch_size", PAR, int, help="required unless --auto-plan"),
    Flag("--auto-plan", None, PAR, const=True,
         help="let the planner choose t, d, --micro-batch-size, recomputation and the schedule"),
    Flag("--auto-plan-profile", None, PAR, help="profile JSON to plan from (written here by a single-process run)"),
    Flag("--cluster", None, PAR, help="--auto-plan: cluster preset or JSON file (default: describe this machine)"),
    Flag("--global-batch-size", "training.global_batch_size", PAR, int,
         help="default: micro batch size x data-parallel size x pipeline stages (d microbatches per step, "
              "the fewest PipeDream-2BW allows)"),
    Flag("--recompute-activations", "pipeline.recompute", PAR, const=True, help="re-run whole stages in backward"),
    Flag("--checkpoint-activations", "pipeline.recompute", PAR, const=True, alias=True,
         help="old spelling of --recompute-activations"),
    Flag("--recompute-granularity", "pipeline.recompute_granularity", PAR, choices=("full", "selective"),
         help="recompute inside stages: full layers (with --recompute-method) or the attention core only"),
    Flag("--recompute-method", "pipeline.recompute_method", PAR, choices=("uniform", "block")),
    Flag("--recompute-num-layers", "pipeline.recompute_num_layers", PAR, int, help="uniform: chunk size; block: layers"),
    Flag("--train-iters", "training.train_iters", TRAIN, int, help="required unless --train-samples"),
    Flag("--train-samples", "training.train_samples", TRAIN, int,
         help="train on this many samples instead: --train-samples // --global-batch-size iterations (Megatron)"),
    Flag("--seed", "training.seed", TRAIN, int, 1234),
    Flag("--exit-interval", "training.exit_interval", TRAIN, int,
         help="save (with --save) and exit after this many iterations"),
    Flag("--exit-signal-handler", "training.exit_signal_handler", TRAIN, const=True, help=_EXIT_HELP),
    Flag("--exit-signal", "training.exit_signal", TRAIN, default="SIGUSR1", help="handled like SIGTERM"),
    Flag("--exit-duration-in-mins", "training.exit_duration_in_mins", TRAIN, float, help=_DURATION_HELP),
    Flag("--max-skipped-steps", "training.max_skipped_steps", TRAIN, int, help=_SKIP_HELP),
    Flag("--optimizer", "optimizer.optimizer", OPT, choices=("adam", "sgd"), default="adam"),
    Flag("--lr", ("optimizer.lr", "lr.lr"), OPT, float, required=True),
    Flag("--min-lr", "lr.min_lr", OPT, float, 0.0),
    Flag("--lr-decay-style", "lr.decay_style", OPT, choices=DECAY_STYLES, default="linear"),
    Flag("--lr-decay-iters", "lr.decay_iters", OPT, int, help="default: --train-iters"),
    Flag("--lr-warmup-iters", "lr.warmup_iters", OPT, int, 0),
    Flag("--lr-warmup-fraction", None, OPT, float, help="warm-up as a fraction of --lr-decay-iters"),
    Flag("--lr-decay-samples", None, OPT, int, help="with --train-samples: decay over this many samples (default: all)"),
    Flag("--lr-warmup-samples", None, OPT, int, help="with --train-samples: warm up over this many samples"),
    Flag("--weight-decay", "optimizer.weight_decay", OPT, float, 0.01),
    Flag("--clip-grad", "optimizer.clip_grad", OPT, float, 1.0),
    Flag("--adam-beta1", "optimizer.adam_beta1", OPT, float, 0.9),
    Flag("--adam-beta2", "optimizer.adam_beta2", OPT, float, 0.999),
    Flag("--adam-eps", "optimizer.adam_eps", OPT, float, 1e-8),
    Flag("--sgd-momentum", "optimizer.sgd_momentum", OPT, float, 0.9),
    Flag("--fp16", "optimizer.dtype", OPT, const="fp16"),
    Flag("--bf16", "optimizer.dtype", OPT, const="bf16"),
    Flag("--loss-scale", "optimizer.loss_scale", OPT, float, help="fp16: a constant loss scale (default: dynamic)"),
    Flag("--initial-loss-scale", "optimizer.initial_loss_scale", OPT, float, 2.0**16),
    Flag("--loss-scale-window", "optimizer.loss_scale_window", OPT, int, 1000),
    Flag("--min-loss-scale", "optimizer.min_loss_scale", OPT, float, 1.0),
    Flag("--data-path", "data.data_path", DATA, nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... (a blend)"),
    Flag("--split", "data.split", DATA, default="969, 30, 1", help="train,valid,test document weights"),
    Flag("--tokenizer-type", "data.tokenizer_type", DATA,
         help="SentencePieceTokenizer, GPT2BPETokenizer, BertWordPiece(Lower)Case, HuggingFaceTokenizer"),
    Flag("--tokenizer-model", "data.tokenizer_model", DATA),
    Flag("--vocab-file", "data.vocab_file", DATA),
    Flag("--merge-file", "data.merge_file", DATA),
    Flag("--mask-prob", "data.mask_prob", DATA, float, 0.15, kinds=("bert",)),
    Flag("--short-seq-prob", "data.short_seq_prob", DATA, float, 0.1, kinds=("bert",)),
    Flag("--save", "training.save", CKPT, help="checkpoint directory to write"),
    Flag("--load", "training.load", CKPT, help="checkpoint directory to resume from"),
    Flag("--override-resumed-settings", "training.override_resumed_settings", CKPT, const=True,
         help="resume although data or schedule settings differ from the checkpoint's (each change is logged)"),
    Flag("--save-interval", "training.save_interval", CKPT, int),
    Flag("--finetune", "training.finetune", CKPT, const=True,
         help="load the weights of --load only: iteration 0, a fresh optimizer, this run's data and schedule"),
    Flag("--no-load-optim", "training.no_load_optim", CKPT, const=True,
         help="resume the weights and the iteration of --load with a fresh optimizer and loss scaler"),
    Flag("--no-load-rng", "training.no_load_rng", CKPT, const=True, help="do not restore the RNG states of --load"),
    Flag("--skip-train", "training.skip_train", CKPT, const=True,
         help="evaluate the --load checkpoint on the validation and test sets, then exit"),
    Flag("--log-interval", "training.log_interval", LOG, int, 100),
    Flag("--eval-interval", "training.eval_interval", LOG, int, 1000),
    Flag("--eval-iters", "training.eval_iters", LOG, int, 100),
    Flag("--metrics-file", "training.metrics_file", LOG, help="append one JSON object per line (see docs/training.md)"),
    Flag("--tensorboard-dir", "training.tensorboard_dir", LOG, help="TensorBoard events (pip install -e '.[tensorboard]')"),
    Flag("--wandb-project", "training.wandb_project", LOG, help=_WANDB_HELP),
    Flag("--wandb-exp-name", "training.wandb_exp_name", LOG, help="the wandb run's name (required with --wandb-project)"),
    Flag("--wandb-save-dir", "training.wandb_save_dir", LOG, help="where wandb writes the run (default: <--save>/wandb)"),
    Flag("--device", "system.device", SYS, choices=DEVICES, default="auto"),
    Flag("--distributed-backend", "system.backend", SYS, choices=BACKENDS, help="default: nccl on CUDA, gloo on CPU"),
    Flag("--distributed-timeout-minutes", "system.timeout_minutes", SYS, float, 10.0),
    Flag("--fused-kernels", "system.fused_kernels", SYS, choices=("auto", "apex", "torch"), default="auto"),
    Flag("--stall-timeout-s", "system.stall_timeout_s", SYS, float, 45.0, help="exit 4 naming a rank stalled this long (0: off)"),
    Flag(YAML_FLAG, None, SYS, metavar="FILE", help="YAML mapping of flag names (train_iters or train-iters) to values; "
                                    "flags on the command line win"),
    Flag("--validate-only", None, SYS, const=True,
         help="check the flags, tokenizer, data and checkpoint to resume as every rank would, print one line "
              "(config OK: ... or error: ...) and exit 0 or 2 without starting a process group"),
)
# What the tools (planner, profiler, simulator) take beyond the trainer's model flags: the trainer
# gets the kind from its script's name and the vocabulary from its tokenizer.
TOOL_MODEL_FLAGS: tuple[Flag, ...] = (
    Flag("--model-kind", "model.kind", MODEL, choices=KINDS, help="default: the preset's, else gpt"),
    Flag("--vocab-size", "model.vocab_size", MODEL, int, help=f"default: the preset's, else {GPT2_VOCAB}"),
)


def _flags(kind: str) -> Iterable[Flag]:
    return (f for f in FLAGS if kind in f.kinds)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add ``flags`` to ``parser``, one argument group per ``Flag.group`` (in order of appearance)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in flags:
        if f.group not in groups:
            groups[f.group] = parser.add_argument_group(f.group)
        f.add_to(groups[f.group])


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The trainer's model flags plus ``--model-kind`` and ``--vocab-size``, for the tools."""
    add_flags(parser, [f for f in FLAGS if f.group == MODEL] + list(TOOL_MODEL_FLAGS))


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The flags of ``pretrain_gpt.py`` (kind ``gpt``) or ``pretrain_bert.py`` (kind ``bert``)."""
    p = OneLineParser(prog=f"pretrain_{kind}.py", allow_abbrev=False,
                      description=f"Pre-train {kind.upper()} with PipeDream-2BW / Flush / GPipe.")
    add_flags(p, _flags(kind))
    return p


def parse_args(argv: Sequence[str] | None, kind: str) -> argparse.Namespace:
    """The trainer's flags; ``--yaml-cfg FILE`` supplies flags that the command line may override."""
    parser = build_parser(kind)
    return parser.parse_args(expand_yaml_cfg(list(sys.argv[1:] if argv is None else argv), parser))


# --------------------------------------------------------------------------- flags -> config
def _fields(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The given (not None) values of the flags that set fields of ``section`` directly."""
    out: dict[str, Any] = {}
    for f in (*FLAGS, *TOOL_MODEL_FLAGS):
        if f.const is None and (v := getattr(args, f.dest, None)) is not None:
            out.update({t.split(".")[1]: v for t in f.targets if t.split(".")[0] == section})
    return out


def _switched(args: argparse.Namespace, target: str) -> list[Flag]:
    """The switches given that set ``target``, in table order."""
    return [f for f in FLAGS if f.const is not None and target in f.targets and getattr(args, f.dest, False)]


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in fields(cls) if f.name == name)


def model_config(args: argparse.Namespace, kind: str | None = None, *, base: ModelConfig | None = None) -> ModelConfig:
    """The one "preset plus shape flags -> ModelConfig" rule, for the trainer and every tool.

    A preset (or ``base``, e.g. a profile's model) gives every field; explicit flags override it,
    ``--hidden-size`` without ``--ffn-hidden-size`` gives 4 * hidden and ``--seq-length`` without
    ``--max-position-embeddings`` at least that many positions. Without either, the four shape flags
    are required and the dropouts default to Megatron's 0.1. ``kind`` is the trainer script's
    (else ``--model-kind``); the trainer's vocabulary comes from its tokenizer later.
    """
    given = _fields(args, "model")
    tool_kind = given.pop("kind", None)  # --model-kind (the trainer's kind is its script's)
    want = kind or tool_kind
    preset = getattr(args, "model_preset", None)
    if preset:
        base = get_preset(preset)
    if base is not None:
        if want and base.kind != want:
            name = f"--model-preset {preset}" if preset else "the profile's model"
            hint = f"use pretrain_{base.kind}.py" if kind else f"not --model-kind {want}"
            raise ConfigError(f"{name} is a {base.kind.upper()} model; {hint}")
        if "hidden_size" in given and "ffn_hidden_size" not in given:
            given["ffn_hidden_size"] = 4 * given["hidden_size"]
        if "seq_length" in given and "max_position_embeddings" not in given:
            given["max_position_embeddings"] = max(given["seq_length"], base.max_position_embeddings)
        return replace(base, **given)
    missing = ["--" + k.replace("_", "-") for k in REQUIRED_SHAPE if k not in given]
    if missing:
        raise ConfigError(f"{missing[0]} is required (or give --model-preset); missing: {' '.join(missing)}")
    given.setdefault("hidden_dropout", MEGATRON_DROPOUT)
    given.setdefault("attention_dropout", MEGATRON_DROPOUT)
    given.setdefault("vocab_size", GPT2_VOCAB)
    want = want or "gpt"
    return ModelConfig(kind=want, num_tokentypes=2 if want == "bert" else 0, **given)


def default_schedule(d: int) -> tuple[str, str]:
    """(schedule, why) without ``--pipeline-schedule``: 2BW needs stages to overlap; with one it only costs."""
    if d > 1:
        return "2bw", f"{d} pipeline stages: PipeDream-2BW keeps every stage busy without flushes"
    return "flush", "one pipeline stage: PipeDream-2BW would only add a stale gradient and a second weight copy"


def schedule_of(args: argparse.Namespace) -> str:
    """``--pipeline-schedule`` or an older spelling of it (contradictions refused), else the depth's default."""
    old = _switched(args, "pipeline.schedule")
    _require(len(old) <= 1, f"{' and '.join(f.name for f in old)} contradict each other")
    given = args.pipeline_schedule
    if given and old and old[0].const != given:
        raise ConfigError(f"{old[0].name} contradicts --pipeline-schedule {given}")
    return given or (old[0].const if old else default_schedule(args.pipeline_model_parallel_size)[0])


def schedule_note(args: argparse.Namespace) -> str | None:
    """The start-up line saying which schedule was chosen by default and why (None when one was given)."""
    if args.pipeline_schedule or _switched(args, "pipeline.schedule") or getattr(args, "auto_plan", False):
        return None
    schedule, why = default_schedule(args.pipeline_model_parallel_size)
    return f"--pipeline-schedule not given: {schedule} ({why})"


def precision_of(args: argparse.Namespace) -> str:
    """``fp16``/``bf16`` from the switches, else ``fp32``."""
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    return next((f.const for f in _switched(args, "optimizer.dtype")), _default(OptimizerConfig, "dtype"))


def layout_of(args: argparse.Namespace) -> Layout:
    """The layout the flags ask for (``--auto-plan`` replaces it with the planner's)."""
    return Layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size,
                  bool(_switched(args, "pipeline.recompute")), schedule_of(args))


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    dtype = precision_of(args)
    _require(args.loss_scale is None or dtype == "fp16", "--loss-scale only applies with --fp16")
    return OptimizerConfig(**_fields(args, "optimizer"), dtype=dtype)


def lr_config(args: argparse.Namespace, global_batch: int | None = None) -> LRConfig:
    given = _fields(args, "lr")
    if getattr(args, "train_samples", None) is not None:
        _require(args.lr_decay_iters is None and not given.get("warmup_iters") and args.lr_warmup_fraction is None,
                 "with --train-samples give --lr-decay-samples and --lr-warmup-samples, not the -iters flags")
        return lr_by_samples(given, args.train_samples, args.lr_decay_samples, args.lr_warmup_samples,
                             global_batch or args.global_batch_size)
    for flag in ("lr_decay_samples", "lr_warmup_samples"):
        _require(getattr(args, flag, None) is None, f"--{flag.replace('_', '-')} needs --train-samples")
    decay = given.setdefault("decay_iters", args.train_iters)
    frac = args.lr_warmup_fraction
    if frac is not None:
        _require(given.get("warmup_iters", 0) == 0, "give --lr-warmup-iters or --lr-warmup-fraction, not both")
        _require(0 <= frac <= 1, f"--lr-warmup-fraction must be in [0, 1], got {frac}")
        given["warmup_iters"] = int(frac * decay)
    return LRConfig(**given)


def training_config(args: argparse.Namespace, global_batch: int) -> TrainingConfig:
    switches = {t: bool(_switched(args, f"training.{t}")) for t in ("override_resumed_settings", "exit_signal_handler",
                                                                 "finetune", "no_load_optim", "no_load_rng", "skip_train")}
    return TrainingConfig(**{**_fields(args, "training"), "global_batch_size": global_batch, **switches,
                             "train_iters": train_iters_of(args.train_iters, args.train_samples, global_batch)})


def data_config(args: argparse.Namespace) -> DataConfig:
    _require(bool(args.data_path), "--data-path is required (an indexed dataset prefix from tools/preprocess_data.py)")
    _require(bool(args.tokenizer_type), "--tokenizer-type is required (the model's vocabulary comes from the tokenizer)")
    given = _fields(args, "data")
    return DataConfig(**{**given, "data_path": tuple(given["data_path"])})


def system_config(args: argparse.Namespace, cuda_available: bool | None = None) -> SystemConfig:
    """Resolve ``--device auto``; ``cuda_available`` None asks torch (imported only then)."""
    if args.device == "cpu":
        device = "cpu"
    else:
        if cuda_available is None:
            import torch  # noqa: PLC0415

            cuda_available = torch.cuda.is_available()
        _require(cuda_available or args.device == "auto", "--device cuda but no CUDA device is available")
        device = "cuda" if cuda_available else "cpu"
    rest = {k: v for k, v in _fields(args, "system").items() if k not in ("device", "backend")}
    return SystemConfig(device, args.distributed_backend or ("nccl" if device == "cuda" else "gloo"), **rest)


def build_config(
    args: argparse.Namespace, kind: str, world_size: int, *, cuda_available: bool | None = None,
    layout: Layout | None = None,
) -> RunConfig:
    """All configs of a run, every check that needs no file and no process done here.

    ``layout``: the planner's choice (``--auto-plan``) instead of the layout flags.
    """
    model = model_config(args, kind)
    if layout is None:
        layout = replace(layout_of(args), layer_split=split_from_args(args, model.num_layers))
    parallel, pipe, B = layout_configs(layout, model, args.global_batch_size, world_size,
                                       args.p2p_mode)
    given = _fields(args, "pipeline")
    pipe = replace(pipe, **{k: v for k, v in given.items() if k in ("compensation", "dc_lambda") or "recompute_" in k})
    opt, training = optimizer_config(args), training_config(args, B)  # --train-iters before the lr schedule
    return RunConfig(kind, model, parallel, pipe, opt, lr_config(args, B), training, data_config(args),
                     system_config(args, cuda_available))


# --------------------------------------------------------------------------- config -> flags
def _text(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, (tuple, list)) else [str(v)]


def render(values: Mapping[str, Any], kind: str) -> list[str]:
    """The trainer's flags that set each ``"section.field"`` in ``values`` (table order, no old spellings)."""
    argv: list[str] = []
    for f in _flags(kind):
        if f.alias or not f.targets or f.targets[0] not in values:
            continue
        v = values[f.targets[0]]
        if f.const is not None:
            argv += [f.name] if v == f.const else []
        elif v is not None:
            argv += [f.name, *([f.show(v)] if f.show else _text(v))]
    return argv


def config_values(cfg: RunConfig) -> dict[str, Any]:
    """``{"section.field": value}`` of every field of ``cfg``."""
    return {f"{sec}.{k}": v for sec, d in cfg.to_dict().items() if isinstance(d, dict) for k, v in d.items()}


def to_argv(cfg: RunConfig) -> list[str]:
    """Trainer flags that rebuild ``cfg`` (its model explicitly; the vocabulary comes from the tokenizer)."""
    return render(config_values(cfg), cfg.kind)


def megatron_args(cfg: RunConfig) -> dict[str, Any]:
    """Megatron-style flat arguments (flag dest -> value) of ``cfg``, as checkpoints store them."""
    values = config_values(cfg)
    out: dict[str, Any] = {}
    for f in _flags(cfg.kind):
        if not f.alias and f.targets and f.targets[0] in values:
            v = values[f.targets[0]]
            out[f.dest] = (v == f.const) if f.const is not None else list(v) if isinstance(v, tuple) else v
    return out


def model_values(model: ModelConfig) -> dict[str, Any]:
    """The model fields a command must state: the required shape and what the trainer would not imply."""
    implied = model_config(argparse.Namespace(**{k: getattr(model, k) for k in REQUIRED_SHAPE}), model.kind)
    names = [f.targets[0].split(".")[1] for f in FLAGS if f.targets and f.targets[0].startswith("model.")]
    return {f"model.{n}": getattr(model, n) for n in names
            if n in REQUIRED_SHAPE or getattr(model, n) != getattr(implied, n)}


def pretrain_argv(model: ModelConfig, layout: Layout, global_batch_size: int, precision: str = "fp32") -> list[str]:
    """The ``pretrain_{gpt,bert}.py`` command line that trains ``model`` with ``layout`` (the planner's)."""
    values = {
        **model_values(model), "parallel.tensor": layout.tensor, "parallel.pipeline": layout.pipeline,
        "pipeline.schedule": layout.schedule, "pipeline.micro_batch_size": layout.micro_batch_size,
        "pipeline.layer_split": layout.layer_split,
        "training.global_batch_size": global_batch_size, "pipeline.recompute": layout.recompute,
        "optimizer.dtype": precision,
    }
    return [f"pretrain_{model.kind}.py", *render(values, model.kind)]


def describe(cfg: RunConfig) -> dict[str, Any]:
    """The start-up description: every config field, nested by section (checkpoints and the metrics file)."""
    return cfg.to_dict()


def env_world() -> tuple[int, int]:
    """(rank, world size) from torchrun's or SLURM's environment; (0, 1) when neither is set.

    Read without torch, so a layout the world size does not divide fails before torch loads.
    """
    env = os.environ
    try:
        if "RANK" in env and "WORLD_SIZE" in env:
            return int(env["RANK"]), int(env["WORLD_SIZE"])
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    except ValueError:
        raise ConfigError("RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_NTASKS) are not integers") from None
    return 0, 1
