"""Context parallelism at c = 2 trains like the single process (issue 36).

Each cell trains a tiny model 5 steps (fp32, SGD) with the sequence sharded over two context ranks and compares
every step's loss and every final weight with the single process's (1e-5: the ring's and the gather's block merges
reorder sums, the all-to-all's heads see the same sums; nothing else differs). The cells cover t in {1, 2} and d in
{1, 2}, every schedule family (Flush, 2BW, zero-bubble, interleaved), GPT (learned positions) and Llama (RoPE,
grouped-query attention), BERT (non-causal, the sentence-order loss on context rank 0), every communication type
(p2p, all_gather, a2a), sequence parallelism, recomputation, data parallelism and the distributed optimizer, and
packed documents (--reset-attention-mask, --reset-position-ids, --eod-mask-loss) with each type.
Cells of one world size share one set of processes.
"""

from __future__ import annotations

import pytest
from multiproc import run_workers
from pipeline_harness import matching_shard, train_tiny

KW = dict(steps=5, global_batch=4, lr=0.1, optimizer="sgd")  # no clipping: it would hide a gradient scaled by c
# (name, kind, schedule, (t, d, w), --cp-comm-type, extra train_tiny arguments); world = t * d * w * 2
CELLS = [
    ("gpt-flush-t1d1", "gpt-tiny", "flush", (1, 1, 1), "p2p", {}),
    ("bert-flush-t1d1", "bert-tiny", "flush", (1, 1, 1), "all_gather", {}),
    ("gpt-flush-t1d1-documents", "gpt-tiny", "flush", (1, 1, 1), "all_gather", {"documents": True}),
    ("gpt-2bw-t1d2-documents", "gpt-tiny", "2bw", (1, 2, 1), "p2p", {"documents": True}),
    ("gpt-2bw-t1d2-recompute", "gpt-tiny", "2bw", (1, 2, 1), "all_gather", {"recompute": True}),
    ("llama-2bw-t1d2", "llama-tiny", "2bw", (1, 2, 1), "p2p", {}),
    ("gpt-zbh1-t1d2", "gpt-tiny", "zb-h1", (1, 2, 1), "p2p", {}),
    ("llama-zbh2-t1d2", "llama-tiny", "zb-h2", (1, 2, 1), "all_gather", {}),
    ("gpt-interleaved-t1d2", "gpt-tiny", "interleaved-1f1b", (1, 2, 1), "all_gather", {"virtual_stages": 2}),
    ("llama-interleaved-t1d2", "llama-tiny", "interleaved-1f1b", (1, 2, 1), "p2p", {"virtual_stages": 2}),
    ("llama-flush-t2d1-sp", "llama-tiny", "flush", (2, 1, 1), "all_gather", {"sequence_parallel": True}),
    ("gpt-flush-t1d1w2-zero", "gpt-tiny", "flush", (1, 1, 2), "p2p", {"distributed_optimizer": True}),
    ("bert-2bw-t1d2", "bert-tiny", "2bw", (1, 2, 1), "p2p", {}),
    ("gpt-2bw-t2d2-sp", "gpt-tiny", "2bw", (2, 2, 1), "p2p", {"sequence_parallel": True}),
    ("gpt-2bw-t1d2-a2a", "gpt-tiny", "2bw", (1, 2, 1), "a2a", {}),
    ("llama-flush-t1d1-a2a-documents", "llama-tiny", "flush", (1, 1, 1), "a2a", {"documents": True}),
    ("bert-flush-t1d1-a2a", "bert-tiny", "flush", (1, 1, 1), "a2a", {}),
    ("gpt-2bw-t2d2-sp-a2a", "gpt-tiny", "2bw", (2, 2, 1), "a2a", {"sequence_parallel": True}),
]


def _world(cell) -> int:
    t, d, w = cell[3]
    return t * d * w * 2


def _cp_runs(cells):
    return [train_tiny(schedule, kind=kind, layout=layout, context=2, cp_comm_type=comm, **{**KW, **extra})
            for _, kind, schedule, layout, comm, extra in cells]


def _reference(cell) -> dict:
    """The single process: 2BW's own update rule (depth-free), Flush's for the flushing schedules."""
    _, kind, schedule, _, _, extra = cell
    return train_tiny("2bw" if schedule == "2bw" else "flush", kind=kind,
                      **{**KW, **{k: v for k, v in extra.items() if k in ("recompute", "documents")}})


def test_cells_cover_the_issue():
    """Every (t, d) in {1, 2}^2, every schedule family with GPT and Llama, every communication type."""
    assert {c[3][:2] for c in CELLS} >= {(1, 1), (1, 2), (2, 1), (2, 2)}
    for family in ("flush", "2bw", "zb", "interleaved"):
        assert {c[1] for c in CELLS if c[2].startswith(family)} >= {"gpt-tiny", "llama-tiny"}, family
    assert {c[4] for c in CELLS} == {"p2p", "all_gather", "a2a"}


@pytest.mark.parametrize("world", sorted({_world(c) for c in CELLS}))
def test_context_parallel_matches_single_process(world):
    cells = [c for c in CELLS if _world(c) == world]
    outs = run_workers(_cp_runs, world, cells, timeout=600)
    for k, cell in enumerate(cells):
        ref, t = _reference(cell), cell[3][0]
        runs = [o[k] for o in outs]
        dloss = max(abs(a - b) for r in runs if r["last"] for a, b in zip(r["losses"], ref["losses"]))
        dparam = max((matching_shard(ref["params"][n], p, r["coords"][0], t) - p).abs().max().item()
                     for r in runs for n, p in r["params"].items())
        assert dloss < 1e-5 and dparam < 1e-5, (cell[0], dloss, dparam)


def _config(*extra: str, world: int = 4):
    from megatron_2bw.cli import build_config, parse_args  # noqa: PLC0415

    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--lr", "1e-3",
            "--train-iters", "2", "--model-preset", "gpt-tiny", "--micro-batch-size", "1"]
    return build_config(parse_args([*base, *extra], "gpt"), "gpt", world, cuda_available=False)


@pytest.mark.parametrize("extra, world, message", [
    (("--context-parallel-size", "2"), 3, "world size 3 is not divisible by tensor-model-parallel-size 1 x "
                                          "pipeline-model-parallel-size 1 x context-parallel-size 2"),
    (("--context-parallel-size", "4", "--seq-length", "12", "--max-position-embeddings", "12"), 4,
     "--seq-length 12 is not divisible by 2 x --context-parallel-size 4"),
    (("--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "12",
      "--max-position-embeddings", "12"), 8, "--seq-length 12 / --context-parallel-size 2 is not divisible by "
                                             "--tensor-model-parallel-size 4"),
    (("--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"), 4, "invalid choice: 'a2a+p2p'"),
    (("--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tensor-model-parallel-size", "4"), 8,
     "--cp-comm-type a2a scatters attention heads over --context-parallel-size 2: a tensor rank's 1 heads and 1 "
     "key/value groups must both be divisible by 2"),
    (("--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--attention-backend", "flash"), 2,
     "--attention-backend flash takes no attention mask (--cp-comm-type all_gather's causal prefix mask)"),
])
def test_bad_context_parallel_layouts_are_one_line_errors(extra, world, message):
    from megatron_2bw.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError) as e:
        _config(*extra, world=world)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_context_parallel_layout_config():
    """c enters the world size and the printed command; the data width is what remains."""
    from megatron_2bw.argv import to_argv  # noqa: PLC0415

    cfg = _config("--context-parallel-size", "2", "--cp-comm-type", "all_gather", world=8)
    assert (cfg.parallel.context, cfg.parallel.data, cfg.parallel.world_size) == (2, 4, 8)
    argv = to_argv(cfg)
    assert argv[argv.index("--context-parallel-size") + 1] == "2" and "all_gather" in argv
    assert cfg.model.stage_activation_shape(1, 1, 2) == (1, cfg.model.seq_length // 2, cfg.model.hidden_size)
