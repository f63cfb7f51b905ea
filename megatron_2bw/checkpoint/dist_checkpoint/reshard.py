"""Restoring a torch_dist checkpoint at any layout (load-time resharding, collective): each rank asks
DCP for the rectangles its buffers hold at this run's t, d, w, stage split, schedule and
distributed optimizer, and DCP reads their overlap with what was written, straight into the live
buffers.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...errors import ConfigError
from ...tensor_parallel.recompute import RNGSnapshot
from ..compat import stage_model
from .collective import checkpoint_group, config_error
from .planners import LoadPlanner
from .router_state import load_router_chunks
from .shard_map import EF_PREV, MASTER, MODEL, OLDER, Param, families, span_chunks, stage_params

log = logging.getLogger("megatron_2bw")


def _zero_cut_rows(buf: torch.Tensor, base: int, lo: int, hi: int, params: list[Param]) -> None:
    """Zero the vocabulary rows beyond the t = 1 model's padding (what the checkpoint does not hold)."""
    for p in params:
        if p.rows >= p.shape[0]:
            continue
        per_row = p.numel // p.shape[0]
        a, b = max(lo, p.offset + p.rows * per_row), min(hi, p.offset + p.numel)
        if a < b:
            buf[a - base:b - base].zero_()


def restore(sd: dict, stage, tracker, device: torch.device, *, load_optim: bool = True, load_rng: bool = True,
            finetune: bool = False) -> None:
    """Load a torch_dist checkpoint read by :func:`read_checkpoint` into the live buffers (collective).

    Each rank reads its own elements: the whole tensor-parallel shard of its stage's weights and,
    with the distributed optimizer, its shard of the fp32 master and optimizer state. Options as
    :func:`checkpointing.restore`.
    """

    common, keys = sd["common"], sd["keys"]
    w, u, st = stage.weights, stage.updater, stage.state
    stage.reducer.wait_all()
    stage.step = 0 if finetune else int(common["step"])
    params = stage_params(w, stage_model(sd["config"]), st.t, st.tp_rank, st.pp_rank)
    with_optim = load_optim and not finetune
    chunks, read = [], set()
    for fam in families(stage):
        family, spans, base, lo, hi = fam.name, fam.spans, fam.base, fam.lo, fam.hi
        if family != MODEL and (family == OLDER and (finetune or f"{OLDER}/{params[0].name}" not in keys)
                                or family != OLDER and (not with_optim or f"{family}/{params[0].name}" not in keys)):
            continue
        for start, buf in spans:  # straight into the live tensors the updater states (gpu-review-2 N10)
            _zero_cut_rows(buf, base + start, max(lo, base + start), min(hi, base + start + buf.numel()), params)
        chunks += span_chunks(family, spans, base, lo, hi, params, writing=False)
        read.add(family)
    model = stage_model(sd["config"])  # None: a model built by hand, without a model config
    moe = model.moe if model is not None else None
    router_chunks, router = load_router_chunks(keys, moe.num_experts) if moe is not None else ([], {})
    try:
        dcp.load({}, storage_reader=dcp.FileSystemReader(sd["path"]),
                 planner=LoadPlanner(chunks + router_chunks, [], sd["path"]),
                 process_group=checkpoint_group(), no_dist=not dist.is_initialized())
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - every rank sees every rank's failure
        raise ConfigError(f"checkpoint {sd['path']} could not be loaded: {config_error(e)}") from None
    stage.moe_router_state = router  # the trainer's MoE hooks take it (router_state.py)
    newest = w.slot(stage.step)
    if w.num_versions > 1 and OLDER not in read:  # a flush checkpoint (or --finetune): both versions equal
        w.flat[w.slot(stage.step + 1)].copy_(w.flat[newest])
    if with_optim:  # checkpoints before the updater's scalars held it kept extrapolate's flag beside them
        u.load_scalars({"extrapolate_has_prev": common.get("extrapolate_has_prev", False), **common["optimizer"]})
        u.scaler.load_state_dict(common["scaler"])
    if u.ef_prev is not None and not (with_optim and EF_PREV in read):  # another compensation's: starts afresh
        u.ef_has_prev = False
    if u.master is not None and MASTER not in read:
        u.master_from(newest)
    if load_rng and not finetune:
        if sd.get("rng") is not None:
            RNGSnapshot.from_dict(sd["rng"]).restore(device, tracker)
        elif st.rank == 0:
            lay = sd["layout"]
            log.info(" resuming %s (t=%d d=%d w=%d) at another layout: RNG states start from this run's seeds, "
                     "so the resume is not bitwise", sd["path"], lay["t"], lay["d"], lay["w"])
