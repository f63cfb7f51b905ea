"""Engine-level resume cells (tests/test_resume_matrix.py): a tiny GPT stage at one (t, d, w) trains
``STEPS`` steps and saves after ``CUT`` in one checkpoint format; a fresh stage at the same or another
layout restores that checkpoint and trains the remaining steps. Both runs' losses come back.

Runs inside ``run_workers`` processes (world 4). The data is ``pipeline_harness``'s fixed token set
(step t's global batch is samples [t*B, (t+1)*B) at every layout), fp32, no dropout, clip 1.0.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from pipeline_harness import _dataset

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint import dist_checkpoint as dc
from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.checkpoint.trainer_reshard import read_trainer_checkpoint, write_trainer_checkpoint
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.optimizer import muon
from megatron_2bw.parallel_state import build_state
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.executor import PipelineRank
from megatron_2bw.pipeline.weights import GlobalNames
from megatron_2bw.schedule.schedules import get_schedule
from megatron_2bw.schedule.stages import chunk_ranges, stage_range
from megatron_2bw.tensor_parallel.random import RNGTracker

SEED, STEPS, CUT, GLOBAL, LR = 1234, 4, 2, 8, 1e-2
CPU = torch.device("cpu")
# the matrix's schedule values: (schedule, model chunks per rank, post-validation)
SCHEDULES = {"2bw": ("2bw", None, False), "flush": ("flush", None, False), "zb-h2+pv": ("zb-h2", None, True),
             "interleaved": ("interleaved-1f1b", 2, False)}
SAME, OTHER = (1, 2, 2), (2, 2, 1)  # (t, d, w) of the world of 4


@dataclasses.dataclass(frozen=True)
class Cell:
    optimizer: str  # adam, sgd (momentum 0.9), muon
    fmt: str  # torch, dist (torch_dist), async (torch_dist --async-save)
    schedule: str  # a key of SCHEDULES
    compensation: str  # none, ef, predict (2BW only)
    zero: bool  # the distributed optimizer
    other: bool  # resumed at another (t, d, w)

    def layouts(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(saving layout, resuming layout): with the distributed optimizer the resume is the sharded one."""
        if not self.other:
            return SAME, SAME
        return (OTHER, SAME) if self.zero else (SAME, OTHER)

    def __str__(self) -> str:
        return (f"{self.optimizer}/{self.fmt}/{self.schedule}/{self.compensation}/"
                f"{'zero' if self.zero else 'plain'}/{'other' if self.other else 'same'}")


@dataclasses.dataclass
class Run:
    stage: PipelineRank
    state: object
    tracker: RNGTracker
    config: dict
    get_batch: object


def build(cell: Cell, layout: tuple[int, int, int]) -> Run:
    """A fresh stage of the tiny GPT at ``layout`` for ``cell`` (as ``pipeline_harness.train_tiny`` builds it)."""
    t, d, w = layout
    state = build_state(Axes(tensor=t, data=w, pipeline=d), CPU)
    cfg = get_preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(SEED)
    tracker = RNGTracker(SEED, state.tp_rank)
    spec = ModelSpec(cfg, ModelGroups.of(state), SEED, rng=tracker)
    schedule, v, pv = SCHEDULES[cell.schedule]
    m = GLOBAL // w
    pipe = PipelineConfig(schedule, 1, m, compensation=cell.compensation, virtual_stages=v, post_validation=pv)
    opt = OptimizerConfig(cell.optimizer, lr=LR, weight_decay=0.01, clip_grad=1.0, dtype="fp32", adam_beta2=0.99,
                          sgd_momentum=0.9, use_distributed_optimizer=cell.zero)
    names = GlobalNames(stage_range(cfg.num_layers, d, state.pp_rank)[0], tied=WORD)
    layers = lambda: spec.build_stage(d, state.pp_rank)  # noqa: E731
    if pipe.chunks > 1:
        place = get_schedule(schedule, v).placement(d)
        ranges = chunk_ranges(cfg.num_layers, place.stages_of(state.pp_rank), place.num_stages)
        names = GlobalNames.of_chunks(ranges, tied=WORD)
        layers = lambda: spec.build_chunks(ranges)  # noqa: E731
    stage = build_stage(layers, spec.loss_fn(), state, pipe, opt, cfg.stage_activation_shape(1, t),
                          rng_tracker=tracker, names=names)
    data = _dataset(cfg, GLOBAL * STEPS)

    def get_batch(mb: int) -> dict:
        step, i = divmod(mb, m)
        lo = step * GLOBAL + state.dp_rank * (GLOBAL // w) + i
        return spec.make_batch(data[lo:lo + 1])

    config = {"model": dataclasses.asdict(cfg), "optimizer": dataclasses.asdict(opt),
              "pipeline": {"schedule": schedule, "layer_split": None, "virtual_stages": v}}
    return Run(stage, state, tracker, config, get_batch)


def train(run: Run, steps: int) -> list[float]:
    """The global losses of the next ``steps`` steps, on every rank (mean over the replicas)."""
    results = run.stage.train(steps, run.get_batch, lambda step: LR)
    st = run.state
    mine = [r.loss for r in results] if st.holds_loss and st.tp_rank == 0 else [0.0] * steps
    x = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(x)
    return (x / st.replicas).tolist()


def save(run: Run, fmt: str, root: str, writer) -> None:
    st = run.stage
    if fmt == "torch":
        ck.save(root, CUT, run.state, lambda: ck.payload(st, iteration=CUT, tracker=run.tracker,
                                                         consumed_samples=CUT * GLOBAL, global_batch=GLOBAL,
                                                         config=run.config, args={}))
        return
    common = dc.common_state(st, iteration=CUT, config=run.config, args={}, consumed_samples=CUT * GLOBAL,
                             global_batch=GLOBAL)
    dc.save(root, CUT, st, run.tracker, common, writer)


def restore(run: Run, fmt: str, root: str) -> None:
    st = run.state
    if fmt == "torch":
        ck.restore(ck.load_rank_file(root, CUT, st.t, st.d, st.tp_rank, st.pp_rank), run.stage, run.tracker, CPU)
        return
    sd = dc.read_checkpoint(root, CUT, dist.get_rank(), dist.get_world_size(), (st.t, st.d, st.replicas, None))
    dc.restore(sd, run.stage, run.tracker, CPU)


def run_cells(cells: list[Cell], root: str) -> list[tuple[list[float], list[float]]]:
    """Each cell's (uninterrupted losses of steps CUT..STEPS-1, resumed losses of those steps), on every rank.

    The uninterrupted run is the saving run itself, which trains on after the save (an asynchronous
    save is still being written while it does). Muon's Newton-Schulz runs in fp32 (``NS_DTYPE``) so
    that a resume at another layout differs from the uninterrupted run only by summation order."""
    muon.NS_DTYPE = torch.float32
    out = []
    for k, cell in enumerate(cells):
        saving, resuming = cell.layouts()
        path = os.path.join(root, f"cell{k}")
        run = build(cell, saving)
        train(run, CUT)
        writer = dc.AsyncWriter() if cell.fmt == "async" else None
        save(run, cell.fmt, path, writer)
        straight = train(run, STEPS - CUT)
        if writer is not None:
            writer.wait()
        dist.barrier()
        if cell.fmt == "torch" and resuming[:2] != saving[:2]:  # the torch format reshards offline
            if dist.get_rank() == 0:
                write_trainer_checkpoint(path + ".resharded", read_trainer_checkpoint(path), t=resuming[0],
                                         d=resuming[1], schedule=None)
            dist.barrier()
            path += ".resharded"
        again = build(cell, resuming)
        restore(again, cell.fmt, path)
        out.append((straight, train(again, STEPS - CUT)))
    return out
