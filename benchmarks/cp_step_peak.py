"""Each rank's peak memory during a whole training step under context parallelism, against the planner (issue 44).

For each cell (sequence length s, context size c, ``--cp-comm-type`` p2p or all_gather, MHA or grouped-query
heads, with or without documents (``--reset-attention-mask``: the mask travels as ids) and attention dropout),
``c`` gloo processes build a tiny GPT (2 layers, hidden 64, 4 heads of 16, vocabulary 256, fp32, Adam) through
the engine (``ModelSpec`` + ``build_stage``: the trainer's stage code), and train ``--steps`` steps of one
microbatch (Flush, d = 1). A :class:`LiveBytes` mode is active on the training thread from before the model is
built: it counts the bytes of every storage an aten op created that is still alive (each storage once; a view
of an older tensor is not new), which is what the planner models (tensors, not the allocator's cache). Each
step's peak is the most bytes alive at once from its first op to its update; the Adam state exists from the build
on (the first step's peak equals the later ones'), and with ``--steps`` > 1 the median over the steps after the
first is the one compared.

The planner's figure for the same layout is ``memory_model.stage_memory(...).total`` on
``context_costs.context_microbatch_costs`` (the cpu-host cluster with the run's ``--attention-backend`` and
``reset_attention_mask``): weights, gradients, Adam state, the microbatch's activations and the largest block's
workspace (the ring's, ``ring_workspace_bytes``). Both are per rank; ``ratio`` = measured / planned, for the
whole and for the part above the static state (activations + workspace), side by side.

Not seen by the mode: allocations on the gradient reducer's worker thread (a few 4-byte norms), the kernels'
internal scratch (a few hundred KiB per thread) and the prebuilt batches (token ids, document ids).

``docs/data/cp_step_peak.json`` is these runs, one after the other (``J=docs/data/cp_step_peak.json``), then
``--json $J --replan``::

    PYTHONPATH=$PWD python benchmarks/cp_step_peak.py --json $J --append --seq 16384 --c 2
    ... --seq 16384 --c 2 --comm p2p --documents none --dropout 0.1
    ... --seq 16384 --c 4                                   (gqa, then mha)
    ... --seq 32768 --c 4 --heads gqa --documents none
    ... --seq 32768 --c 4 --comm p2p --heads mha --documents documents
    ... --seq 32768 --c 2 --comm p2p --heads gqa --documents none
    ... --seq 32768 --c 2 --comm all_gather --heads gqa
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import common

LAYERS, HIDDEN, HEADS, GROUPS, VOCAB = 2, 64, 4, 2, 256
MiB = 2**20


def live_bytes_mode():
    """A ``TorchDispatchMode`` counting the bytes of live storages created under it (module docstring)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        """``live``: bytes of the tracked storages alive now; ``peak``: the most since :meth:`reset`."""

        def __init__(self) -> None:
            super().__init__()
            self.refs: dict[int, tuple] = {}
            self.live = self.peak = 0

        def reset(self) -> None:
            self._drop_expired()
            self.peak = self.live

        def _drop_expired(self) -> None:
            gone = [k for k, (ref, _) in self.refs.items() if ref.expired()]
            for k in gone:
                self.live -= self.refs.pop(k)[1]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            self._drop_expired()
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in ins and key not in self.refs:
                    self.refs[key] = (StorageWeakRef(st), st.nbytes())
                    self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            return out

    return LiveBytes()


def unobserved_causal_bias() -> None:
    """Make torch's bottom-right ``CausalBias`` outside any mode: a tensor subclass whose constructor's empty
    tensor gets a plain Python object under a dispatch mode and then fails to become the subclass (its zero
    bytes count for nothing; the kernels it dispatches to run under the mode as usual)."""
    import torch.nn.attention.bias as bias
    from torch.utils._python_dispatch import _disable_current_modes

    make = bias.causal_lower_right
    if getattr(make, "unobserved", False):
        return

    def made(*args):
        with _disable_current_modes():
            return make(*args)

    made.unobserved = True
    bias.causal_lower_right = made


def model_dict(cell: dict) -> dict:
    """The cell's ModelConfig fields (a plain dict: it travels to the spawned processes)."""
    gqa = {"group_query_attention": True, "num_query_groups": GROUPS} if cell["gqa"] else {}
    return dict(kind="gpt", num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                seq_length=cell["seq"], max_position_embeddings=cell["seq"], vocab_size=VOCAB, hidden_dropout=0.0,
                attention_dropout=cell["dropout"], **gqa)


def worker(cells: list[dict]) -> list[dict]:
    """One rank: each cell in turn (the same c): build, train its steps under the mode; each step's peak, the
    static bytes at its start, its time."""
    import torch.distributed as dist

    unobserved_causal_bias()
    out = [_cell_steps(cell) for cell in cells]
    dist.barrier()
    return out


def _cell_steps(cell: dict) -> dict:
    import torch

    from megatron_2bw.config import ModelConfig, OptimizerConfig, PipelineConfig
    from megatron_2bw.fused import Kernels
    from megatron_2bw.models.gpt import DocumentMasks
    from megatron_2bw.models.groups import ModelGroups
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import Axes, build_state
    from megatron_2bw.pipeline.build import build_stage

    c, b = cell["c"], 1
    state = build_state(Axes(context=c), torch.device("cpu"))
    cfg = ModelConfig(**model_dict(cell))
    masks = DocumentMasks(eod=0, reset_attention_mask=True) if cell["documents"] else None
    torch.manual_seed(1234)
    spec = ModelSpec(cfg, ModelGroups.of(state, cell["comm"]), 1234, kernels=Kernels(attention=cell["backend"]),
                     masks=masks)
    batches = [spec.make_batch(x) for x in common.token_pool(cfg, 2, b)]  # documents of about 256 tokens (eod 0)
    pipe = PipelineConfig("flush", b, 1, track_memory=False)
    opt = OptimizerConfig("adam", lr=1e-4, dtype="fp32")
    steps = []
    with live_bytes_mode() as mode:
        stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), state, pipe, opt,
                            cfg.stage_activation_shape(b, 1, c))
        for _ in range(cell["steps"]):
            mode.reset()
            static, t0 = mode.live, time.perf_counter()
            stage.train(1, lambda mb: batches[mb % len(batches)], lambda step: 1e-4)
            steps.append(dict(static=static, peak=mode.peak, seconds=time.perf_counter() - t0))
    return dict(cp_rank=state.cp_rank, steps=steps)


def planned(cell: dict) -> dict:
    """The planner's bytes per rank for the cell's layout (module docstring), term by term."""
    from dataclasses import replace

    from megatron_2bw.config import ModelConfig
    from megatron_2bw.planner.context_costs import context_microbatch_costs
    from megatron_2bw.planner.hardware import load_cluster
    from megatron_2bw.planner.memory_model import Candidate, ParamBytes, stage_memory

    cfg = ModelConfig(**model_dict(cell))
    cluster = replace(load_cluster("cpu-host"), attention_backend=cell["backend"],
                      reset_attention_mask=cell["documents"])
    costs = context_microbatch_costs(cfg, cluster, "fp32", 1, 1, cell["c"], cell["comm"])
    cand = Candidate(1, 1, 1, 1, 1, False, "flush", context_parallel=cell["c"], cp_comm_type=cell["comm"])
    mem = stage_memory(costs, cand, LAYERS, 0, ParamBytes.for_precision("fp32"))
    static = mem.weights + mem.second_weights + mem.grads + mem.optimizer
    return dict(total=mem.total, static=static, activations=mem.activations, workspace=mem.workspace)


def compare(measured: dict, plan: dict) -> dict:
    """Measured over planned, for the whole peak and for the part above the static state."""
    return dict(ratio=measured["peak"] / plan["total"],
                dynamic_ratio=(measured["peak"] - measured["static"]) / (plan["total"] - plan["static"]))


def within(measured: dict, plan: dict, tol: float = 0.05) -> bool:
    """Whether a rank's measured peak is within ``tol`` of the planner's figure (the issue's 5%)."""
    return abs(measured["peak"] - plan["total"]) <= tol * plan["total"]


CELL_KEYS = ("seq", "c", "comm", "gqa", "documents", "dropout", "backend", "steps")


def with_plan(row: dict) -> dict:
    """A measured row with the planner's figure for its cell beside it (``--replan``: the planner's of now)."""
    plan = planned({k: row[k] for k in CELL_KEYS})
    meas = dict(peak=row["measured_peak_bytes"], static=row["measured_static_bytes"])
    return dict(row, planned_bytes=plan["total"], planned_static_bytes=plan["static"],
                planned_activation_bytes=plan["activations"], planned_workspace_bytes=plan["workspace"],
                within_5_percent=within(meas, plan), **compare(meas, plan))


def run_cells(cells: list[dict]) -> list[dict]:
    """Cells of one c on ``c`` processes: a row per cell and rank, its steady step (the median over the steps
    after the first)."""
    rows, ranks = [], common.spawn(worker, cells[0]["c"], cells, timeout=3600.0)
    for i, cell in enumerate(cells):
        for r in (rank[i] for rank in ranks):
            steady = r["steps"][1:] or r["steps"]
            rows.append(with_plan(dict(cell, cp_rank=r["cp_rank"],
                                       measured_peak_bytes=int(common.median(s["peak"] for s in steady)),
                                       measured_static_bytes=int(common.median(s["static"] for s in steady)),
                                       first_step_peak_bytes=r["steps"][0]["peak"],
                                       step_seconds_median=common.median(s["seconds"] for s in steady))))
    return rows


def cells(args: argparse.Namespace) -> list[dict]:
    """Every combination of the flags, the s = 2c chunks dividing the sequence."""
    out = []
    for seq, c, comm, gqa, documents, dropout in itertools.product(
            args.seq, args.c, args.comm, args.heads, args.documents, args.dropout):
        out.append(dict(seq=seq, c=c, comm=comm, gqa=gqa == "gqa", documents=documents == "documents",
                        dropout=dropout, backend="auto", steps=args.steps))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096])
    p.add_argument("--c", type=int, nargs="+", default=[2])
    p.add_argument("--comm", nargs="+", default=["p2p", "all_gather"], choices=["p2p", "all_gather"])
    p.add_argument("--heads", nargs="+", default=["mha", "gqa"], choices=["mha", "gqa"])
    p.add_argument("--documents", nargs="+", default=["none", "documents"], choices=["none", "documents"])
    p.add_argument("--dropout", type=float, nargs="+", default=[0.0])
    p.add_argument("--steps", type=int, default=2, help="steps per cell (the median after the first is compared)")
    p.add_argument("--json", default=None, help="the results file (e.g. docs/data/cp_step_peak.json)")
    p.add_argument("--append", action="store_true", help="keep the rows already in --json (another set of cells)")
    p.add_argument("--replan", action="store_true",
                   help="run nothing: put the planner's figure of now beside --json's measured rows")
    args = p.parse_args(argv)
    rows = []
    if (args.append or args.replan) and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)["rows"]
    if args.replan:
        rows = [with_plan(r) for r in rows]
        _write(args.json, rows)
        return _summary(rows)
    for cell in cells(args):
        t0 = time.perf_counter()
        rows += run_cells([cell])
        r = rows[-1]
        print(f"s={cell['seq']} c={cell['c']} {cell['comm']} {'gqa' if cell['gqa'] else 'mha'} "
              f"docs={cell['documents']} p={cell['dropout']}: measured "
              + ", ".join(f"{x['measured_peak_bytes'] / MiB:.2f}" for x in rows[-cell['c']:])
              + f" MiB, planned {r['planned_bytes'] / MiB:.2f} MiB, ratio "
              + ", ".join(f"{x['ratio']:.4f}" for x in rows[-cell['c']:])
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        _write(args.json, rows)
    return _summary(rows)


def _write(path: str | None, rows: list[dict]) -> None:
    common.write_json(path, dict(benchmark="cp_step_peak", layers=LAYERS, hidden=HIDDEN, heads=HEADS, groups=GROUPS,
                                 vocab=VOCAB, machine=common.machine_info(), rows=rows))


def _summary(rows: list[dict]) -> int:
    """The worst ratio over cells, each on its fullest context rank (what the planner sizes)."""
    fullest: dict[tuple, float] = {}
    for r in rows:  # the planner sizes a stage's fullest context rank
        key = tuple(r[k] for k in ("seq", "c", "comm", "gqa", "documents", "dropout"))
        fullest[key] = max(fullest.get(key, 0.0), r["ratio"])
    worst = max(abs(x - 1) for x in fullest.values())
    print(f"largest |measured/planned - 1| on the fullest rank of each cell: {worst:.4f} (target 0.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
