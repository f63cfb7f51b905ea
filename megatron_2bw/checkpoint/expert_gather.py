"""The torch format's expert stacks at expert-parallel size e > 1: every expert gathered to data rank 0.

A ``--ckpt-format torch`` file (one per tensor and pipeline rank, written by data rank 0) holds each expert
stack ``[E, out, in]`` whole, on the global expert axis, as a save at e = 1 does (``trainer_format``): any
expert-parallel size resumes from it (each rank takes its experts at load) and the offline readers see one
layout. At e > 1 data rank 0 holds only its own E / e experts; piece k lives on data rank k of its expert
group (data ranks 0 .. e - 1) and, with the distributed optimizer, its master and optimizer state are
sharded further over piece k's expert-data group (data ranks k, e + k, 2e + k, ...).

At a save, and only then, each state of the stage's expert segment (:mod:`..pipeline.segments`, the
``edp`` domain, which holds the expert stacks alone) comes to data rank 0 as e rows, row k piece k's:

- the weight versions, whole on every rank (the distributed optimizer all-gathers them), over the expert group;
- an unsharded master or optimizer state over the expert group as well;
- a sharded one over the whole data group in one gather: data rank ``r * e + k`` holds shard r of piece k.

The gathers are :func:`~..pipeline.zero.gather_full`'s (host memory on the receiver, device pieces sent in
bounded chunks), one state at a time, each placed before the next is gathered: data rank 0 holds the rows of
one state beside the whole stacks built so far. Each stack is then its e pieces one after the other, expert
``k * E / e + j`` being piece k's j-th, the order in which a rank takes its experts back at load.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..optimizer.state import whole
from ..parallel_state import EXPERT_DATA
from ..pipeline.segment_update import OPT
from ..pipeline.zero import ShardLayout, gather_full

__all__ = ["expert_segments", "gather_expert_stacks"]


def _expert_segment(weights) -> tuple[int, object] | None:
    """(index, segment) of the stage's expert segment; None on a stage without experts."""
    return next(((i, s) for i, s in enumerate(weights.segments) if s.domain == EXPERT_DATA), None)


def expert_segments(weights) -> frozenset[int]:
    """The expert segment's index, for the updater's state to leave out at a save (:func:`gather_expert_stacks`
    gathers it whole, the updater's own gather would be a second one, of data rank 0's piece); empty without one."""
    found = _expert_segment(weights)
    return frozenset() if found is None else frozenset({found[0]})


def _over_experts(piece: torch.Tensor, state) -> torch.Tensor | None:
    """Rows ``[e, n]`` of every expert rank's ``n``-element ``piece`` on data rank 0 (None on the others of its
    expert group); called by data ranks 0 .. e - 1 only."""
    n = piece.numel()
    full = gather_full(piece, ShardLayout(state.e * n, state.e, state.ep_rank), state.groups.ep, everywhere=False)
    return None if full is None else full.view(state.e, n)


def _over_data(shard: torch.Tensor, layout: ShardLayout, n: int, state) -> torch.Tensor | None:
    """Rows ``[e, n]`` on data rank 0 of a state sharded over each piece's expert-data group (``layout``: this
    rank's shard of its piece's ``n`` elements); every rank of the data group calls it."""
    s, copies = layout.size, state.replicas // state.e
    r = state.replicas
    full = gather_full(shard, ShardLayout(r * s, r, state.dp_rank), state.groups.dp, everywhere=False)
    if full is None:
        return None
    return full.view(copies, state.e, s).transpose(0, 1).reshape(state.e, copies * s)[:, :n]


def _local_states(stage, part) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(key, this rank's tensor, sharded) of every state the file holds per parameter, in one order on every
    rank: the weight versions (``version0``, ...), then the updater's checkpoint names (``master``,
    ``optimizer.exp_avg``, ...) in its optimizer's coordinates (the shard's with the distributed optimizer).
    One at a time: a state held in several spans is assembled on its device only while it is gathered."""
    for v, flat in enumerate(stage.weights.flat):
        yield f"version{v}", part.seg.of(flat), False
    for k, spans in part.state_spans().items():
        yield k, whole(spans, part.optimizer.numel), part.shard is not None


def _destinations(stage, named: dict, newest: dict) -> dict[str, dict]:
    """Which by-name dict of the file each gathered state goes into (``trainer_format.named_engine_state``'s)."""
    w = stage.weights
    newest_slot = w.slot(stage.step)
    out = {f"version{newest_slot}": newest}
    out.update({f"version{v}": named["older"] for v in range(len(w.flat)) if v != newest_slot})
    if named.get("master") is not None:
        out["master"] = named["master"]
    out.update({f"{OPT}{k}": v for k, v in named["optimizer"].items() if isinstance(v, dict)})
    return out


def gather_expert_stacks(stage, named: dict | None = None, newest: dict | None = None) -> None:
    """Put every expert stack whole (all E experts) into data rank 0's ``named`` stage state and ``newest``
    weights (by global name, as ``trainer_format.named_engine_state`` gives them), in place of its own E / e.

    A collective: every rank of the data group calls it at a save with e > 1, after the updater's gather of
    the sharded state; ``named`` and ``newest`` are given on data rank 0 only. Nothing runs between saves."""
    state, w = stage.state, stage.weights
    found = _expert_segment(w)
    if found is None:
        return
    index, seg = found
    part = stage.updater.parts[index]
    stage.reducer.wait_all()  # no all-gather of the weights may still be running
    into = _destinations(stage, named, newest) if state.dp_rank == 0 else {}
    in_first = state.dp_rank < state.e  # data rank 0's expert group
    for key, local, sharded in _local_states(stage, part):
        if sharded:
            rows = _over_data(local, part.shard, seg.numel, state)
        else:
            rows = _over_experts(local, state) if in_first else None
        if rows is None or key not in into:
            continue
        for i in seg.params:
            off = w.offsets[i] - seg.start
            into[key][w.global_names[i]] = rows[:, off:off + w.sizes[i]].reshape(-1, *w.shapes[i][1:])
