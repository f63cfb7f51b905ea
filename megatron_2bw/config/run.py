"""The run: its length, data, system, the layout choices and the whole validated ``RunConfig``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.schedules import parse_schedule_id
from ..schedule.stages import canonical_split, check_virtual_split, layers_per_stage
from .axes import Axes
from .context import ALL_GATHER, P2P
from .model import ModelConfig
from .optim import AUTO_COMPENSATION, LRConfig, OptimizerConfig, resolve_compensation
from .parallel import ParallelConfig, PipelineConfig
from .rules import MAX_SEED, _require

CKPT_FORMATS = ("torch", "torch_dist")  # --ckpt-format (Megatron-LM's names; checkpoint/dist_checkpoint/)
# elements per message when the distributed optimizer's state is gathered for a torch-format save: the
# only device buffer a save allocates (pipeline/zero.gather_full; counted by planner/memory_model)
CKPT_GATHER_CHUNK = 1 << 24


def train_iters_of(train_iters: int | None, train_samples: int | None, global_batch: int) -> int:
    """``--train-iters``, or Megatron's ``--train-samples // --global-batch-size``."""
    if train_samples is None:
        _require(train_iters is not None, "the following arguments are required: --train-iters (or --train-samples)")
        return train_iters
    _require(train_iters is None, "give --train-iters or --train-samples, not both")
    _require(train_samples >= global_batch,
             f"--train-samples {train_samples} is less than one global batch ({global_batch})")
    return train_samples // global_batch


@dataclass(frozen=True)
class TrainingConfig:
    """Length of the run, its batch, and when to log, evaluate, save and exit."""

    train_iters: int
    global_batch_size: int
    seed: int = 1234
    train_samples: int | None = None  # given instead of --train-iters (train_iters = train_samples // batch)
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    override_resumed_settings: bool = False  # resume although data or schedule settings changed
    # SIGTERM/SIGHUP/exit_signal: save at the next boundary, exit 0 (--no-exit-signal-handler: off)
    exit_signal_handler: bool = True
    exit_signal: str = "SIGUSR1"  # the extra signal handled like SIGTERM (SLURM's --signal warning)
    exit_duration_in_mins: float | None = None  # save and exit 0 after this long
    max_skipped_steps: int | None = None  # None: the precision's default (training/health.py)
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    finetune: bool = False  # load the weights only: iteration 0, fresh optimizer
    no_load_optim: bool = False  # resume weights and iteration with a fresh optimizer
    no_load_rng: bool = False  # keep this run's seeds instead of the checkpoint's RNG states
    skip_train: bool = False  # evaluate the loaded checkpoint and exit
    ckpt_format: str = "torch"  # what --save writes: torch (Megatron v2 files) or torch_dist (DCP)
    async_save: bool = False  # torch_dist: write in the background while training goes on
    overwrite_save: bool = False  # --save holds another run's checkpoints: delete them and start over
    # Megatron's logging and memory flags (issue 19): see megatron_2bw/flags.py for what each does here
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    tensorboard_log_interval: int = 1
    empty_unused_memory_level: int = 0
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple[int, ...] | None = None
    ckpt_step: int | None = None  # --ckpt-step: load this iteration of --load, not the pointer file's (Megatron)
    finetune_ignore_tokenizer: bool = False  # --finetune from a checkpoint of another tokenizer, with a warning

    def __post_init__(self) -> None:
        _require(self.ckpt_step is None or self.load is not None, "--ckpt-step needs --load DIR")
        _require(self.ckpt_step is None or self.ckpt_step >= 0, f"--ckpt-step must be >= 0, got {self.ckpt_step}")
        _require(not self.finetune_ignore_tokenizer or self.finetune, "--finetune-ignore-tokenizer needs --finetune")
        _require(self.tensorboard_log_interval >= 1,
                 f"--tensorboard-log-interval must be >= 1, got {self.tensorboard_log_interval}")
        _require(self.empty_unused_memory_level in (0, 1, 2),
                 f"--empty-unused-memory-level must be 0, 1 or 2, got {self.empty_unused_memory_level}")
        _require(0 <= self.profile_step_start < self.profile_step_end,
                 f"--profile-step-start {self.profile_step_start} must be >= 0 and below --profile-step-end "
                 f"{self.profile_step_end}")
        if self.profile_ranks is not None:
            object.__setattr__(self, "profile_ranks", tuple(int(r) for r in self.profile_ranks))
        from .rules import check_max_skipped_steps, parse_signal

        _require(self.train_iters >= 1, f"--train-iters must be >= 1, got {self.train_iters}")
        object.__setattr__(self, "exit_signal", parse_signal(self.exit_signal).name)
        _require(self.exit_signal not in ("SIGKILL", "SIGSTOP"), f"--exit-signal {self.exit_signal} cannot be handled")
        d = self.exit_duration_in_mins
        _require(d is None or 0 < d < math.inf, f"--exit-duration-in-mins must be a positive number, got {d}")
        check_max_skipped_steps(self.max_skipped_steps)
        _require(0 <= self.seed <= MAX_SEED,
                 f"--seed must be in [0, 2**32 - 1] (numpy seeds the data order), got {self.seed}")
        _require(self.global_batch_size >= 1, f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        for name in ("log_interval", "eval_interval", "save_interval", "exit_interval"):
            v = getattr(self, name)
            _require(v is None or v >= 1, f"--{name.replace('_', '-')} must be >= 1, got {v}")
        _require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        _require(self.save_interval is None or self.save is not None, "--save-interval needs --save DIR")
        for name in ("finetune", "no_load_optim", "no_load_rng", "skip_train"):
            _require(not getattr(self, name) or self.load is not None, f"--{name.replace('_', '-')} needs --load DIR")
        _require(self.ckpt_format in CKPT_FORMATS,
                 f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, got {self.ckpt_format}")
        _require(not self.async_save or self.ckpt_format == "torch_dist", "--async-save needs --ckpt-format torch_dist")
        _require(not self.async_save or self.save is not None, "--async-save needs --save DIR")
        _require(not self.overwrite_save or self.save is not None, "--overwrite-save needs --save DIR")


@dataclass(frozen=True)
class DataConfig:
    """Indexed dataset prefixes (or a weighted blend), the split, and the tokenizer's files."""

    data_path: tuple[str, ...]
    split: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    mask_prob: float = 0.15  # BERT only
    short_seq_prob: float = 0.1  # BERT only
    # GPT batches as Megatron's get_ltor_masks_and_position_ids (models/gpt.py): no loss on the token
    # after an EOD, positions restarting after each EOD, attention not crossing an EOD
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    mock_data: bool = False  # synthetic documents (data/mock.py) instead of --data-path
    vocab_size: int | None = None  # --tokenizer-type NullTokenizer: ids 0..N-1, eod N
    data_cache_path: str | None = None  # where the GPT sample indices are cached (default: not cached)
    # Megatron's per-split data (--train-data-path, ...): each split reads all documents of its own prefixes
    train_data_path: tuple[str, ...] | None = None
    valid_data_path: tuple[str, ...] | None = None
    test_data_path: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("train_data_path", "valid_data_path", "test_data_path"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))
        _require(not (self.data_path and self.split_paths), "give --data-path with --split, or --train-data-path / "
                 "--valid-data-path / --test-data-path, not both")
        _require(not (self.mock_data and self.split_paths), "give --mock-data or per-split data paths, not both")

    @property
    def split_paths(self) -> tuple[tuple[str, ...] | None, ...] | None:
        """(train, valid, test) data of --train-data-path and its kin, or None when none is given."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(paths) else None

    @property
    def all_data_paths(self) -> tuple[str, ...]:
        """Every --data-path-style token of this run (--data-path, or the per-split paths one after another)."""
        return self.data_path or tuple(t for p in (self.split_paths or ()) if p for t in p)


# Megatron's --attention-backend: auto (torch's scaled_dot_product_attention picks its kernel), flash and fused
# (only its fused kernels: flash / memory-efficient, no s^2 tensor kept), unfused and local (softmax(QK^T) with
# dropout written out, Megatron's DotProductAttention: the s^2 scores, mask and probabilities are kept)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


@dataclass(frozen=True)
class SystemConfig:
    """Where the run executes: the resolved device, the process-group backend and kernels."""

    device: str  # resolved: "cpu" or "cuda"
    backend: str
    timeout_minutes: float = 10.0
    fused_kernels: str = "auto"
    stall_timeout_s: float = 45.0  # name a rank that stops making progress this long (0: off)
    # --use-cpu-initialization: full weights drawn on the CPU and split (layout-independent); off
    # (Megatron's default): each rank draws its own shards on its device (tensor_parallel/init.py)
    use_cpu_initialization: bool = False
    attention_backend: str = "auto"  # Megatron's --attention-backend (ATTENTION_BACKENDS)

    def __post_init__(self) -> None:
        _require(self.attention_backend in ATTENTION_BACKENDS, f"--attention-backend must be one of "
                 f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        from .rules import check_stall_timeout

        check_stall_timeout(self.stall_timeout_s)
        _require(self.stall_timeout_s < math.inf, f"--stall-timeout-s must be finite, got {self.stall_timeout_s}")
        _require(
            0 < self.timeout_minutes < math.inf,
            f"--distributed-timeout-minutes must be a positive finite number, got {self.timeout_minutes}",
        )
        _require(
            not (self.backend == "nccl" and self.device != "cuda"),
            "--distributed-backend nccl needs --device cuda (use gloo on CPU)",
        )
        _require(  # gloo has no CUDA reduce-scatter / all-gather-into-tensor and is slow for CUDA p2p
            not (self.backend == "gloo" and self.device == "cuda"),
            "--distributed-backend gloo is not supported with --device cuda (use nccl on GPUs)",
        )


@dataclass(frozen=True)
class Layout:
    """The choices the layout flags make and ``--auto-plan`` makes instead: t, d, b, recompute, schedule,
    the stage split (``None``: even) and whether the optimizer is distributed over the replicas."""

    tensor: int
    pipeline: int
    micro_batch_size: int | None
    recompute: bool
    schedule: str
    layer_split: tuple[int, ...] | None = None
    distributed_optimizer: bool = False  # the planner's choice of --use-distributed-optimizer
    # the planner's recomputation inside stages (--recompute-granularity/-method/-num-layers); None: none
    recompute_policy: RecomputePolicy | None = None
    virtual_stages: int | None = None  # model chunks per rank (--virtual-pipeline-model-parallel-size)
    context: int = 1  # --context-parallel-size
    cp_comm_type: str = P2P  # --cp-comm-type

    @classmethod
    def of(cls, axes: Axes, micro_batch_size: int, recompute: bool, schedule: str, **choices: Any) -> Layout:
        """The layout flags of a planned ``axes`` (its data width follows from the world; its chunks from the
        schedule); ``choices``: the other fields (stage split, distributed optimizer, recompute policy,
        ``cp_comm_type``)."""
        return cls(axes.tensor, axes.pipeline, micro_batch_size, recompute, schedule, context=axes.context, **choices)


def layout_configs(
    layout: Layout, model: ModelConfig, global_batch_size: int | None, world_size: int, p2p_mode: str = "auto",
) -> tuple[ParallelConfig, PipelineConfig, int]:
    """(ParallelConfig, PipelineConfig, global batch B) of ``layout``, checked against the model and world.

    ``B`` defaults to ``b * w * d`` (``m = d``: the fewest microbatches PipeDream-2BW allows, and a
    small bubble for the flushing schedules); the microbatches per step and pipeline are ``m = B / (b * w)``.
    """
    par = ParallelConfig(layout.tensor, layout.pipeline, context=layout.context, cp_comm_type=layout.cp_comm_type)
    model.check_tensor_parallel(par.tensor)
    model.check_sequence_parallel(par.tensor)
    model.check_context_parallel(par.context, par.tensor, par.cp_comm_type)
    split = canonical_split(model.num_layers, par.pipeline, layout.layer_split)
    layers_per_stage(model.num_layers, par.pipeline, split)  # refuses an even split that does not divide
    par = par.resolve(world_size)
    b, w = layout.micro_batch_size, par.data
    _require(b is not None, "--micro-batch-size is required (or give --auto-plan)")
    _require(b >= 1, f"--micro-batch-size must be >= 1, got {b}")
    B = global_batch_size if global_batch_size is not None else b * w * par.pipeline
    _require(B >= 1, f"--global-batch-size must be >= 1, got {B}")
    _require(
        B % (b * w) == 0,
        f"--global-batch-size {B} is not divisible by --micro-batch-size {b} x data-parallel size {w}",
    )
    policy = layout.recompute_policy
    inner = ({"recompute_granularity": policy.granularity, "recompute_method": policy.method,
              "recompute_num_layers": policy.num_layers} if policy is not None and policy.active else {})
    name, pv = parse_schedule_id(layout.schedule)  # the planner's id: zb-h2+pv is zb-h2 with post-validation
    pipe = PipelineConfig(name, b, B // (b * w), recompute=layout.recompute, p2p_mode=p2p_mode,
                          layer_split=split, virtual_stages=layout.virtual_stages, post_validation=pv, **inner)
    pipe.check_depth(par.pipeline)
    if pipe.chunks > 1:
        _require(split is None, f"{layout.schedule} runs {pipe.chunks} model chunks per rank: it needs the even stage "
                                "split (no --pipeline-layer-split)")
        check_virtual_split(model.num_layers, par.pipeline, pipe.chunks)
    return par, pipe, B


def gqa_kernel_problem(backend: str, device: str, gqa: bool, masked: str | None, dtype: str) -> str | None:
    """Why SDPA has no CUDA kernel for this attention, or None. With grouped-query attention only the flash
    kernel takes ``enable_gqa`` there, and flash takes no mask and no fp32, so ``fused``/``flash`` would
    fail at the first forward ("No available kernel"); so would ``flash`` in fp32 without it."""
    if device == "cuda" and backend == "flash" and dtype == "fp32":
        return ("--attention-backend flash in fp32 on CUDA: SDPA's flash kernel takes fp16 and bf16 only; use fused, "
                "auto or unfused")
    if device != "cuda" or backend not in ("flash", "fused") or not gqa or not (masked or dtype == "fp32"):
        return None
    why = masked if masked else "fp32"
    return (f"--attention-backend {backend} with grouped-query attention and {why}: on CUDA only the flash kernel "
            f"takes grouped key/value heads, and it takes no mask or fp32; use --attention-backend unfused (or bf16 "
            f"without the mask)")


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

    SECTIONS = ("model", "parallel", "pipeline", "optimizer", "lr", "training", "data", "system")

    def __post_init__(self) -> None:
        # --lr is the optimizer's base rate (Muon's --muon-lr ratio) and the schedule's peak: one value, two sections
        _require(self.optimizer.lr == self.lr.lr,
                 f"the optimizer's lr {self.optimizer.lr} and the schedule's lr {self.lr.lr} differ: --lr sets both "
                 "(a config file or a program must give them one value)")
        self.axes  # noqa: B018 - the named axes validate themselves (experts folded inside data x context)
        if self.pipeline.compensation == AUTO_COMPENSATION:  # the flag's default: what the measurements favour
            o = self.optimizer
            mode = resolve_compensation(AUTO_COMPENSATION, self.pipeline.spec.stale_steps, o.optimizer, o.dtype,
                                        o.use_distributed_optimizer, o.sgd_momentum)
            object.__setattr__(self, "pipeline", replace(self.pipeline, compensation=mode))
        _require(not (self.optimizer.use_distributed_optimizer and self.pipeline.compensation == "predict"),
                 "--use-distributed-optimizer does not support --2bw-compensation predict (its predicted weights "
                 "would need a full gather at every drain); use ef (the update-level correction docs/training.md "
                 "recommends after predict), dc or none")
        _require(not (self.training.save and self.training.ckpt_format == "torch" and self.parallel.pipeline > 1
                      and self.pipeline.spec.placement(
                          self.parallel.pipeline).shape != "interleaved"),
                 f"--ckpt-format torch cannot hold {self.pipeline.schedule}'s V layout yet: save with --ckpt-format "
                 "torch_dist (its tensors are global)")
        _require(not (self.optimizer.optimizer == "muon" and self.pipeline.compensation == "predict"),
                 "--2bw-compensation predict extrapolates Adam or SGD steps only: use ef or dc with --optimizer muon")
        _require(not (self.data.reset_position_ids and self.model.position_embedding_type == "rope"),
                 "--reset-position-ids resets learned absolute positions; with --position-embedding-type rope the "
                 "rotary positions are not reset (use --reset-attention-mask to keep documents apart)")
        _require(not (self.pipeline.p2p_mode == "prefetch" and self.system.backend == "nccl"),
                 "--p2p-mode prefetch deadlocks on NCCL (its receives posted ahead of the sends to the same peer "
                 "block each other); use --p2p-mode grouped or auto with --distributed-backend nccl")
        _require(not (self.system.attention_backend in ("flash", "fused") and self.system.device == "cpu"
                       and self.model.attention_dropout > 0),
                 f"--attention-backend {self.system.attention_backend} with --attention-dropout "
                 f"{self.model.attention_dropout} on the CPU: torch's CPU flash kernel has no dropout (use auto, "
                 "unfused or --attention-dropout 0)")
        masked = "BERT's padding mask" if self.model.family.padding_mask else \
            "--reset-attention-mask's mask" if self.data.reset_attention_mask else \
            "--cp-comm-type all_gather's causal prefix mask" if self.parallel.context > 1 and \
            self.parallel.cp_comm_type == ALL_GATHER else None
        _require(not (self.system.attention_backend == "flash" and masked),
                 f"--attention-backend flash takes no attention mask ({masked}): use fused, auto or unfused")
        problem = gqa_kernel_problem(self.system.attention_backend, self.system.device,
                                     self.model.query_groups != self.model.num_attention_heads, masked,
                                     self.optimizer.dtype)
        _require(problem is None, problem or "")

    @property
    def axes(self) -> Axes:
        """The run's layout as its named axes: the parallel sizes, the experts' and the pipeline's chunks."""
        moe = self.model.moe
        return self.parallel.axes(moe.expert_model_parallel_size if moe is not None else 1, self.pipeline.chunks)

    @property
    def tied_across_ranks(self) -> bool:
        """Whether the tied word embedding is summed between two ranks: the output layer shares it and the
        first and the last stage are on different ranks (not in a V placement, which holds both on rank 0).
        Without it the run makes no embedding group (on NCCL, a communicator with its own device memory)."""
        return self.model.tied_output and self.pipeline.spec.placement(self.parallel.pipeline).ends_apart

    def with_vocab(self, vocab_size: int) -> "RunConfig":
        """The model's vocabulary is the tokenizer's (as in Megatron)."""
        return replace(self, model=replace(self.model, vocab_size=vocab_size))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able nested dict of every section (stored in checkpoints and the metrics file)."""
        return {"kind": self.kind, **{name: asdict(getattr(self, name)) for name in self.SECTIONS}}
