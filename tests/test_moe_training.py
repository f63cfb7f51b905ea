"""An MoE GPT trained through the CLI (pretrain_gpt.py's ``main``) equals the single process (issue 42).

Each cell is the same tiny run (gpt-tiny, 2 layers, 4 experts top-2 with the aux and z losses, mock data, fp32,
10 steps of a global batch of 4) at another layout; every step's loss equals the single process's within 1e-5
(the experts' sums in another order across expert ranks; nothing else differs). The vocabulary, 256, is padded
alike at t = 1 and 2 (padded logits enter the softmax) and --use-cpu-initialization draws layout-free values.
References: the single process under Flush for the flushing schedules, under 2BW for 2BW (its own update rule at
one stage). Cells of one world size share one set of processes, every cell one CLI session in them.

Cells (t, d, w, c, EP): expert parallelism 1, 2 and 4 (alltoall and allgather dispatchers), t = 2 with sequence
parallelism, pipelines Flush, 2BW and zb-h1 (EP = 2 across pipeline stages under every schedule:
test_moe_2bw.py), context parallelism 2 with EP folded inside it, Adam and Muon
(each expert's matrix orthogonalised alone), with and without the distributed optimizer.
"""

from __future__ import annotations

import json
import os

import pytest
from multiproc import run_workers

TOL = 1e-5
BASE = ["--model-preset", "gpt-tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "256", "--make-vocab-size-divisible-by", "64", "--device", "cpu", "--eval-iters", "0", "--log-interval", "1",
        "--seed", "1234", "--use-cpu-initialization",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
        "--attention-dropout", "0", "--hidden-dropout", "0"]
STEPS = ("--train-iters", "10")  # the matrix's run length (BASE's 3 serve the other MoE tests)
MUON = ("--optimizer", "muon")  # Newton-Schulz in fp32 in the workers (_runs): bf16 amplifies reordered sums
# (name, reference schedule, extra flags); the world is t * d * w * c
CELLS = [
    ("ep2-w2-flush-alltoall", "flush", ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                        "alltoall", "--pipeline-schedule", "flush")),
    ("ep1-t2-sp-flush", "flush", ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--pipeline-schedule", "flush")),
    ("ep1-d2-2bw", "2bw", ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw")),
    ("ep2-w2-flush-muon-zero", "flush-muon", ("--expert-model-parallel-size", "2", "--pipeline-schedule", "flush",
                                              "--use-distributed-optimizer", *MUON)),
    ("ep2-d2w2-flush-zero", "flush", ("--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                      "--pipeline-schedule", "flush", "--use-distributed-optimizer")),
    ("ep2-t2-sp-w2-flush", "flush", ("--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel", "--pipeline-schedule", "flush",
                                     "--moe-token-dispatcher-type", "alltoall")),
    ("ep2-c2-flush", "flush", ("--expert-model-parallel-size", "2", "--context-parallel-size", "2",
                               "--pipeline-schedule", "flush")),
    ("ep1-d2-zbh1", "flush", ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1")),
    ("ep4-w4-flush-zero", "flush", ("--expert-model-parallel-size", "4", "--pipeline-schedule", "flush",
                                    "--use-distributed-optimizer", "--moe-token-dispatcher-type", "alltoall")),
]
REFERENCES = {"flush": ("--pipeline-schedule", "flush"), "2bw": ("--pipeline-schedule", "2bw"),
              "flush-muon": ("--pipeline-schedule", "flush", *MUON)}


def _world(extra: tuple[str, ...]) -> int:
    n = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        if flag in extra:
            n *= int(extra[extra.index(flag) + 1])
    ep = int(extra[extra.index("--expert-model-parallel-size") + 1]) if "--expert-model-parallel-size" in extra else 1
    return n * (ep if "--context-parallel-size" not in extra else 1)


def _cli(argv: list[str], path: str) -> list[float] | None:
    """One pretrain_gpt.py session in this process; rank 0's per-step losses (None elsewhere)."""
    import torch.distributed as dist

    from megatron_2bw.training.launch import main

    keep = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # the session ends the group; the worker still needs it
    try:
        code = main("gpt", [*argv, "--metrics-file", path])
    finally:
        dist.destroy_process_group = keep
    assert code == 0, code
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if r.get("type") == "train"]


def _moe_records(path: str) -> list[dict] | None:
    """The ``moe`` statistics of every train record of a metrics file (None where there is no file)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [r.get("moe") for r in map(json.loads, f) if r.get("type") == "train"]


def _runs(cells: list[tuple[str, tuple[str, ...]]], root: str) -> list[tuple | None]:
    """Per cell on rank 0: (losses per step, the MoE statistics per step from the metrics file)."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.optimizer import muon

    muon.NS_DTYPE = torch.float32
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for name, extra in cells:
        path = os.path.join(root, f"{name}.{rank}.jsonl")
        losses = _cli([*BASE, *extra], path)
        out.append(None if losses is None else (losses, _moe_records(path)))
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[float]]:
    root = str(tmp_path_factory.mktemp("moe_ref"))
    names = sorted({ref for _, ref, _ in CELLS})
    (out,) = run_workers(_runs, 1, [(n, (*REFERENCES[n], *STEPS)) for n in names], root, timeout=600)
    return dict(zip(names, out))


def test_cells_cover_the_issue():
    """EP 1, 2 and 4, t 1 and 2 (with SP), Flush, 2BW and zb-h1, c 2, Adam and Muon, with and without ZeRO."""
    flags = [set(extra) for _, _, extra in CELLS]
    assert any("--expert-model-parallel-size" not in f for f in flags)
    assert any({"--expert-model-parallel-size", "--tensor-model-parallel-size"} <= f for f in flags)
    assert {e[e.index("--pipeline-schedule") + 1] for _, _, e in CELLS} >= {"flush", "2bw", "zb-h1"}
    assert any("--context-parallel-size" in f for f in flags) and any("muon" in f for f in flags)
    ep = "--expert-model-parallel-size"
    assert {e[e.index(ep) + 1] for _, _, e in CELLS if ep in e} == {"2", "4"}
    assert max(_world(e) for _, _, e in CELLS) <= 4


@pytest.mark.parametrize("world", sorted({_world(c[2]) for c in CELLS}))
def test_moe_training_matches_single_process(world, references, tmp_path):
    cells = [c for c in CELLS if _world(c[2]) == world]
    outs = run_workers(_runs, world, [(name, (*extra, *STEPS)) for name, _, extra in cells], str(tmp_path),
                       timeout=600)
    for k, (name, ref, extra) in enumerate(cells):
        (losses, moe), (want, want_moe) = outs[0][k], references[ref]
        assert losses is not None and len(losses) == len(want) == 10, (name, losses, want)
        diff = max(abs(a - b) for a, b in zip(losses, want))
        assert diff < TOL, (name, losses, want)
        _same_moe_statistics(name, extra, moe, want_moe)


def _same_moe_statistics(name: str, extra: tuple[str, ...], got: list[dict], want: list[dict]) -> None:
    """The metrics file's MoE statistics: every step's record names every MoE layer's, and they equal the single
    process's (the same microbatches, averaged over calls and data ranks); with context parallelism each rank
    routes half of each sequence, so only the names are compared there."""
    assert len(got) == len(want) == 10 and all(g and set(g) == set(w) for g, w in zip(got, want)), (name, got)
    assert {"load_balancing_loss layer 1", "z_loss layer 0", "tokens_per_expert_max_over_mean layer 1"} <= set(got[0])
    if "--context-parallel-size" in extra:
        return
    for g, w in zip(got, want):
        bad = {key: (g[key], w[key]) for key in w if abs(g[key] - w[key]) > 1e-4 * max(1.0, abs(w[key]))}
        assert not bad, (name, bad)


def test_a_logged_record_holds_the_window_since_the_last():
    """The metrics file's MoE values at a logged step are the means over every call since the last logged step
    (moe_metrics.Sums.merge), dropped tokens summed; the losses averaged over the layers."""
    import torch

    from megatron_2bw.training.moe_metrics import Sums

    steps = [Sums(), Sums()]
    steps[0].add(0, {"z_loss": torch.tensor(1.0), "dropped": torch.tensor(2.0)})
    steps[1].add(0, {"z_loss": torch.tensor(3.0), "dropped": torch.tensor(5.0)})
    steps[1].add(0, {"z_loss": torch.tensor(8.0), "dropped": torch.tensor(1.0)})
    steps[1].add(2, {"z_loss": torch.tensor(6.0)})
    window = Sums()
    for s in steps:
        window.merge(s)
    assert window.take() == {"z_loss layer 0": 4.0, "dropped_tokens layer 0": 8.0, "z_loss layer 2": 6.0,
                             "z_loss": 5.0}
    assert window.take() == {}  # the sums restart
