"""One rank's whole run: the default group on this launch attempt's store, the layout's groups, the ranks'
agreement on the checkpoint to resume, the watchdog, the :class:`~.loop.Trainer`, and the one line a rank
prints when any of it fails (no traceback, no wait on a teardown that may hang)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

from .. import parallel_state
from ..checkpoint import checkpointing
from ..errors import ConfigError
from ..faults import FaultInjector, Faults
from . import signals, supervision, watchdog
from .loop import Trainer
from .metrics import MetricsWriteError

log = logging.getLogger("megatron_2bw")


def _init_attempt_group(cfg) -> None:
    """Under torchrun's agent store, start the default group on this launch attempt's own keys
    (``supervision.attempt_store``); ``parallel_state.initialize`` then only builds the layout's groups."""
    store = supervision.attempt_store(60.0 * cfg.system.timeout_minutes)
    if store is None or dist.is_initialized():
        return
    device_id = None
    if cfg.system.device == "cuda":
        torch.cuda.set_device(parallel_state.cuda_device_index(int(os.environ.get("LOCAL_RANK", "0"))))
        device_id = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend=cfg.system.backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), device_id=device_id,
                            timeout=datetime.timedelta(minutes=cfg.system.timeout_minutes))


def rendezvous_failure(e: BaseException) -> str:
    """What went wrong starting the process group, in one line (EADDRINUSE named as such)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"cannot start the process group: the rendezvous address {where} is already in use (another job or "
                "a leftover process on that port?): choose another MASTER_PORT")
    return f"cannot start the process group at {where}: {type(e).__name__}: {first}"


def _agree_on_resume(prep, state: parallel_state.ParallelState) -> None:
    """Every rank read ``--load``'s pointer file on its own, before any process group; refuse (exit 2,
    one line on rank 0) unless all read the same iteration: a pointer that moved meanwhile (another job
    saving there) would otherwise resume the stages from different steps (Megatron compares them too)."""
    spread = resume_disagreement(prep.loaded_iteration)
    if spread is None:
        return
    if state.rank == 0:
        name = lambda v: "none" if v is None else str(v)  # noqa: E731
        print(f"error: the ranks read different checkpoints to resume from --load {prep.cfg.training.load} "
              f"(iterations {name(spread[0])} to {name(spread[1])}): its {checkpointing.TRACKER} changed while the "
              "job started (another job saving into it?); start again", file=sys.stderr, flush=True)
    os._exit(2)


def resume_disagreement(iteration: int | None) -> tuple[int | None, int | None] | None:
    """Collective: None when every rank loaded the same iteration (None: nothing), else (lowest, highest)."""
    it = -1 if iteration is None else int(iteration)
    hi, neg_lo = signals.agree_max([it, -it])
    if hi == -neg_lo:
        return None
    return (None if -neg_lo < 0 else -neg_lo), (None if hi < 0 else hi)


def run(prep, faults: Faults | None = None) -> int:
    """Initialize the process groups, train, and tear down; a failure ends this process quickly.

    ``faults`` (tests): injected faults; ``None`` takes them from the environment
    (:meth:`FaultInjector.from_env`), which is how a test reaches processes that ``torchrun`` starts.
    """
    cfg = prep.cfg
    faults = faults if faults is not None else FaultInjector.from_env()
    try:
        _init_attempt_group(cfg)
        state = parallel_state.initialize(
            cfg.parallel, backend=cfg.system.backend, device=cfg.system.device,
            timeout_minutes=cfg.system.timeout_minutes,
            expert=cfg.model.moe.expert_model_parallel_size if cfg.model.moe is not None else 1,
            tied_embedding=cfg.tied_across_ranks,
        )
    except Exception as e:  # noqa: BLE001 - the rendezvous failed: one line, not a traceback
        print(f"error: rank {prep.rank}: {rendezvous_failure(e)}", file=sys.stderr, flush=True)
        os._exit(1)
    _agree_on_resume(prep, state)
    wd = watchdog.start_watchdog(cfg.system.stall_timeout_s)
    trainer = None
    try:
        with wd.starting_up() if wd is not None else contextlib.nullcontext():  # the grace starts after this
            trainer = Trainer(prep, state, faults, wd)
        code = trainer.train()
        if wd is not None:
            wd.stop()
    except ConfigError as e:  # a mismatch only visible once the model is built
        print(f"error: rank {state.rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except MetricsWriteError as e:
        print(f"error: rank {state.rank}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    except Exception as e:  # noqa: BLE001 - report in one line, never hang in teardown
        where = f" at iteration {trainer.stage.step}" if trainer is not None else ""
        what = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if parallel_state.is_peer_failure(e):
            print(f"error: rank {state.rank}: lost contact with a peer process{where} "
                  f"(did another rank fail?): {type(e).__name__}: {what}", file=sys.stderr, flush=True)
        else:
            print(f"error: rank {state.rank}: training failed{where}: {type(e).__name__}: {what}", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code
