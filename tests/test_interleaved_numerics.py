"""interleaved-1f1b and zb-v train like the single-process run (synchronous: one weight version, flushed every step).

A covering subset of d in {2, 4}, m in {4, 8}, t in {1, 2}, kept cheap (one spawn per layout):
- t1 d2 m4 v2, tied embeddings (GPT's word embedding on rank 0's chunk 0 and its copy in rank 1's chunk 1),
  under both transports: gloo's prefetching and the grouped transfers NCCL needs (rounds on the ring);
  with dropout, recomputation replays every chunk's masks: bitwise equal to the run without it;
- t1 d4 m8 v2 (8 layers: one per virtual stage);
- t2 d2 m4 v2, tied, tensor-parallel shards.
zb-v (two chunks in a V: rank d-1 hands over to itself, rank 0 holds the embedding and the head, so the tied
embedding is one Parameter there; split backward) rides in the same processes: t1 d2 m4 under both
transports and with dropout replayed by recomputation, t1 d4 m8, t2 d2 m4 (grouped).
Across code paths the comparison is a tolerance (Adam, lr 1e-3, 3 steps: the same bound as
test_pipeline_layouts' layouts); the in-flight count is the schedule's, in chunk stashes.
"""

from __future__ import annotations

import torch
from multiproc import run_workers
from pipeline_harness import train_tiny
from test_pipeline_layouts import compare

from megatron_2bw.schedule.schedules import get_schedule

NAME = "interleaved-1f1b"
KW = dict(steps=3, lr=1e-3, global_batch=8)


SCHEDULES = (NAME, "zb-v")


def _d2(layout):
    out = {}
    for s in SCHEDULES:
        kw = dict(KW, micro=2, virtual_stages=2 if s == NAME else None)
        out[s] = {
            "prefetch": train_tiny(s, layout=layout, **kw),
            "grouped": train_tiny(s, layout=layout, p2p_mode="grouped", **kw),
            "dropout": train_tiny(s, layout=layout, dropout=0.1, **kw),
            "dropout+recompute": train_tiny(s, layout=layout, dropout=0.1, recompute=True, **kw),
        }
    return out


def _one(layout, kw):
    return {s: train_tiny(s, layout=layout, **kw, virtual_stages=2 if s == NAME else None) for s in SCHEDULES}


def _check_inflight(outs, d, name=NAME):
    spec = get_schedule(name)
    for o in outs:
        r = o["coords"][2]
        assert o["stats"]["max_inflight"] == spec.inflight(d, r, o["m"]), (r, o["stats"])


def test_d2_m4_matches_single_process_both_transports_and_recompute_replays_dropout():
    ref = train_tiny("flush", **dict(KW, micro=2))
    outs = run_workers(_d2, 2, (1, 2, 1), timeout=400)
    for s in SCHEDULES:
        for mode in ("prefetch", "grouped"):
            got = [o[s][mode] for o in outs]
            assert got[0]["m"] == 4
            dloss, dparam = compare(got, ref)
            assert dloss < 2e-5 and dparam < 1e-4, (s, mode, dloss, dparam)
            _check_inflight(got, 2, s)
        for o in outs:  # the same path with and without recomputation: bitwise
            a, b = o[s]["dropout"], o[s]["dropout+recompute"]
            assert a["losses"] == b["losses"]
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
            if s == NAME:  # (zb-v's deferred W holds the recomputed graph from I on: no saving there)
                assert b["stats"]["peak_stashed_bytes"] < a["stats"]["peak_stashed_bytes"]
        last = next(o[s] for o in outs if o[s]["prefetch"]["last"])
        assert last["dropout"]["losses"] != last["prefetch"]["losses"]  # dropout did act
    # the V puts the loss on rank 0
    assert [o["zb-v"]["prefetch"]["last"] for o in outs] == [True, False]


def test_d4_m8_matches_single_process():
    kw = dict(KW, micro=1, num_layers=8)
    ref = train_tiny("flush", **kw)
    outs = run_workers(_one, 4, (1, 4, 1), kw, timeout=400)
    for s in SCHEDULES:
        got = [o[s] for o in outs]
        assert got[0]["m"] == 8
        dloss, dparam = compare(got, ref)
        assert dloss < 2e-5 and dparam < 1e-4, (s, dloss, dparam)
        _check_inflight(got, 4, s)


def test_t2_d2_m4_tied_matches_single_process():
    kw = dict(KW, micro=2, p2p_mode="grouped")
    ref = train_tiny("flush", **dict(KW, micro=2))
    outs = run_workers(_one, 4, (2, 2, 1), kw, timeout=400)
    for s in SCHEDULES:
        got = [o[s] for o in outs]
        dloss, dparam = compare(got, ref)
        assert dloss < 2e-5 and dparam < 1e-4, (s, dloss, dparam)
        _check_inflight(got, 2, s)
