"""Each step's loss, exit flags and stage statistics, reduced over all ranks while the pipeline runs on.

Every rank issues one asynchronous all-reduce (SUM) per step, right after its update of that
step, of a small float64 CPU vector: the loss and its named parts divided by the data-parallel
width (last stage, tensor rank 0; zero elsewhere), "this rank saw an exit signal", "this rank's
``--exit-duration-in-mins`` passed", and its stage's statistics (``STAT_KEYS``; tensor and data
rank 0 only). The reductions run on their own gloo group, also when the default backend is
NCCL, so they never queue behind the gradient collectives or point-to-point transfers.

At the update of step ``u`` every rank *waits* for step ``u - WAIT_LAG``'s vector. That wait
cannot deadlock: the update of step ``u`` first waits for step ``u``'s gradient reductions
(data-parallel, tied embedding, norm over the model group), which finish only once every rank in
the world has started them, and every rank starts them after its update of step ``u - 2``, which
issued that step's vector (2BW: the step's backward reuses the gradient buffer that update
freed; Flush and GPipe: every step's actions follow the previous update). A rank that waits
therefore only waits for a collective every rank has already issued. Because the wait sits at
the same step on every rank, every rank sees every step's numbers at the same step: health
verdicts, exit agreements and the step where the segment is cut short are identical everywhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..parallel_state import ParallelState

WAIT_LAG = 2  # at the update of step u every rank waits for the vector of step u - WAIT_LAG

# Stage statistics in this order (see pipeline/accounting.py); -1 stands for None.
STAT_KEYS = ("weight_versions", "max_live_versions", "max_inflight", "stashed_bytes", "peak_stashed_bytes",
             "weight_bytes", "grad_bytes", "optimizer_bytes", "cuda_peak_bytes", "update_wait_s",
             "recv_wait_s", "compute_s", "train_s")
_INT_STATS = set(STAT_KEYS) - {"update_wait_s", "recv_wait_s", "compute_s", "train_s"}


def window_bubble(now: list[dict], base: list[dict] | None = None) -> list[float | None]:
    """Each stage's measured bubble over a log window: its idle seconds (waiting on receives and on the
    reductions before its updates) over its seconds in the training loop, between the statistics
    ``base`` (the previous window's end; None: the start) and ``now`` (:func:`stage_dicts`). None for a
    stage whose clock did not advance."""
    out: list[float | None] = []
    for r, st in enumerate(now):
        b = base[r] if base is not None and r < len(base) else {}
        wall = st["train_s"] - b.get("train_s", 0.0)
        idle = st["recv_wait_s"] + st["update_wait_s"] - b.get("recv_wait_s", 0.0) - b.get("update_wait_s", 0.0)
        out.append(min(max(idle / wall, 0.0), 1.0) if wall > 0 else None)
    return out


def stage_row(stats: object) -> list[float]:
    """One stage's statistics (a ``StageStats``) as floats in ``STAT_KEYS`` order."""
    vals = [getattr(stats, k) for k in STAT_KEYS]
    return [float(v if v is not None else -1) for v in vals]


def stage_dicts(vals: list[float], d: int) -> list[dict]:
    """Inverse of ``d`` consecutive :func:`stage_row` rows: one dict per stage."""
    k, out = len(STAT_KEYS), []
    for r in range(d):
        st: dict = {"stage": r}
        for key, v in zip(STAT_KEYS, vals[r * k:(r + 1) * k]):
            st[key] = (int(v) if v >= 0 else None) if key in _INT_STATS else v
        out.append(st)
    return out


def pack(state: ParallelState, last: list[float | None], flags: list[float], row: list[float],
         tail: list[float] = ()) -> torch.Tensor:
    """This rank's part of a SUM-reduced float64 vector: ``last`` (values of the last stage, tensor rank 0,
    divided by the data-parallel width, so the sum is the mean over replicas; None: NaN), then ``flags``
    (every rank's), then one ``row`` per stage (its tensor and data rank 0; :func:`stage_row`), then ``tail``
    (every rank's share, as its owner computed it: the MoE statistics, ``moe_metrics.py``)."""
    s, e, f, k = state, len(last), len(flags), len(STAT_KEYS)
    vec = torch.zeros(e + f + s.d * k + len(tail), dtype=torch.float64)
    if tail:
        vec[e + f + s.d * k:] = torch.tensor(tail, dtype=torch.float64)
    if s.holds_loss and s.tp_rank == 0:
        vec[:e] = torch.tensor([v if v is not None else float("nan") for v in last], dtype=torch.float64) / s.replicas
    vec[e:e + f] = torch.tensor(flags, dtype=torch.float64)
    if s.tp_rank == 0 and s.dp_rank == 0:
        lo = e + f + s.pp_rank * k
        vec[lo:lo + k] = torch.tensor(row, dtype=torch.float64)
    return vec


@dataclass
class StepStats:
    """One step's reduced numbers, identical on every rank."""

    step: int
    loss: float  # the last stage's loss, mean over data-parallel replicas (NaN if not finite)
    components: dict[str, float] = field(default_factory=dict)  # its named parts (BERT), likewise
    signal: bool = False  # some rank had received an exit signal by its update of this step
    duration: bool = False  # some rank's --exit-duration-in-mins had passed by then
    stages: list[dict] = field(default_factory=list)  # every stage's statistics at this step
    params_norm: float = 0.0  # --log-params-norm: the weights' L2 norm after this step (measured at log steps)
    tail: list[float] = field(default_factory=list)  # the summed ``tail`` (MoE statistics), decoded by its owner


class StepReducer:
    """Issues each step's all-reduce and hands back the reduced steps in order once they are waited for.

    Construct it on every rank at the same point (it creates a process group when there are peers).
    """

    def __init__(self, state: ParallelState, loss_keys: tuple[str, ...]) -> None:
        self.state, self.loss_keys = state, loss_keys
        peers = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=state.timeout) if peers else None
        self._pending: deque[tuple[int, torch.Tensor, object]] = deque()
        self.tail = 0  # the length of the tail every rank packs (the same every step)

    def issue(self, step: int, loss: float | None, components: dict[str, float] | None, signal: bool,
              duration: bool, row: list[float], params_sumsq: float = 0.0, tail: list[float] = ()) -> None:
        """This rank's part of ``step``'s vector; every rank calls it once per step, in step order.

        ``params_sumsq``: this rank's share of the squared weight norm (``params_norm.py``; 0 where not
        measured: the caller knows at which steps every rank measures)."""
        parts = components or {}
        vec = pack(self.state, [loss, *(parts.get(key) for key in self.loss_keys)],
                   [float(signal), float(duration), float(params_sumsq)], row, tail)
        self.tail = len(tail)
        work = dist.all_reduce(vec, group=self.group, async_op=True) if self.group is not None else None
        self._pending.append((step, vec, work))

    def ready(self, through: int) -> list[StepStats]:
        """Wait for every issued step up to ``through`` (blocking); their numbers, in step order."""
        out = []
        while self._pending and self._pending[0][0] <= through:
            step, vec, work = self._pending.popleft()
            if work is not None:
                work.wait()
            out.append(self._decode(step, vec.tolist()))
        return out

    def drain(self) -> list[StepStats]:
        """Wait for every issued step (at the end of a segment)."""
        return self.ready(self._pending[-1][0]) if self._pending else []

    def _decode(self, step: int, vals: list[float]) -> StepStats:
        nk = len(self.loss_keys)
        comps = dict(zip(self.loss_keys, vals[1:1 + nk]))
        sq = vals[3 + nk]
        n = len(vals) - self.tail
        return StepStats(step, vals[0], comps, vals[1 + nk] > 0, vals[2 + nk] > 0,
                         stage_dicts(vals[4 + nk:n], self.state.d), params_norm=max(sq, 0.0) ** 0.5,
                         tail=vals[n:])
