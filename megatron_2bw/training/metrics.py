"""What a run reports: log lines, a JSONL metrics file, TensorBoard events and a progress bar.

Only the logging rank (global rank 0) holds a ``Metrics``; it receives every number already
reduced (see ``loop.py``). The metrics file gets one JSON object per line; its keys are
documented in docs/training.md. Non-finite numbers (an overflowed gradient norm) are written
as ``null`` so the file stays strict JSON. TensorBoard (``--tensorboard-dir``) and Weights &
Biases (``--wandb-project``) writers belong to it; their packages are checked at start-up
(``launch.py``). The tqdm bar appears only when stderr is a terminal; elsewhere the loop logs a
plain ETA line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

from .log_format import framed, iteration_of_step, validation_line
from .supervision import os_error_line
from .tb_writer import open_tensorboard
from .wandb_writer import WandbSettings, open_wandb

log = logging.getLogger("megatron_2bw")

_MB = 2**20


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class _TqdmHandler(logging.Handler):
    """Writes log records above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never kill training
            self.handleError(record)


def setup_logging(rank: int) -> None:
    """INFO on rank 0; warnings and errors only (prefixed with the rank) elsewhere."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class MetricsWriteError(RuntimeError):
    """The metrics file could not be written; the message is one line naming the file and the errno."""


class Metrics:
    """The logging rank's sinks: the JSONL file, TensorBoard/wandb writers, the progress bar.

    ``iteration`` in the JSONL records is the engine's 0-based step index (docs/training.md);
    log lines and the TensorBoard/wandb step are the 1-based Megatron iteration.
    """

    def __init__(self, *, path: str | None, tensorboard_dir: str | None, train_iters: int, start_iter: int,
                 progress: bool | None = None, wandb: WandbSettings | None = None, config: dict | None = None,
                 tensorboard_log_interval: int = 1, log_timers: bool = False) -> None:
        self.file = None
        # --tensorboard-log-interval: training scalars every this many iterations; --log-timers-to-tensorboard
        self.tb_interval, self.log_timers = tensorboard_log_interval, log_timers
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")
        self.writers = [w for w in (open_tensorboard(tensorboard_dir), open_wandb(wandb, config=config)) if w]
        self.bar = None
        if progress if progress is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=train_iters, initial=start_iter, unit="it", dynamic_ncols=True, leave=True)
            root = logging.getLogger()
            for h in root.handlers:
                if (isinstance(h, logging.StreamHandler) and not isinstance(h, _TqdmHandler)
                        and h.stream in (sys.stderr, sys.stdout)):  # the terminal's handlers only
                    tq = _TqdmHandler()
                    tq.setFormatter(h.formatter)
                    root.handlers[root.handlers.index(h)] = tq

    # ------------------------------------------------------------------ records
    def write(self, record: dict) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(_clean(record), sort_keys=False) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk: name the file and the errno, not a traceback
                raise MetricsWriteError(os_error_line(e, self.file.name)) from None

    def scalars(self, prefix: str, values: dict, step: int) -> None:
        """``<prefix>/<key>`` at ``step`` (the 1-based iteration) to every writer."""
        for w in self.writers:
            w.scalars(prefix, values, step)

    def train_step(self, record: dict) -> None:
        self.write({"type": "train", **record})
        iteration = iteration_of_step(record["iteration"])
        if iteration % self.tb_interval:
            return
        keys = ("loss", "lm_loss", "sop_loss", "lr", "grad_norm", "loss_scale", "samples_per_sec", "tokens_per_sec",
                "tflops_per_device", "params_norm") + (("step_time_s",) if self.log_timers else ())
        self.scalars("train", {k: record[k] for k in keys if record.get(k) is not None}, iteration)
        if record.get("bubble"):  # the log window's idle fraction per stage
            self.scalars("bubble", {f"stage{r}": v for r, v in enumerate(record["bubble"]) if v is not None}, iteration)

    def progress(self, n: int, loss: float | None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def eval(self, iteration: int, split: str, loss: float, samples: int, final: bool = False,
             components: dict[str, float] | None = None) -> None:
        """One evaluation after ``iteration`` completed steps (1-based; the JSONL record keeps the step index).

        ``components`` (BERT: ``lm_loss``, ``sop_loss``) are logged instead of the total under their
        Megatron names, and the perplexity is that of ``lm_loss``: a perplexity of MLM plus
        sentence-order loss means nothing.
        """
        comps = components or {}
        lm = comps.get("lm_loss", loss)
        ppl = math.exp(min(lm, 20.0))
        self.write({"type": "eval", "iteration": iteration - 1, "split": split, "loss": loss, **comps, "ppl": ppl,
                    "samples": samples, "time": time.time()})
        self.scalars(split, {"loss": loss, **comps, "ppl": ppl}, iteration)
        named = {k.replace("_", " "): v for k, v in comps.items()} or {"lm loss": loss}
        log.info(framed(validation_line(iteration, named, split=split, final=final)))

    def stages(self, iteration: int, stages: list[dict], bubble: list[float | None] | None = None) -> None:
        """Every stage's statistics; ``bubble``: each stage's measured idle fraction over the log window."""
        self.write({"type": "stages", "iteration": iteration, "stages": stages,
                    **({"bubble": bubble} if bubble is not None else {})})
        parts = []
        for s in stages:
            parts.append(
                f"[{s['stage']}] versions {s['weight_versions']} (live {s['max_live_versions']}) "
                f"in-flight {s['max_inflight']} "
                f"stashed {s['stashed_bytes'] / _MB:.2f}/{s['peak_stashed_bytes'] / _MB:.2f} MB"
            )
        log.info(" stages: %s", " | ".join(parts))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for w in self.writers:
            w.close()
        self.writers = []
        if self.file is not None:
            self.file.close()


def step_record(result, loss: float | None, *, step_time_s: float, global_batch: int, seq_length: int,
                tflops: float, consumed_samples: int, components: dict[str, float] | None = None) -> dict:
    """The metrics file's ``train`` record of one step (``result``: the engine's ``StepResult``).

    ``loss`` is the total the gradient comes from; ``components`` (BERT: ``lm_loss``, ``sop_loss``,
    mean over data-parallel replicas like ``loss``) follow it.
    """
    sps = global_batch / step_time_s
    return {
        "iteration": result.step, "loss": loss, **(components or {}), "lr": result.lr, "grad_norm": result.grad_norm,
        "loss_scale": result.loss_scale, "skipped": result.skipped, "samples_per_sec": sps,
        "tokens_per_sec": sps * seq_length, "tflops_per_device": tflops, "step_time_s": step_time_s,
        "consumed_samples": consumed_samples, "global_batch_size": global_batch, "time": time.time(),
    }
