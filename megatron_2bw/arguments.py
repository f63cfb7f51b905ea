"""Megatron-LM's command-line flags -> the validated config dataclasses of one training run.

Flags keep Megatron's names and meanings (``--num-layers``, ``--micro-batch-size``,
``--global-batch-size``, ``--tensor-model-parallel-size``, ...). Each group of flags becomes
one frozen dataclass, built and checked by a small function; ``build_config`` chains them.
Nothing here starts a process group or imports torch: every mistake is a one-line
``ConfigError`` raised before any collective exists (the entry points print it and exit 2).

The world size is read from the launcher's environment (torchrun's ``WORLD_SIZE`` or SLURM's
``SLURM_NTASKS``, the variables ``parallel_state.distributed_env`` reads), so layout errors
such as a world that ``t * d`` does not divide are caught before ``init_process_group``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, replace

from .config import P2P_MODES, SCHEDULES, ModelConfig, OptimizerConfig, ParallelConfig, PipelineConfig
from .errors import ConfigError

DECAY_STYLES = ("linear", "cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("gloo", "nccl")
# ModelConfig needs a vocabulary size to validate; the real one comes from the tokenizer later.
_PLACEHOLDER_VOCAB = 128


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is a ConfigError (one line) instead of usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# --------------------------------------------------------------------------- parser
def build_parser(kind: str) -> argparse.ArgumentParser:
    """The flags of ``pretrain_gpt.py`` (kind ``gpt``) or ``pretrain_bert.py`` (kind ``bert``)."""
    p = _OneLineParser(
        prog=f"pretrain_{kind}.py", description=f"Pre-train {kind.upper()} with PipeDream-2BW / Flush / GPipe.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model (a --model-preset gives defaults; explicit flags override it)")
    g.add_argument("--model-preset", help="named model shape (see megatron_2bw.models.presets)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, help="default: the sequence length")
    g.add_argument("--hidden-dropout", type=float, help="default 0.1 (a preset's value with --model-preset)")
    g.add_argument("--attention-dropout", type=float, help="default 0.1 (a preset's value with --model-preset)")
    g.add_argument("--layernorm-epsilon", type=float)
    g.add_argument("--init-method-std", type=float)

    g = p.add_argument_group("parallelism and pipeline")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, help="default 2bw")
    g.add_argument("--p2p-mode", choices=P2P_MODES, default="auto",
                   help="stage-to-stage transfers: prefetch (receives posted ahead; gloo), grouped (batch_isend_irecv "
                        "per peer, as NCCL requires) or auto (grouped except on gloo)")
    g.add_argument("--pipeline-no-flushes", action="store_true", help="2021 spelling of --pipeline-schedule 2bw")
    g.add_argument("--gpipe", action="store_true", help="2021 spelling of --pipeline-schedule gpipe")
    g.add_argument("--micro-batch-size", type=int, help="required unless --auto-plan")
    g.add_argument("--auto-plan", action="store_true",
                   help="let the planner choose t, d, --micro-batch-size, recomputation and the schedule")
    g.add_argument("--auto-plan-profile", help="profile JSON to plan from (written here by a single-process run)")
    g.add_argument("--cluster", help="--auto-plan: cluster preset or JSON file (default: describe this machine)")
    g.add_argument("--global-batch-size", type=int, help="default: micro batch size x data-parallel size")
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--checkpoint-activations", action="store_true", help="old spelling of --recompute-activations")

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, help="save (with --save) and exit after this many iterations")

    g = p.add_argument_group("optimizer, learning rate and precision")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, help="warm-up as a fraction of --lr-decay-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, help="fp16: a constant loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--min-loss-scale", type=float, default=1.0)

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="+", help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... (a blend)")
    g.add_argument("--split", default="969, 30, 1", help="train,valid,test document weights")
    g.add_argument("--tokenizer-type", help="SentencePieceTokenizer, GPT2BPETokenizer, BertWordPiece(Lower)Case, HuggingFaceTokenizer")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    if kind == "bert":
        g.add_argument("--mask-prob", type=float, default=0.15)
        g.add_argument("--short-seq-prob", type=float, default=0.1)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", help="checkpoint directory to write")
    g.add_argument("--load", help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=int)

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--metrics-file", help="append one JSON object per line (see docs/training.md)")
    g.add_argument("--tensorboard-dir", help="write TensorBoard events here (needs tensorboard installed)")

    g = p.add_argument_group("system")
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--distributed-backend", choices=BACKENDS, help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--fused-kernels", choices=("auto", "apex", "torch"), default="auto")
    return p


def parse_args(argv: list[str] | None, kind: str) -> argparse.Namespace:
    return build_parser(kind).parse_args(argv)


# --------------------------------------------------------------------------- the other configs
@dataclass(frozen=True)
class LRConfig:
    """Megatron's learning-rate schedule: linear warm-up, then linear/cosine/constant decay to min_lr."""

    lr: float
    min_lr: float = 0.0
    decay_style: str = "linear"
    warmup_iters: int = 0
    decay_iters: int = 1

    def __post_init__(self) -> None:
        _require(self.decay_style in DECAY_STYLES, f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}")
        _require(self.lr > 0, f"--lr must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        _require(self.warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.warmup_iters}")
        _require(self.decay_iters >= 1, f"--lr-decay-iters must be >= 1, got {self.decay_iters}")
        _require(
            self.warmup_iters <= self.decay_iters,
            f"--lr-warmup-iters {self.warmup_iters} exceeds the decay iterations {self.decay_iters}",
        )


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int
    global_batch_size: int
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    metrics_file: str | None = None
    tensorboard_dir: str | None = None

    def __post_init__(self) -> None:
        _require(self.train_iters >= 1, f"--train-iters must be >= 1, got {self.train_iters}")
        _require(self.global_batch_size >= 1, f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        for name in ("log_interval", "eval_interval", "save_interval", "exit_interval"):
            v = getattr(self, name)
            _require(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        _require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        _require(self.save_interval is None or self.save is not None, "--save-interval needs --save DIR")


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...]
    split: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1


@dataclass(frozen=True)
class SystemConfig:
    device: str  # resolved: "cpu" or "cuda"
    backend: str
    timeout_minutes: float = 10.0
    fused_kernels: str = "auto"

    def __post_init__(self) -> None:
        _require(self.timeout_minutes > 0, f"--distributed-timeout-minutes must be positive, got {self.timeout_minutes}")
        _require(
            not (self.backend == "nccl" and self.device != "cuda"),
            "--distributed-backend nccl needs --device cuda (use gloo on CPU)",
        )


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, validated; ``parallel.data`` is resolved against the world size."""

    kind: str
    model: ModelConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    optimizer: OptimizerConfig
    lr: LRConfig
    training: TrainingConfig
    data: DataConfig
    system: SystemConfig
    args: dict

    def with_vocab(self, vocab_size: int) -> "RunConfig":
        """The model's vocabulary is the tokenizer's (as in Megatron)."""
        return replace(self, model=replace(self.model, vocab_size=vocab_size))


# --------------------------------------------------------------------------- builders
def env_world() -> tuple[int, int]:
    """(rank, world size) from torchrun's or SLURM's environment; (0, 1) when neither is set.

    The same precedence as ``parallel_state.distributed_env``, without importing torch.
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


def model_config(args: argparse.Namespace, kind: str) -> ModelConfig:
    """The preset's shape (if any) with explicit flags on top; Megatron's defaults otherwise."""
    fields = {
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
        "num_attention_heads": args.num_attention_heads, "seq_length": args.seq_length,
        "max_position_embeddings": args.max_position_embeddings, "hidden_dropout": args.hidden_dropout,
        "attention_dropout": args.attention_dropout, "layernorm_epsilon": args.layernorm_epsilon,
        "init_method_std": args.init_method_std,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    if args.model_preset:
        from .models.presets import PRESETS  # plain data; no torch

        if args.model_preset not in PRESETS:
            raise ConfigError(f"unknown --model-preset {args.model_preset!r}; choose one of {', '.join(sorted(PRESETS))}")
        base = PRESETS[args.model_preset]
        _require(
            base.kind == kind,
            f"--model-preset {args.model_preset} is a {base.kind.upper()} model; use pretrain_{base.kind}.py",
        )
        if "hidden_size" in given and "ffn_hidden_size" not in given:
            given["ffn_hidden_size"] = 4 * given["hidden_size"]
        if "seq_length" in given and "max_position_embeddings" not in given:
            given["max_position_embeddings"] = max(given["seq_length"], base.max_position_embeddings)
        return replace(base, vocab_size=_PLACEHOLDER_VOCAB, **given)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _require(flag in given, f"--{flag.replace('_', '-')} is required (or give --model-preset)")
    given.setdefault("hidden_dropout", 0.1)
    given.setdefault("attention_dropout", 0.1)
    return ModelConfig(kind=kind, vocab_size=_PLACEHOLDER_VOCAB, num_tokentypes=2 if kind == "bert" else 0, **given)


def schedule_of(args: argparse.Namespace) -> str:
    old = [name for name, on in (("2bw", args.pipeline_no_flushes), ("gpipe", args.gpipe)) if on]
    _require(len(old) <= 1, "--pipeline-no-flushes and --gpipe contradict each other")
    if args.pipeline_schedule and old and old[0] != args.pipeline_schedule:
        flag = "--pipeline-no-flushes" if old[0] == "2bw" else "--gpipe"
        raise ConfigError(f"{flag} contradicts --pipeline-schedule {args.pipeline_schedule}")
    return args.pipeline_schedule or (old[0] if old else "2bw")


def parallel_config(args: argparse.Namespace, model: ModelConfig, world_size: int) -> ParallelConfig:
    """The layout, checked against the model first (no processes needed), then the world size."""
    par = ParallelConfig(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    model.check_tensor_parallel(par.tensor)
    _require(
        model.num_layers % par.pipeline == 0,
        f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size {par.pipeline}",
    )
    return par.resolve(world_size)


def batch_sizes(args: argparse.Namespace, w: int) -> tuple[int, int]:
    """(global batch B, microbatches per step per pipeline m) with B = b * m * w."""
    b = args.micro_batch_size
    _require(b is not None, "--micro-batch-size is required (or give --auto-plan)")
    _require(b >= 1, f"--micro-batch-size must be >= 1, got {b}")
    B = args.global_batch_size if args.global_batch_size is not None else b * w
    _require(B >= 1, f"--global-batch-size must be >= 1, got {B}")
    _require(
        B % (b * w) == 0,
        f"--global-batch-size {B} is not divisible by --micro-batch-size {b} x data-parallel size {w}",
    )
    return B, B // (b * w)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    _require(args.loss_scale is None or args.fp16, "--loss-scale only applies with --fp16")
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
        dtype="fp16" if args.fp16 else "bf16" if args.bf16 else "fp32", loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, loss_scale_window=args.loss_scale_window,
        min_loss_scale=args.min_loss_scale,
    )


def lr_config(args: argparse.Namespace) -> LRConfig:
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        _require(warmup == 0, "give --lr-warmup-iters or --lr-warmup-fraction, not both")
        _require(0 <= args.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        warmup = int(args.lr_warmup_fraction * decay)
    return LRConfig(args.lr, args.min_lr, args.lr_decay_style, warmup, decay)


def training_config(args: argparse.Namespace, global_batch: int) -> TrainingConfig:
    return TrainingConfig(
        train_iters=args.train_iters, global_batch_size=global_batch, seed=args.seed, log_interval=args.log_interval,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, save=args.save, load=args.load,
        save_interval=args.save_interval, exit_interval=args.exit_interval, metrics_file=args.metrics_file,
        tensorboard_dir=args.tensorboard_dir,
    )


def data_config(args: argparse.Namespace, kind: str) -> DataConfig:
    _require(bool(args.data_path), "--data-path is required (an indexed dataset prefix from tools/preprocess_data.py)")
    _require(bool(args.tokenizer_type), "--tokenizer-type is required (the model's vocabulary comes from the tokenizer)")
    extra = {"mask_prob": args.mask_prob, "short_seq_prob": args.short_seq_prob} if kind == "bert" else {}
    return DataConfig(
        tuple(args.data_path), args.split, args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
        **extra,
    )


def system_config(args: argparse.Namespace, cuda_available: bool | None = None) -> SystemConfig:
    """Resolve ``--device auto``; ``cuda_available`` None asks torch (imported only then)."""
    if args.device == "cpu":
        device = "cpu"
    else:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        _require(cuda_available or args.device == "auto", "--device cuda but no CUDA device is available")
        device = "cuda" if cuda_available else "cpu"
    backend = args.distributed_backend or ("nccl" if device == "cuda" else "gloo")
    return SystemConfig(device, backend, args.distributed_timeout_minutes, args.fused_kernels)


def build_config(
    args: argparse.Namespace, kind: str, world_size: int, *, cuda_available: bool | None = None,
) -> RunConfig:
    """All configs of a run, every check that needs no file and no process done here."""
    model = model_config(args, kind)
    parallel = parallel_config(args, model, world_size)
    B, m = batch_sizes(args, parallel.data)
    pipe = PipelineConfig(
        schedule_of(args), args.micro_batch_size, m, recompute=args.recompute_activations or args.checkpoint_activations,
        p2p_mode=args.p2p_mode,
    )
    pipe.check_depth(parallel.pipeline)
    opt = optimizer_config(args)
    lr = lr_config(args)
    train = training_config(args, B)
    data = data_config(args, kind)
    system = system_config(args, cuda_available)
    return RunConfig(kind, model, parallel, pipe, opt, lr, train, data, system, dict(vars(args)))


def describe(cfg: RunConfig) -> dict:
    """A JSON-able summary of the configs (stored in checkpoints and the metrics file)."""
    return {
        "kind": cfg.kind, "model": asdict(cfg.model), "parallel": asdict(cfg.parallel), "pipeline": asdict(cfg.pipeline),
        "optimizer": asdict(cfg.optimizer), "lr": asdict(cfg.lr), "training": asdict(cfg.training),
        "data": asdict(cfg.data), "system": asdict(cfg.system),
    }


__all__ = [
    "DataConfig", "LRConfig", "RunConfig", "SystemConfig", "TrainingConfig", "build_config", "build_parser",
    "describe", "env_world", "parse_args",
]
