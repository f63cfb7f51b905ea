"""Where a rank's elements sit in the checkpoint's layout-independent global tensors.

Every per-parameter buffer of a stage (both 2BW versions, the fp32 master, the optimizer state)
is stored as the t = 1 model's tensor under ``FAMILY/GLOBAL_NAME``; a rank's flat range of a
buffer is cut per parameter into at most three rectangles of its tensor-parallel shard, placed by
the shard's offset. The writer offers these chunks, the resharding load asks for them.

The shards are read from each parameter (``tensor_parallel.init.Init``: its tensor split and its expert
piece), and the buffers are walked segment by segment (``pipeline.segments``): the ranks of a segment's
reduction domain hold replicas of it, so they split its writing among themselves, and with the
distributed optimizer each holds its shard of the segment over that domain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checkpoint.names import WORD
from ...checkpoint.reshard import is_vocab, split_dim
from ...config import ModelConfig
from ...optimizer.state import holes
from ...pipeline.zero import ShardLayout

MODEL, OLDER, MASTER = "model", "older", "master"
# --2bw-compensation extrapolate's previous gradient (pipeline/compensation.py)
EF_PREV = "optimizer.extrapolate_prev_grad"
# The most bytes a save writes as one DCP item. DCP's reader loads every item a request overlaps
# whole before copying it into place (the item's bytes, then a tensor of them: 2x the item,
# measured), so this bounds what a resume allocates beyond the live buffers to about 32 MiB
# (without it: twice the largest tensor, e.g. a 1B GPT's 412 MB fp32 embedding moment). Items are
# cut along the first dimension; any chunking reads back at any layout.
MAX_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Param:
    """One parameter of a stage: where it sits in the flat buffers and in the global tensor."""

    name: str  # global name
    offset: int  # in the stage's flat buffer
    shape: tuple[int, ...]  # local, as 1-D (n,) or 2-D (rows, cols)
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]  # of the local tensor's first element
    rows: int  # local rows (elements of a 1-D tensor) inside the global tensor (vocabulary padding cut)
    writes: bool  # this rank writes it (replicated over the tensor group: rank 0; tied copy: the first stage)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _placed(shape: tuple[int, ...], init, dim: int | None, t: int, tp: int) -> tuple[list[int], list[int]]:
    """(global shape, global offset of the local tensor): the tensor split ``dim`` of ``t`` (rank ``tp``) inside
    the expert piece ``init.expert`` states, if any (the expert axis is the outer split)."""
    g, o = list(shape), [0] * len(shape)
    if dim is not None and t > 1:
        g[dim], o[dim] = shape[dim] * t, shape[dim] * tp
    e = getattr(init, "expert", None)
    if e is not None and e[2] > 1:
        edim, erank, esize = e
        if edim >= len(shape):
            raise ValueError(f"parameter {init.name} of shape {shape} has an expert axis along dimension {edim}")
        o[edim] += g[edim] * erank
        g[edim] *= esize
    return g, o


def stage_params(weights, cfg: ModelConfig | None, t: int, tp: int, pp: int) -> list[Param]:
    """The stage's parameters in flat-buffer order with their global placement (``cfg`` None: a model without
    a padded vocabulary, as a test model)."""
    out = []
    inits = getattr(weights, "inits", None) or [None] * len(weights.shapes)
    for name, off, shape, init in zip(weights.global_names, weights.offsets, weights.shapes, inits):
        shape = tuple(shape)
        if len(shape) > 2:
            shape = (shape[0], int(torch.Size(shape[1:]).numel()))
        # the split the parameter states (its Init); one without an Init is replicated
        dim = init.dim if init is not None else split_dim(cfg, name) if cfg is not None else None
        if dim is not None and dim >= len(shape):
            raise ValueError(f"parameter {name} of shape {shape} is split along dimension {dim}")
        g, o = _placed(shape, init, dim, t, tp)
        rows = shape[0]
        if cfg is not None and is_vocab(cfg, name):  # the t = 1 model's padded rows
            g[0] = cfg.padded_vocab_size(1)
            rows = max(0, min(shape[0], g[0] - o[0]))
        writes = (dim is not None or tp == 0) and (name != WORD or pp == 0)
        out.append(Param(name, off, shape, tuple(g), tuple(o), rows, writes))
    return out


def _rects(p: Param, a: int, b: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Rectangles covering local elements ``[a, b)`` of ``p`` (inside the global tensor):
    (first local element, sizes, global offsets)."""
    if len(p.shape) == 1:
        b = min(b, p.rows)
        return [(a, (b - a,), (p.global_offset[0] + a,))] if a < b else []
    cols = p.shape[1]
    (ra, ca), (rb, cb) = divmod(a, cols), divmod(b, cols)
    boxes = []  # (row, col, rows, cols)
    if ra == rb:
        boxes.append((ra, ca, 1, cb - ca))
    else:
        full = ra
        if ca:
            boxes.append((ra, ca, 1, cols - ca))
            full += 1
        if rb > full:
            boxes.append((full, 0, rb - full, cols))
        if cb:
            boxes.append((rb, 0, 1, cb))
    out = []
    for r, c, nr, nc in boxes:
        nr = min(nr, p.rows - r)
        if nr > 0 and nc > 0:
            out.append((r * cols + c, (nr, nc), (p.global_offset[0] + r, p.global_offset[1] + c)))
    return out


@dataclass
class Chunk:
    fqn: str
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    tensor: torch.Tensor  # a view of the live buffer (or of a host staging buffer)


def chunks_of(family: str, buf: torch.Tensor, base: int, lo: int, hi: int, params: list[Param],
            writing: bool) -> list[Chunk]:
    """The chunks of flat range ``[lo, hi)`` of a buffer whose element 0 is flat index ``base``."""
    out = []
    for p in params:
        if writing and not p.writes:
            continue
        a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
        if a >= b:
            continue
        for start, sizes, goff in _rects(p, a - p.offset, b - p.offset):
            n = 1
            for s in sizes:
                n *= s
            first = p.offset + start - base
            out.append(Chunk(f"{family}/{p.name}", goff, p.global_shape, buf[first:first + n].view(sizes)))
    return out


def bounded(chunks: list[Chunk], max_bytes: int | None = None) -> list[Chunk]:
    """``chunks`` cut along their first dimension into views of at most ``max_bytes``
    (``MAX_CHUNK_BYTES``; at least one row each), placed at their global offsets."""
    limit = MAX_CHUNK_BYTES if max_bytes is None else max_bytes
    out = []
    for c in chunks:
        t = c.tensor
        if t.dim() == 0 or t.numel() * t.element_size() <= limit:
            out.append(c)
            continue
        row = t[0].numel() * t.element_size()
        step = max(1, limit // row)
        for r in range(0, t.shape[0], step):
            out.append(Chunk(c.fqn, (c.offsets[0] + r, *c.offsets[1:]), c.global_shape, t[r:r + step]))
    return out


@dataclass(frozen=True)
class Family:
    """One segment's part of a per-parameter buffer on this rank: ``spans`` (first element, live tensor) with
    element 0 at stage flat index ``base``; ``[lo, hi)`` the flat range it holds (the segment, or this rank's
    shard of it), ``write`` the part of that this rank writes (replicas over the domain split the writing)."""

    name: str
    spans: list[tuple[int, torch.Tensor]]
    base: int
    lo: int
    hi: int
    write: tuple[int, int]


def families(stage) -> list[Family]:
    """Every per-parameter buffer, segment by segment: the two versions, then the updater's checkpointed
    state as each segment states it (``SegmentUpdate.state_spans``: master, optimizer, compensation)."""
    w, u, domains = stage.weights, stage.updater, stage.state.domains()

    def replicated(name: str, seg, spans) -> Family:
        dom = domains[seg.domain]
        lo, hi = ShardLayout(seg.numel, dom.size, dom.rank).bounds(dom.rank)
        return Family(name, spans, seg.start, seg.start, seg.end, (seg.start + lo, seg.start + hi))

    out = [replicated(MODEL, seg, [(0, seg.of(w.flat[w.slot(stage.step)]))]) for seg in w.segments]
    if w.num_versions > 1:
        out += [replicated(OLDER, seg, [(0, seg.of(w.flat[w.slot(stage.step + 1)]))]) for seg in w.segments]
    for part in u.parts:
        for name, spans in part.state_spans().items():
            if part.shard is None:
                out.append(replicated(name, part.seg, spans))
            else:
                lo, hi = part.base, part.seg.start + part.shard.hi
                out.append(Family(name, spans, lo, lo, hi, (lo, hi)))
    return out


def span_chunks(family: str, spans: list[tuple[int, torch.Tensor]], base: int, lo: int, hi: int,
                params: list[Param], writing: bool) -> list[Chunk]:
    """The chunks of flat range ``[lo, hi)`` held by ``spans`` (element 0 of the buffer is flat index
    ``base``); when writing, the elements no span holds (zeros in the whole tensor) come from one zero
    tensor, so the checkpoint's global tensors are whole at any layout."""
    out = []
    for start, t in spans:
        out += chunks_of(family, t, base + start, max(lo, base + start), min(hi, base + start + t.numel()),
                         params, writing)
    gaps = [(max(lo, base + a), min(hi, base + b)) for a, b in holes(spans, hi - base)] if writing else []
    gaps = [(a, b) for a, b in gaps if a < b]
    if gaps:
        zeros = torch.zeros(max(b - a for a, b in gaps), dtype=spans[0][1].dtype if spans else torch.float32)
        for a, b in gaps:
            out += chunks_of(family, zeros, a, a, b, params, writing)
    return out


def save_chunks(stage, cfg: ModelConfig) -> list[Chunk]:
    """What this rank writes: views of its live buffers (no copy; zeros where a state holds none)."""
    st = stage.state
    params = stage_params(stage.weights, cfg, st.t, st.tp_rank, st.pp_rank)
    out = []
    for fam in families(stage):
        out += span_chunks(fam.name, fam.spans, fam.base, *fam.write, params, writing=True)
    return out
