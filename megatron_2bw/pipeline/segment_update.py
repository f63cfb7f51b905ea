"""One segment's share of a stage's update (:mod:`.segments`): its optimizer, fp32 master and compensation
buffers, over the segment or, with the distributed optimizer, this rank's shard of it over its domain's group.

The :class:`~.updater.Updater` runs the loss scale, the overflow skip and the clipping once and hands each
segment the same multiplier; every optimizer here is elementwise (Muon by whole matrices, which never
straddle segments), so cutting a stage into segments changes no value. With one segment this is the state
the updater held before segments existed, in the same coordinates.
"""

from __future__ import annotations

import functools

import torch

from ..config import OptimizerConfig
from ..optimizer.build import build_optimizer
from ..optimizer.muon import MuonMatrix
from ..optimizer.state import Span, load_whole, whole
from .grad_reducer import GradReducer, SegmentReduction
from .segments import Segment
from .weights import RankWeights
from .zero import ShardLayout, gather_full

OPT = "optimizer."  # checkpoint names of the optimizer's state: optimizer.exp_avg, ...
EXTRAPOLATE = "extrapolate_prev_grad"  # --2bw-compensation extrapolate's


def host(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``t`` in host memory without a device-side copy: copied straight to the CPU, or (``copy`` False)
    ``t`` itself when it is there already."""
    return t.to("cpu", copy=copy)


class SegmentUpdate:
    """The update state of segment ``seg`` of ``weights`` (this rank's shard of it when ``red`` has one)."""

    def __init__(self, weights: RankWeights, seg: Segment, red: SegmentReduction | None, reducer: GradReducer | None,
                 opt: OptimizerConfig, compensation: str, tp: tuple[object, int, int]) -> None:
        self.weights, self.seg = weights, seg
        self.shard: ShardLayout | None = red.shard if red is not None else None
        self.group = red.group if red is not None else None
        numel, n_decay = (self.shard.size, self.shard.decay_prefix(seg.n_decay)) if self.shard is not None \
            else (seg.numel, seg.n_decay)
        muon = self._muon_layout(tp, reducer) if opt.optimizer == "muon" else None
        self.optimizer = build_optimizer(opt, numel, n_decay, weights.device, muon=muon)
        # extrapolate: the previous applied step's unscaled, clipped gradient (this rank's shard), fp32
        self.ef_prev = torch.zeros(numel, dtype=torch.float32, device=weights.device) \
            if compensation == "extrapolate" else None
        # fp32 master copy of the newest weights (of this rank's shard) when they are kept in lower
        # precision, or when the version buffers hold predicted (predict) or corrected (ef) weights
        keep = weights.dtype != torch.float32 or compensation in ("predict", "ef")
        self.master = self.weights_of(0).to(torch.float32, copy=True) if keep else None
        # ef: the scratch y(t+1) is written into before the correction (fp32 uses the free version buffer)
        self.ef_next = torch.empty(numel, dtype=torch.float32, device=weights.device) \
            if compensation == "ef" and weights.dtype != torch.float32 else None

    def _muon_layout(self, tp: tuple[object, int, int], reducer: GradReducer | None) -> dict:
        """What :class:`~..optimizer.muon.FlatMuon` needs to know about the segment: its matrices (in segment
        coordinates), the tensor-parallel group, and this rank's shard and its exchange over the domain."""
        w, seg = self.weights, self.seg
        matrices = [MuonMatrix(w.offsets[i] - seg.start, tuple(w.shapes[i]),
                               w.partition_dims[i] if w.tp_split[i] and tp[2] > 1 else None)
                    for i in seg.params if w.partition_dims[i] is not None]
        matrices += [MuonMatrix(w.offsets[i] - seg.start + k * (w.sizes[i] // w.stacks[i]), tuple(w.shapes[i][1:]))
                     for i in seg.params if w.stacks[i] for k in range(w.stacks[i])]  # one per expert
        matrices.sort(key=lambda mat: mat.offset)
        kw = {"matrices": matrices, "total": seg.numel, "tp": tp, "n_decay": seg.n_decay}
        if self.shard is not None:
            kw.update(lo=self.shard.lo, gather=functools.partial(reducer.gather_shards, group=self.group),
                      bounds=[self.shard.bounds(r) for r in range(self.shard.w)])
        return kw

    def weights_of(self, slot: int) -> torch.Tensor:
        """Weight buffer ``slot``'s segment: this rank's range of it with the distributed optimizer (a view)."""
        w = self.weights
        if self.shard is None:
            return self.seg.of(w.flat[slot])
        return self.shard.own(self.seg.of(w.padded_flat[slot], True))

    def grad_of(self, buf: int) -> torch.Tensor:
        """Gradient buffer ``buf``'s segment: this rank's (reduce-scattered) range of it when sharded."""
        w = self.weights
        if self.shard is None:
            return self.seg.of(w.grad_flat[buf])
        return self.shard.own(self.seg.of(w.padded_grad[buf], True))

    def kept(self, slot: int) -> torch.Tensor:
        """What a speculative update overwrites: the fp32 master where there is one, else the weights."""
        return self.master if self.master is not None else self.weights_of(slot)

    def state_spans(self) -> dict[str, list[Span]]:
        """Its checkpointed state by name as live spans in its optimizer's coordinates (see ``Updater``)."""
        out = {"master": [(0, self.master)]} if self.master is not None else {}
        out.update({f"{OPT}{k}": s for k, s in self.optimizer.state_spans().items()})
        if self.ef_prev is not None:  # extrapolate's previous gradient: per parameter, kept by name too
            out[f"{OPT}{EXTRAPOLATE}"] = [(0, self.ef_prev)]
        return out

    @property
    def base(self) -> int:
        """The stage flat index of its optimizer's element 0."""
        return self.seg.start + (self.shard.lo if self.shard is not None else 0)

    def full(self, everywhere: bool, copy: bool) -> dict[str, torch.Tensor | None]:
        """Each state by name as the segment's whole (``seg.numel``) tensor in host memory: gathered over the
        domain's group when sharded (a collective; with ``everywhere`` False only its first rank gets it)."""
        n = self.optimizer.numel
        if self.shard is None:
            return {k: host(whole(s, n), copy) for k, s in self.state_spans().items()}
        return {k: gather_full(whole(s, n), self.shard, self.group, everywhere) for k, s in self.state_spans().items()}

    def load(self, name: str, full: torch.Tensor) -> None:
        """Load state ``name`` from the segment's whole tensor (this rank's shard of it when sharded)."""
        load_whole(self.state_spans()[name], full if self.shard is None else self.shard.take(full, torch.float32))


def place(parts: list[SegmentUpdate], fulls: list[torch.Tensor | None], numel: int,
          skip: frozenset[int] = frozenset()) -> torch.Tensor | None:
    """The stage's whole tensor (``numel`` elements, zeros between segments) from each segment's whole one:
    the one tensor itself when there is one segment; None where a segment's is (not gathered here). The
    segments in ``skip`` (of several) stay zeros: their caller fills them in (the torch format's expert gather)."""
    if len(parts) == 1:
        return fulls[0]
    kept = [f for i, f in enumerate(fulls) if i not in skip]
    if not kept or any(f is None for f in kept):
        return None
    out = torch.zeros(numel, dtype=kept[0].dtype)
    for i, (p, f) in enumerate(zip(parts, fulls)):
        if i not in skip:
            p.seg.of(out).copy_(f)
    return out


def cut(parts: list[SegmentUpdate], full: torch.Tensor) -> list[torch.Tensor]:
    """Each segment's range of a whole stage tensor (itself when there is one segment)."""
    return [full] if len(parts) == 1 else [p.seg.of(full) for p in parts]
