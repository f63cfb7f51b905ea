"""interleaved-1f1b trains like the single-process run (synchronous: one weight version, flushed every step).

A covering subset of d in {2, 4}, m in {4, 8}, t in {1, 2}, kept cheap (one spawn per layout):
- t1 d2 m4 v2, tied embeddings (GPT's word embedding on rank 0's chunk 0 and its copy in rank 1's chunk 1),
  under both transports: gloo's prefetching and the grouped transfers NCCL needs (rounds on the ring);
  with dropout, recomputation replays every chunk's masks: bitwise equal to the run without it;
- t1 d4 m8 v2 (8 layers: one per virtual stage);
- t2 d2 m4 v2, tied, tensor-parallel shards.
Across code paths the comparison is a tolerance (Adam, lr 1e-3, 3 steps: the same bound as
test_pipeline_layouts' layouts); the in-flight count is the schedule's, in chunk stashes.
"""

from __future__ import annotations

import torch

from multiproc import run_workers
from pipeline_harness import train_tiny
from test_pipeline_layouts import compare

from megatron_2bw.pipeline.schedules import get_schedule

NAME = "interleaved-1f1b"
KW = dict(steps=3, lr=1e-3, global_batch=8)


def _d2(layout):
    kw = dict(KW, micro=2, virtual_stages=2)
    return {
        "prefetch": train_tiny(NAME, layout=layout, **kw),
        "grouped": train_tiny(NAME, layout=layout, p2p_mode="grouped", **kw),
        "dropout": train_tiny(NAME, layout=layout, dropout=0.1, **kw),
        "dropout+recompute": train_tiny(NAME, layout=layout, dropout=0.1, recompute=True, **kw),
    }


def _one(layout, kw):
    return train_tiny(NAME, layout=layout, **kw)


def _check_inflight(outs, d, v=2):
    spec = get_schedule(NAME, v)
    for o in outs:
        r = o["coords"][2]
        assert o["stats"]["max_inflight"] == spec.inflight(d, r, o["m"]), (r, o["stats"])


def test_d2_m4_matches_single_process_both_transports_and_recompute_replays_dropout():
    ref = train_tiny("flush", **dict(KW, micro=2))
    outs = run_workers(_d2, 2, (1, 2, 1), timeout=300)
    for mode in ("prefetch", "grouped"):
        got = [o[mode] for o in outs]
        assert got[0]["m"] == 4
        dloss, dparam = compare(got, ref)
        assert dloss < 2e-5 and dparam < 1e-4, (mode, dloss, dparam)
        _check_inflight(got, 2)
    for o in outs:  # the same path with and without recomputation: bitwise
        a, b = o["dropout"], o["dropout+recompute"]
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert b["stats"]["peak_stashed_bytes"] < a["stats"]["peak_stashed_bytes"]
    last = next(o for o in outs if o["prefetch"]["last"])
    assert last["dropout"]["losses"] != last["prefetch"]["losses"]  # dropout did act


def test_d4_m8_matches_single_process():
    kw = dict(KW, micro=1, num_layers=8, virtual_stages=2)
    ref = train_tiny("flush", **{k: v for k, v in kw.items() if k != "virtual_stages"})
    outs = run_workers(_one, 4, (1, 4, 1), kw, timeout=300)
    assert outs[0]["m"] == 8
    dloss, dparam = compare(outs, ref)
    assert dloss < 2e-5 and dparam < 1e-4, (dloss, dparam)
    _check_inflight(outs, 4)


def test_t2_d2_m4_tied_matches_single_process():
    kw = dict(KW, micro=2, virtual_stages=2)
    ref = train_tiny("flush", **{k: v for k, v in kw.items() if k != "virtual_stages"})
    outs = run_workers(_one, 4, (2, 2, 1), kw, timeout=300)
    dloss, dparam = compare(outs, ref)
    assert dloss < 2e-5 and dparam < 1e-4, (dloss, dparam)
    _check_inflight(outs, 2)
