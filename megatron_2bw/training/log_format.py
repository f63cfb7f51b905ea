"""Megatron-LM's log lines, field for field, so Megatron log parsers and dashboards read ours.

The training line is Megatron's ``training_log`` line (timestamp, ``iteration N/T``,
``consumed samples:``, elapsed ms, ``learning rate:``, ``global batch size:``, one
``<name>: <value>`` per loss, ``loss scale:``, ``grad norm:``, ``number of skipped
iterations:``, ``number of nan iterations:``) with this project's fields after Megatron's:
samples/s, tokens/s, memory, TFLOP/s per device and MFU. The validation line and the memory
report are Megatron's too.

Numbering: ``iteration N`` is the N-th completed optimizer step (1-based) in every line, the
training line, the validation line and the checkpoint line alike. The engine counts steps
from 0; :func:`iteration_of_step` converts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

_MB = 2**20
# Megatron prints PPL for every loss; a perplexity is only meaningful for a token-level LM loss.
PPL_KEYS = ("lm loss",)


def iteration_of_step(step: int) -> int:
    """The 1-based Megatron iteration number of the engine's 0-based step index."""
    if step < 0:
        raise ValueError(f"step index must be >= 0, got {step}")
    return step + 1


def timestamp(now: datetime | None = None) -> str:
    """Megatron's ``[YYYY-mm-dd HH:MM:SS]`` prefix (local time, as Megatron prints it)."""
    return f"[{(now or datetime.now()).strftime('%Y-%m-%d %H:%M:%S')}]"


@dataclass(frozen=True)
class MemoryReading:
    """Peak memory of the largest rank/stage: CUDA's allocator peak, or the engine's byte counts."""

    peak_bytes: int
    source: str  # "cuda": torch.cuda.max_memory_allocated; "engine": weights+grads+optimizer+stash

    def field(self) -> str:
        label = "max allocated (MB)" if self.source == "cuda" else "engine memory (MB)"
        return f" {label}: {self.peak_bytes / _MB:.1f} |"


def memory_from_stages(stages: Sequence[Mapping[str, int | float | None]]) -> MemoryReading | None:
    """The largest stage's CUDA peak when any stage reports one, else its engine byte count.

    ``stages`` are the per-stage statistics the loop gathers (``weight_bytes``, ``grad_bytes``,
    ``optimizer_bytes``, ``peak_stashed_bytes``, ``cuda_peak_bytes``).
    """
    cuda = [int(s["cuda_peak_bytes"]) for s in stages if s.get("cuda_peak_bytes")]
    if cuda:
        return MemoryReading(max(cuda), "cuda")
    keys = ("weight_bytes", "grad_bytes", "optimizer_bytes", "peak_stashed_bytes")
    totals = [sum(int(s.get(k) or 0) for k in keys) for s in stages]
    return MemoryReading(max(totals), "engine") if totals and max(totals) > 0 else None


def _loss_fields(losses: Mapping[str, float | None]) -> str:
    """`` <name>: <value> |`` per finite loss, in Megatron's ``{:.6E}`` (a window with no finite loss prints none)."""
    return "".join(f" {k}: {v:.6E} |" for k, v in losses.items() if v is not None and math.isfinite(v))


def train_log_line(
    *, iteration: int, train_iters: int, consumed_samples: int, ms_per_iter: float, lr: float, global_batch: int,
    losses: Mapping[str, float | None], loss_scale: float, grad_norm: float | None, skipped: int, nan: int,
    samples_per_sec: float, tokens_per_sec: float, memory: MemoryReading | None = None,
    tflops_per_device: float | None = None, peak_tflops: float | None = None, now: datetime | None = None,
    bubble: Sequence[float | None] | None = None,
) -> str:
    """Megatron's training line, then samples/s, tokens/s, memory, TFLOP/s/device and MFU.

    ``losses`` maps Megatron's loss names to window means: ``{"lm loss": x}`` for GPT,
    ``{"lm loss": mlm, "sop loss": sop}`` for BERT. ``skipped`` counts steps the optimizer
    skipped (fp16 overflow); ``nan`` counts steps whose loss was not finite. MFU is printed
    only when ``peak_tflops`` (the device's dense peak in the run's precision) is known. ``bubble``:
    each pipeline stage's measured idle fraction over the window, printed ``bubble: s0 0.12 s1 0.03 |``.
    """
    s = f" {timestamp(now)} iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    s += f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
    s += f" learning rate: {lr:.6E} |"
    s += f" global batch size: {global_batch:5d} |"
    s += _loss_fields(losses)
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None and math.isfinite(grad_norm):
        s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan:3d} |"
    s += f" samples/s: {samples_per_sec:.2f} | tokens/s: {tokens_per_sec:.0f} |"
    if memory is not None:
        s += memory.field()
    if tflops_per_device is not None:
        s += f" TFLOP/s/device: {tflops_per_device:.4f} |"
        if peak_tflops:
            s += f" MFU: {100.0 * tflops_per_device / peak_tflops:.2f}% |"
    if bubble:
        s += bubble_field(bubble)
    return s


def bubble_field(bubble: Sequence[float | None]) -> str:
    """`` bubble: s0 0.12 s1 0.03 |``: each stage's idle fraction (``-`` where not measured)."""
    return " bubble:" + "".join(f" s{r} {v:.2f}" if v is not None else f" s{r} -" for r, v in enumerate(bubble)) + " |"


def parse_bubble(line: str) -> list[float | None] | None:
    """The per-stage bubble of a training line (:func:`bubble_field`), or None when it has none."""
    m = re.search(r" bubble:((?: s\d+ (?:[0-9.]+|-))+) \|", line)
    if m is None:
        return None
    vals = m.group(1).split()[1::2]
    return [None if v == "-" else float(v) for v in vals]


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def window_losses(window: Sequence[Mapping], keys: Mapping[str, str]) -> tuple[dict[str, float | None], int]:
    """(Megatron loss name -> mean over the window, count of steps with a non-finite loss).

    As in Megatron, steps the optimizer skipped are left out of the means. ``keys`` maps a
    Megatron loss name to the record field that holds it (``{"lm loss": "loss"}``).
    """
    kept = [r for r in window if not r.get("skipped")]
    means: dict[str, float | None] = {}
    for name, field in keys.items():
        vals = [r[field] for r in kept if _finite(r.get(field))]
        means[name] = sum(vals) / len(vals) if vals else None
    nan = sum(1 for r in window if any(f in r and not _finite(r[f]) for f in keys.values()))
    return means, nan


def window_line(window: Sequence[Mapping], *, completed: int, train_iters: int, global_batch: int, seq_length: int,
                stages: Sequence[Mapping] = (), loss_keys: Mapping[str, str] | None = None,
                peak_tflops: float | None = None, now: datetime | None = None,
                bubble: Sequence[float | None] | None = None) -> str:
    """The training line of one log window of the loop's per-step records.

    A record has ``loss`` (or the fields named in ``loss_keys``; BERT: ``{"lm loss": "lm_loss",
    "sop loss": "sop_loss"}``), ``lr``, ``grad_norm``, ``loss_scale``, ``skipped``,
    ``step_time_s``, ``consumed_samples`` and ``tflops_per_device``; ``completed`` is the
    number of completed steps at the window's end (the 1-based iteration of its last step).
    TFLOP/s/device and MFU are the window's (all its FLOPs over all its time).
    """
    if not window:
        raise ValueError("a log window needs at least one step")
    losses, nan = window_losses(window, loss_keys or {"lm loss": "loss"})
    last = window[-1]
    time_s = sum(r["step_time_s"] for r in window) / len(window)
    # the window's TFLOP/s, as Megatron's (FLOPs per step over the mean step time): every step's FLOPs
    # over every step's time, not the last step's value (a step cut short at a segment end spikes)
    tflops = None
    if time_s > 0 and all(r.get("tflops_per_device") is not None for r in window):
        tflops = sum(r["tflops_per_device"] * r["step_time_s"] for r in window) / (time_s * len(window))
    return train_log_line(
        iteration=completed, train_iters=train_iters, consumed_samples=int(last["consumed_samples"]),
        ms_per_iter=1e3 * time_s, lr=last["lr"], global_batch=global_batch, losses=losses,
        loss_scale=last["loss_scale"], grad_norm=last["grad_norm"], skipped=sum(bool(r["skipped"]) for r in window),
        nan=nan, samples_per_sec=global_batch / time_s, tokens_per_sec=global_batch * seq_length / time_s,
        memory=memory_from_stages(stages), tflops_per_device=tflops, peak_tflops=peak_tflops,
        now=now, bubble=bubble,
    )


def validation_line(iteration: int, losses: Mapping[str, float], *, split: str = "valid", final: bool = False,
                    ppl_keys: Sequence[str] = PPL_KEYS) -> str:
    """Megatron's evaluation line: `` validation loss at iteration N | lm loss value: ... | lm loss PPL: ... |``.

    During training the prefix is ``iteration N``; the evaluations after training say
    ``iteration N on validation set`` / ``iteration N on test set`` (Megatron's wording).
    PPL is printed for ``ppl_keys`` only (BERT: the MLM loss, not the sentence-order loss).
    """
    if split not in ("valid", "test"):
        raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
    prefix = f"iteration {iteration}"
    if final or split == "test":
        prefix += " on validation set" if split == "valid" else " on test set"
    s = f" validation loss at {prefix} | "
    for key, value in losses.items():
        s += f"{key} value: {value:.6E} | "
        if key in ppl_keys:
            s += f"{key} PPL: {math.exp(min(20.0, value)):.6E} | "
    return s


def framed(line: str) -> str:
    """Megatron prints the validation line between two rules of dashes one longer than the line."""
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def saved_checkpoint_line(iteration: int, path: str, seconds: float) -> str:
    """Megatron's ``successfully saved checkpoint from iteration`` line (``iteration`` = completed steps)."""
    return f"  successfully saved checkpoint from iteration {iteration:7d} to {path} ({seconds:.2f} s)"


def _hms(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def eta_line(iteration: int, train_iters: int, start_iteration: int, elapsed_s: float) -> str:
    """A plain-text progress line for logs that are not terminals (where no progress bar is drawn).

    The rate counts the steps of this run only (``iteration - start_iteration``), so a resumed
    run does not claim the resumed steps as its own speed.
    """
    done = iteration - start_iteration
    rate = done / elapsed_s if elapsed_s > 0 and done > 0 else 0.0
    remaining = _hms((train_iters - iteration) / rate) if rate > 0 else "?:??:??"
    # not "iteration N/T": Megatron log parsers key on that pattern, and this is no training line
    return (f" [ETA] {iteration} of {train_iters} iterations done | elapsed {_hms(elapsed_s)} | "
            f"remaining {remaining} | {rate:.2f} it/s")


@dataclass(frozen=True)
class CudaMemory:
    """torch.cuda's allocator counters in bytes (Megatron's ``report_memory``)."""

    allocated: int
    max_allocated: int
    reserved: int
    max_reserved: int


def cuda_memory(device=None) -> CudaMemory | None:
    """This process's CUDA allocator counters, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return CudaMemory(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                      torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device))


def memory_report_line(rank: int, iteration: int, cuda: CudaMemory | None = None,
                       stages: Sequence[Mapping[str, int | float | None]] = ()) -> str:
    """Megatron's one-time ``[Rank r] (after N iterations) memory (MB) | allocated: ...`` report.

    Without CUDA, the engine's byte counts per stage take the allocator's place (weights,
    gradients, optimizer state, peak stashed activations).
    """
    s = f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
    if cuda is not None:
        return (s + f" | allocated: {cuda.allocated / _MB:.2f} | max allocated: {cuda.max_allocated / _MB:.2f}"
                f" | reserved: {cuda.reserved / _MB:.2f} | max reserved: {cuda.max_reserved / _MB:.2f}")
    for st in stages:
        s += (f" | stage {st['stage']}: weights: {(st.get('weight_bytes') or 0) / _MB:.2f}"
              f" grads: {(st.get('grad_bytes') or 0) / _MB:.2f}"
              f" optimizer: {(st.get('optimizer_bytes') or 0) / _MB:.2f}"
              f" peak stashed: {(st.get('peak_stashed_bytes') or 0) / _MB:.2f}")
    return s


def peak_tflops_of(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of a known GPU in ``precision``, else None (``planner.peaks.peak_tflops``)."""
    from ..planner.peaks import peak_tflops

    return peak_tflops(device_name, precision)


__all__ = [
    "CudaMemory", "MemoryReading", "PPL_KEYS", "bubble_field", "cuda_memory", "eta_line", "framed", "iteration_of_step",
    "memory_from_stages", "memory_report_line", "parse_bubble", "peak_tflops_of", "saved_checkpoint_line", "timestamp",
    "train_log_line", "validation_line", "window_line", "window_losses",
]


def _optimizer_choice(opt) -> str:
    if opt.optimizer == "muon":
        lr = f", matrices' lr {opt.muon_lr:g}" if opt.muon_lr is not None else ""
        out = f"Muon (momentum {opt.muon_momentum:g}, {opt.muon_ns_steps} NS steps{lr}; AdamW elsewhere)"
    elif opt.optimizer == "sgd":
        out = f"SGD (momentum {opt.sgd_momentum:g})"
    else:
        out = f"Adam (betas {opt.adam_beta1:g}/{opt.adam_beta2:g})"
    out += f", clip {opt.clip_grad:g}" if opt.clip_grad else ", no clipping"
    return out + (", distributed" if opt.use_distributed_optimizer else "")


def _schedule_choice(pipe) -> str:
    out = pipe.schedule
    if pipe.virtual_stages and pipe.virtual_stages > 1:
        out += f" ({pipe.virtual_stages} chunks per rank)"
    if pipe.post_validation:
        out += " +post-validation"
    if pipe.spec.stale_steps > 0:  # a schedule whose gradients are stale (2BW) takes a compensation
        comp = {"dc": f"dc (lambda {pipe.dc_lambda:g})", "ef": f"ef (gamma {pipe.ef_scale:g})",
                "extrapolate": f"extrapolate (gamma {pipe.ef_scale:g})"}.get(pipe.compensation, pipe.compensation)
        out += f", 2BW compensation {comp}"
    return out


def _precision_choice(opt) -> str:
    fp32 = opt.accumulate_allreduce_grads_in_fp32
    fp32 = opt.dtype == "bf16" if fp32 is None else fp32
    out = opt.dtype + (" (fp32 gradient accumulation)" if fp32 and opt.dtype != "fp32" else "")
    if opt.dtype == "fp16":
        out += f", loss scale {opt.loss_scale:g}" if opt.loss_scale is not None else ", dynamic loss scale"
    return out


def math_choices(cfg) -> str:
    """Every choice that changes the numbers a run computes, for its start-up line: the model family's
    features, sequence parallelism, the optimizer, the schedule with 2BW's compensation, the precision.
    (Layout and kernels are named beside it; there is no context parallelism in this trainer.)"""
    sp = "on" if cfg.model.sequence_parallel else "off"
    return (f"model {', '.join(cfg.model.features())} | sequence parallel {sp}"
            f" | optimizer {_optimizer_choice(cfg.optimizer)}"
            f" | schedule {_schedule_choice(cfg.pipeline)} | precision {_precision_choice(cfg.optimizer)}")
