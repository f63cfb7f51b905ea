"""The optimizer, precision and learning-rate sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rules import FP16_MAX, _require, _require_finite

DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd", "muon")  # optimizer/flat.py, optimizer/muon.py
MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
# 2BW stale-gradient compensation (pipeline/compensation.py)
COMPENSATIONS = ("none", "predict", "dc", "ef", "extrapolate")
AUTO_COMPENSATION = "auto"  # --2bw-compensation's default: resolve_compensation picks by the measurements


def resolve_compensation(mode: str, stale_steps: int, optimizer: str, dtype: str, distributed_optimizer: bool,
                         sgd_momentum: float = 0.0) -> str:
    """``--2bw-compensation auto`` (the flag's default) as the measurements favour it
    (``docs/data/convergence_optimizers.json``, ``docs/benchmarks.md`` section 3): none for a schedule
    without stale gradients; ``ef`` with Muon (2BW + ef matched or beat Flush where plain 2BW did not);
    ``predict`` with Adam, or SGD with momentum, in bf16/fp16 without the distributed optimizer (better
    than plain 2BW in every measured regime and seed, and free there: the master holds the newest
    weights anyway); otherwise none (predict would cost a weight copy in fp32, and is refused with the
    distributed optimizer). Any other ``mode`` is returned as given."""
    if mode != AUTO_COMPENSATION:
        return mode
    if stale_steps == 0:  # the schedule's staleness (ScheduleSpec.stale_steps)
        return "none"
    if optimizer == "muon":
        return "ef"
    if dtype != "fp32" and not distributed_optimizer and (optimizer == "adam" or sgd_momentum > 0):
        return "predict"
    return "none"



def fp32_grads_for(dtype: str, given: bool | None = None) -> bool:
    """The gradient-accumulation rule: fp32 in fp32 training; with bf16 unless ``given`` is False (Megatron
    forces it there); with fp16 only when ``given`` is True."""
    if dtype == "fp32":
        return True
    return dtype == "bf16" if given is None else bool(given)


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, precision and gradient handling (shared by every schedule)."""

    optimizer: str = "adam"
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    # --optimizer muon (optimizer/muon.py): Muon on the tensor-parallel linear weights, AdamW elsewhere
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_lr: float | None = None  # the matrices' peak learning rate; None: --lr
    muon_adjust_lr_fn: str = "original"  # torch.optim.Muon's shape scale: original or match_rms_adamw
    clip_grad: float = 1.0  # 0 disables clipping
    dtype: str = "fp32"
    loss_scale: float | None = None  # fp16: None = dynamic scaling
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    dp_bucket_mb: float = 25.0
    # gradients accumulate over the microbatches and are all-reduced in fp32 (Megatron's
    # --accumulate-allreduce-grads-in-fp32); None: on for bf16 (as Megatron forces it), off for fp16
    accumulate_allreduce_grads_in_fp32: bool | None = None
    # ZeRO-1 (Megatron's --use-distributed-optimizer): fp32 master and optimizer state sharded over the
    # data-parallel group; gradients reduce-scattered, updated shards all-gathered
    use_distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        _require(self.optimizer in OPTIMIZERS,
                 f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        _require(self.dtype in DTYPES, f"precision must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require_finite(self)
        _require(self.lr >= 0, f"--lr must be >= 0, got {self.lr}")
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.adam_eps > 0,
                 f"--adam-eps must be positive (it keeps Adam's denominator off zero), got {self.adam_eps}")
        _require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "--adam-beta1/2 must be in [0, 1)")
        _require(0 <= self.sgd_momentum < 1, f"--sgd-momentum must be in [0, 1), got {self.sgd_momentum}")
        self._check_muon()
        self._check_loss_scale()

    def _check_muon(self) -> None:
        _require(0 <= self.muon_momentum < 1, f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        _require(isinstance(self.muon_ns_steps, int) and 1 <= self.muon_ns_steps < 100,
                 f"--muon-ns-steps must be an integer in [1, 100), got {self.muon_ns_steps}")
        _require(self.muon_lr is None or self.muon_lr >= 0, f"--muon-lr must be >= 0, got {self.muon_lr}")
        _require(self.muon_adjust_lr_fn in MUON_ADJUST_LR_FNS,
                 f"--muon-adjust-lr-fn must be one of {', '.join(MUON_ADJUST_LR_FNS)}, got {self.muon_adjust_lr_fn!r}")

    def _check_loss_scale(self) -> None:
        s = self.loss_scale
        _require(s is None or s > 0, f"--loss-scale must be positive, got {s}")
        _require(
            s is None or self.dtype != "fp16" or s <= FP16_MAX,
            f"--loss-scale {s} is above fp16's largest value {FP16_MAX:g}: every scaled loss >= 1 would overflow "
            "and every step be skipped (leave --loss-scale unset for dynamic scaling)",
        )
        _require(self.initial_loss_scale > 0, f"--initial-loss-scale must be positive, got {self.initial_loss_scale}")
        _require(self.min_loss_scale > 0, f"--min-loss-scale must be positive, got {self.min_loss_scale}")
        _require(self.loss_scale_window >= 1, f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def fp32_grads(self) -> bool:
        """Whether gradients accumulate and are all-reduced in fp32 (always, when the model is fp32)."""
        return fp32_grads_for(self.dtype, self.accumulate_allreduce_grads_in_fp32)

    @property
    def grad_dtype(self) -> str:
        """The precision of the gradient buffers: ``fp32`` or the model's."""
        return "fp32" if self.fp32_grads else self.dtype

    @property
    def torch_grad_dtype(self):
        import torch

        return torch.float32 if self.fp32_grads else self.torch_dtype


DECAY_STYLES = ("linear", "cosine", "constant", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")  # Megatron's --lr-wsd-decay-style


@dataclass(frozen=True)
class LRConfig:
    """Megatron's learning-rate schedule: linear warm-up, then linear/cosine/constant/inverse-square-root/WSD
    decay to min_lr (training/lr_schedule.py)."""

    lr: float
    min_lr: float = 0.0
    decay_style: str = "linear"
    warmup_iters: int = 0
    decay_iters: int = 1
    samples_per_step: int | None = None  # --train-samples: warm-up and decay are counted in samples
    wsd_decay_style: str = "exponential"  # WSD: the shape of the final anneal
    # WSD: length of the anneal that ends at decay_iters (samples with --train-samples)
    wsd_decay_iters: int | None = None
    # inverse-square-root without warm-up: Megatron divides by sqrt(consumed samples), which needs the batch
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        _require(self.decay_style in DECAY_STYLES, f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}")
        _require(self.wsd_decay_style in WSD_DECAY_STYLES,
                 f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}")
        if self.decay_style == "WSD":
            w = self.wsd_decay_iters
            _require(w is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
            _require(1 <= w <= self.decay_iters,
                     f"--lr-wsd-decay-iters {w} must be in [1, the decay iterations {self.decay_iters}]")
        _require_finite(self)
        _require(self.lr > 0, f"--lr must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"--min-lr {self.min_lr} must be in [0, --lr {self.lr}]")
        _require(self.warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.warmup_iters}")
        _require(self.decay_iters >= 1, f"--lr-decay-iters must be >= 1, got {self.decay_iters}")
        _require(
            self.warmup_iters <= self.decay_iters,
            f"--lr-warmup-iters {self.warmup_iters} exceeds the decay iterations {self.decay_iters}",
        )


def lr_by_samples(given: dict[str, Any], train_samples: int, decay_samples: int | None, warmup_samples: int | None,
                  global_batch: int) -> LRConfig:
    """Megatron's sample-based schedule (``--train-samples``): warm-up and decay counted in consumed samples."""
    decay = decay_samples if decay_samples is not None else train_samples
    return LRConfig(**{**given, "decay_iters": decay, "warmup_iters": warmup_samples or 0,
                       "samples_per_step": global_batch})


