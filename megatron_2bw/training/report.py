"""Rank 0's reporting of a run: the start-up line and record, each step's record as its reduced numbers
arrive, Megatron's training line every ``--log-interval`` steps (with the window's per-stage bubble), the
memory report once, an ETA line off a terminal, and the ``end`` record. The trainer decides; this writes."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import torch

from ..argv import describe
from ..config import RunConfig
from ..config.arith import counts_recompute, tflops_per_device
from ..config.moe_presets import parameter_counts
from ..parallel_state import ParallelState
from .log_format import cuda_memory, eta_line, math_choices, memory_report_line, peak_tflops_of, window_line
from .metrics import Metrics, step_record
from .params_norm import with_params_norm
from .step_stats import StepStats, window_bubble

log = logging.getLogger("megatron_2bw")

# On a GPU the engine's clocks are the host's (kernels run asynchronously): said once, beside the first numbers
HOST_CLOCK_NOTE = ("note: on CUDA the bubble column and the update wait are host-clock times (the host runs ahead "
                   "of the GPU), so they read low; profile with --profile for device times")



def model_name(model) -> str:
    """What the start-up lines call the model: ``Llama`` for a GPT with RoPE, SwiGLU and RMSNorm (the options
    transformers' LlamaForCausalLM implements, what ``--saver hf`` exports it as), else ``GPT`` or ``BERT``."""
    llama = model.kind == "gpt" and model.position_embedding_type == "rope" and model.swiglu \
        and model.normalization == "RMSNorm"
    return "Llama" if llama else model.kind.upper()


def is_log_step(tc, step: int) -> bool:
    """Whether step ``step`` (0-based) ends a ``--log-interval`` or the run: its record carries the window's values."""
    return bool(tc.log_interval and (step + 1) % tc.log_interval == 0) or step + 1 == tc.train_iters

class StepReport:
    """What rank 0 writes about a run (``metrics``: its metrics file and writers)."""

    def __init__(self, cfg: RunConfig, state: ParallelState, metrics: Metrics, loss_keys: tuple[str, ...],
                 consumed_samples, start_step: int) -> None:
        self.cfg, self.state, self.metrics, self.loss_keys = cfg, state, metrics, loss_keys
        self.consumed_samples = consumed_samples  # completed steps -> samples (the data provider's count)
        self.B, self.m = cfg.training.global_batch_size, cfg.pipeline.num_microbatches
        self.peak_tflops = (peak_tflops_of(torch.cuda.get_device_name(state.device), cfg.optimizer.dtype)
                            if state.device.type == "cuda" else None)
        self.start_step, self.t_start = start_step, time.time()
        self.memory_reported = False
        self.window: list[dict] = []  # train records since the last log line
        self.stages_seen: list[dict] = []  # every stage's statistics at the newest recorded step
        self.stages_logged: list[dict] | None = None  # ... at the last log line: the bubble's window starts there

    def start(self, stages: list[dict], step: int, kernels, resumed_from: int | None) -> None:
        """The start-up line (every choice that changes the math) and the ``start`` record."""
        cfg, s = self.cfg, self.state
        mb = lambda key: "/".join(f"{st[key] / 2**20:.1f}" for st in stages)  # noqa: E731
        total, active = parameter_counts(cfg.model)  # the same number twice for a dense model
        params = f"{total / 1e6:.2f}M" + (f" ({active / 1e6:.2f}M active)" if active != total else "")
        resumed = f" | resumed from iteration {step}" if resumed_from is not None else ""
        log.info(
            "%s %s parameters | layout %s, %s on %s) | b=%d m=%d B=%d%s | "
            "%s | kernels %s | per-stage MB weights %s grads %s optimizer %s%s",
            model_name(cfg.model), params, cfg.parallel.describe(), cfg.system.backend, cfg.system.device,
            cfg.pipeline.micro_batch_size, self.m, self.B,
            " +recompute" if cfg.pipeline.recompute else "", math_choices(cfg), kernels.describe(),
            mb("weight_bytes"), mb("grad_bytes"), mb("optimizer_bytes"), resumed,
        )
        if s.device.type == "cuda":
            log.info(HOST_CLOCK_NOTE)
        self.metrics.write({
            "type": "start", "time": time.time(), "world_size": s.world_size,
            "layout": {"t": s.t, "d": s.d, "w": s.data_width, "c": s.c}, "schedule": cfg.pipeline.schedule,
            "micro_batch_size": cfg.pipeline.micro_batch_size, "num_microbatches": self.m, "global_batch_size": self.B,
            "precision": cfg.optimizer.dtype, "kernels": asdict(kernels), "parameters": total,
            "resumed_from": resumed_from, "stages": stages, "config": describe(cfg),
        })

    def restart_clock(self, step: int) -> None:
        """Training starts (again) at ``step``: the ETA counts from here."""
        self.window, self.start_step, self.t_start = [], step, time.time()

    def step(self, r, st: StepStats, dt: float, params_norm: bool, moe: dict[str, float] | None = None) -> None:
        """Step ``st.step``'s record once its numbers arrived (``r``: this rank's StepResult; ``dt``: its time;
        ``moe``: the MoE statistics by name, moe_metrics.py); the training line at a log step."""
        cfg, tc = self.cfg, self.cfg.training
        tfl = tflops_per_device(cfg.model, self.B, dt, self.state.world_size, counts_recompute(cfg.pipeline),
                                cfg.parallel.tensor)
        rec = step_record(r, st.loss, step_time_s=dt, global_batch=self.B, seq_length=cfg.model.seq_length,
                          tflops=tfl, consumed_samples=self.consumed_samples(st.step + 1),
                          components=st.components or None)
        if params_norm:
            rec["params_norm"] = st.params_norm
        self.stages_seen = st.stages
        log_step = is_log_step(tc, st.step)
        if moe and log_step:  # the steps since the last logged one (moe_hooks.step_vector)
            rec["moe"] = moe
        if log_step:  # the window's per-stage bubble, beside its TFLOP/s
            rec["bubble"] = window_bubble(st.stages, self.stages_logged)
        self.metrics.train_step(rec)
        self.window.append(rec)
        self.metrics.progress(1, st.loss)
        if log_step:
            self.flush_window(st.step + 1)

    def flush_window(self, completed: int) -> None:
        """Megatron's training line of the steps since the last one (if any), the memory report once, a plain
        ETA line off a terminal."""
        if not self.window:
            return
        window, stages, self.window = self.window, self.stages_seen, []
        bubble = window_bubble(stages, self.stages_logged) if stages else None
        self.stages_logged = stages
        tc, s = self.cfg.training, self.state
        log.info(with_params_norm(window_line(
            window, completed=completed, train_iters=tc.train_iters, global_batch=self.B,
            seq_length=self.cfg.model.seq_length, stages=stages, peak_tflops=self.peak_tflops, bubble=bubble,
            loss_keys={key.replace("_", " "): key for key in self.loss_keys} or None), window[-1].get("params_norm")))
        if not self.memory_reported:
            self.memory_reported = True
            cuda = cuda_memory(s.device) if s.device.type == "cuda" else None
            log.info(memory_report_line(s.rank, completed, cuda, stages))
        if self.metrics.bar is None:
            log.info(eta_line(completed, tc.train_iters, self.start_step, time.time() - self.t_start))
        self.metrics.stages(completed - 1, stages, bubble)

    def end(self, done: int, reason: str, drains: int, post_validation: dict) -> None:
        """The ``end`` record; closes every writer."""
        self.metrics.write({"type": "end", "iteration": done - 1, "completed_iterations": done, "reason": reason,
                            "pipeline_drains": drains, **post_validation,
                            "seconds": time.time() - self.t_start, "time": time.time()})
        self.metrics.close()



