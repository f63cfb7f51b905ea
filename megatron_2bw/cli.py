"""Megatron-LM's command-line flags <-> the config dataclasses of one run: one table, the rest derived.

Each row of ``FLAGS`` (``megatron_2bw.flags``) is one flag: its argparse type, default and help, and the config field it
sets (``"section.field"`` of :class:`~megatron_2bw.config.RunConfig`). From the table come the
trainer's parser (``build_parser``) and the flags -> config mapping (``build_config``); the way back, a
config to flags (``to_argv``, ``megatron_args``, the planner's ``pretrain_argv``), is ``argv.py``,
which needs no argparse. One rule turns a preset plus shape flags into a ``ModelConfig``
(``model_config``) for the trainer and every tool. Nothing here imports torch or starts a process
group: a mistake is one ``ConfigError`` line (``OneLineParser``, ``errors.run_cli``) before any collective;
an unknown flag's line names the nearest known one. ``--yaml-cfg FILE`` expands into flags placed before
the command line's, so the command line wins (``yaml_cfg.expand_yaml_cfg``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import fields, replace
from typing import Any

from .argv import REQUIRED_SHAPE, shape_model, trainer_flags
from .config import (
    DataConfig,
    Layout,
    LRConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SystemConfig,
    TrainingConfig,
    default_ffn_hidden_size,
    layout_configs,
    lr_by_samples,
    train_iters_of,
)
from .config.context import P2P
from .config.moe import MoEConfig
from .config.presets import get_preset
from .errors import ConfigError, run_cli
from .flags import FLAGS, MODEL, TOOL_MODEL_FLAGS, Flag
from .schedule.stages import split_from_args, virtual_stages
from .yaml_cfg import expand_yaml_cfg, explain_unrecognized

__all__ = [
    "FLAGS", "Flag", "OneLineParser", "add_model_flags", "build_config", "build_parser", "env_world", "model_config",
    "parse_args", "run_cli",
]


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is a ConfigError (one line) instead of usage text and exit.

    An unknown flag's line names the nearest known flag (or says a Megatron flag is not supported).
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(explain_unrecognized(message, self))


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
    add_flags(p, trainer_flags(kind))
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


def _model_switches(args: argparse.Namespace) -> dict[str, Any]:
    """Model fields set by switches given (``--swiglu``, ``--disable-bias-linear``, ...)."""
    return {t.split(".")[1]: f.const for f in FLAGS if f.const is not None and getattr(args, f.dest, False)
            for t in f.targets if t.startswith("model.")}


def model_config(args: argparse.Namespace, kind: str | None = None, *, base: ModelConfig | None = None) -> ModelConfig:
    """The one "preset plus shape flags -> ModelConfig" rule, for the trainer and every tool.

    A preset (or ``base``, e.g. a profile's model) gives every field; explicit flags override it,
    ``--hidden-size`` without ``--ffn-hidden-size`` gives 4 * hidden and ``--seq-length`` without
    ``--max-position-embeddings`` at least that many positions. Without either, the four shape flags
    are required and the dropouts default to Megatron's 0.1. ``kind`` is the trainer script's
    (else ``--model-kind``); the trainer's vocabulary comes from its tokenizer later.
    """
    given = _fields(args, "model")
    given.update(_model_switches(args))
    if (moe := moe_config(args)) is not None:
        given["moe"] = moe
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
            given["ffn_hidden_size"] = default_ffn_hidden_size(given["hidden_size"], given.get("swiglu", base.swiglu))
        if "seq_length" in given and "max_position_embeddings" not in given:
            given["max_position_embeddings"] = max(given["seq_length"], base.max_position_embeddings)
        return replace(base, **given)
    missing = ["--" + k.replace("_", "-") for k in REQUIRED_SHAPE if k not in given]
    if missing:
        raise ConfigError(f"{missing[0]} is required (or give --model-preset); missing: {' '.join(missing)}")
    return shape_model(given, want or "gpt")


def moe_config(args: argparse.Namespace) -> MoEConfig | None:
    """``--num-experts`` and the ``--moe-*`` flags as a :class:`MoEConfig`; None (dense) without ``--num-experts``,
    where any other MoE flag is refused rather than ignored."""
    given = _fields(args, "moe")
    given.update({t.split(".")[1]: f.const for f in FLAGS if f.const is not None and getattr(args, f.dest, False)
                  for t in f.targets if t.startswith("moe.")})
    if "num_experts" not in given:
        _require(not given, f"--{next(iter(given), '').replace('_', '-')} needs --num-experts")
        return None
    return MoEConfig(**given)


def refuse_unwired_moe(cfg: RunConfig) -> None:
    """An MoE run with what is not wired for experts yet stops here in one line, never runs silently wrong: saving
    the aux-loss-free expert bias in the torch checkpoint format (its two versions are saved by torch_dist only)."""
    moe = cfg.model.moe
    if moe is None:
        return
    tc = cfg.training
    _require(tc.save is None or tc.ckpt_format == "torch_dist" or not moe.moe_router_enable_expert_bias,
             "--moe-router-enable-expert-bias --save: the expert bias is saved in --ckpt-format torch_dist only")


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
                  bool(_switched(args, "pipeline.recompute")), schedule_of(args),
                  context=args.context_parallel_size, cp_comm_type=args.cp_comm_type or P2P)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    dtype = precision_of(args)
    _require(args.loss_scale is None or dtype == "fp16", "--loss-scale only applies with --fp16")
    switches = {}
    for target in ("accumulate_allreduce_grads_in_fp32", "use_distributed_optimizer"):
        given = {f.const for f in _switched(args, f"optimizer.{target}")}
        _require(len(given) < 2, "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 contradict each other")
        if given:
            switches[target] = given.pop()
    nesterov = {f.const for f in _switched(args, "optimizer.muon_nesterov")}
    _require(len(nesterov) < 2, "--muon-nesterov and --no-muon-nesterov contradict each other")
    if nesterov:
        switches["muon_nesterov"] = nesterov.pop()
    return OptimizerConfig(**_fields(args, "optimizer"), **switches, dtype=dtype)


def lr_config(args: argparse.Namespace, global_batch: int | None = None) -> LRConfig:
    given = {**_fields(args, "lr"), **_wsd_fields(args, global_batch)}
    if getattr(args, "train_samples", None) is not None:
        _require(args.lr_decay_iters is None and not given.get("warmup_iters") and args.lr_warmup_fraction is None
                 and getattr(args, "lr_wsd_decay_iters", None) is None,
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


def exit_signal_handler_of(args: argparse.Namespace) -> bool:
    """On by default (a stop signal saves and exits 0); ``--no-exit-signal-handler`` turns it off."""
    off = bool(getattr(args, "no_exit_signal_handler", False))
    _require(not (off and getattr(args, "exit_signal_handler", False)),
             "--exit-signal-handler and --no-exit-signal-handler contradict each other")
    return not off


def _wsd_fields(args: argparse.Namespace, global_batch: int | None) -> dict[str, Any]:
    """WSD's anneal in samples (``--lr-wsd-decay-samples``, with ``--train-samples``) and the batch that
    inverse-square-root counts samples by."""
    samples = getattr(args, "lr_wsd_decay_samples", None)
    _require(samples is None or getattr(args, "train_samples", None) is not None,
             "--lr-wsd-decay-samples needs --train-samples")
    out: dict[str, Any] = {"global_batch_size": global_batch or getattr(args, "global_batch_size", None)}
    if samples is not None:
        out["wsd_decay_iters"] = samples
    return out


# Switches (store_true flags) of a section that its config builder reads with ``_switched``.
_TRAINING_SWITCHES = ("log_params_norm", "log_num_zeros_in_grad", "log_timers_to_tensorboard", "profile")
_DATA_SWITCHES = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "mock_data")


def training_config(args: argparse.Namespace, global_batch: int) -> TrainingConfig:
    given = ("override_resumed_settings", "exit_signal_handler", "finetune", "no_load_optim", "no_load_rng",
             "skip_train", "async_save", "finetune_ignore_tokenizer")
    switches = {t: bool(_switched(args, f"training.{t}")) for t in given}
    switches.update(exit_signal_handler=exit_signal_handler_of(args),
                    overwrite_save=bool(getattr(args, "overwrite_save", False)))
    switches.update({t: bool(_switched(args, f"training.{t}")) for t in _TRAINING_SWITCHES})
    return TrainingConfig(**{**_fields(args, "training"), "global_batch_size": global_batch, **switches,
                             "train_iters": train_iters_of(args.train_iters, args.train_samples, global_batch)})


def data_config(args: argparse.Namespace) -> DataConfig:
    switches = {t: bool(_switched(args, f"data.{t}")) for t in _DATA_SWITCHES}
    per_split = any(getattr(args, f"{s}_data_path", None) for s in ("train", "valid", "test"))
    _require(bool(args.data_path) or switches["mock_data"] or per_split,
             "--data-path is required (an indexed dataset prefix from tools/preprocess_data.py), or --mock-data")
    _require(not (args.data_path and switches["mock_data"]), "give --data-path or --mock-data, not both")
    _require(bool(args.tokenizer_type),
             "--tokenizer-type is required (the model's vocabulary comes from the tokenizer)")
    given = _fields(args, "data")
    return DataConfig(**{**given, **switches, "data_path": tuple(given.get("data_path") or ())})


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
    rest["use_cpu_initialization"] = bool(_switched(args, "system.use_cpu_initialization"))
    return SystemConfig(device, args.distributed_backend or ("nccl" if device == "cuda" else "gloo"), **rest)


def build_config(
    args: argparse.Namespace, kind: str, world_size: int, *, cuda_available: bool | None = None,
    layout: Layout | None = None,
) -> RunConfig:
    """All configs of a run, every check that needs no file and no process done here.

    ``layout``: the planner's choice (``--auto-plan``) instead of the layout flags.
    """
    model = model_config(args, kind)
    check_megatron_meaning(args, model)
    if layout is None:
        layout = replace(layout_of(args), layer_split=split_from_args(args, model.num_layers))
        layout = replace(layout, virtual_stages=virtual_stages(
            model.num_layers, layout.pipeline, layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
            virtual_size=args.virtual_pipeline_model_parallel_size, split=layout.layer_split))
    parallel, pipe, B = layout_configs(layout, model, args.global_batch_size, world_size,
                                       args.p2p_mode)
    given = _fields(args, "pipeline")
    # the recompute flags apply unless the layout (the planner's) chose a policy and they are not given
    pipe = replace(pipe, **{k: v for k, v in given.items() if k in ("compensation", "dc_lambda", "ef_scale")
                            or ("recompute_" in k and (v is not None or layout.recompute_policy is None))})
    if _switched(args, "pipeline.post_validation"):
        pipe = replace(pipe, post_validation=True)
    opt, training = optimizer_config(args), training_config(args, B)  # --train-iters before the lr schedule
    if layout.distributed_optimizer:  # the planner's choice (--auto-plan)
        opt = replace(opt, use_distributed_optimizer=True)
    cfg = RunConfig(kind, model, parallel, pipe, opt, lr_config(args, B), training, data_config(args),
                    system_config(args, cuda_available))
    refuse_unwired_moe(cfg)  # after every check of the flags: a bad MoE flag still names itself
    return cfg


def check_megatron_meaning(args: argparse.Namespace, model: ModelConfig) -> None:
    """Megatron flags accepted only where their meaning is what the models here build (issue 45)."""
    kv = getattr(args, "kv_channels", None)
    if kv is not None:
        head = model.hidden_size // model.num_attention_heads
        _require(kv == head and model.hidden_size % model.num_attention_heads == 0,
                 f"--kv-channels {kv} is not --hidden-size {model.hidden_size} / --num-attention-heads "
                 f"{model.num_attention_heads}: Megatron flag not supported by megatron_2bw with another head size "
                 "(the models here build heads of hidden / heads channels)")


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
