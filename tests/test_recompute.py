"""Activation recomputation: same training as without it (dropout replayed), and a stash that
holds only stage inputs plus one microbatch's activations."""

import torch
from multiproc import run_workers
from pipeline_harness import train_tiny

KW = dict(steps=3, dropout=0.1, global_batch=8, micro=2, lr=1e-3)


def _both(layout, schedule):
    return {rc: train_tiny(schedule, layout=layout, recompute=rc, **KW) for rc in (False, True)}


def _check(outs, micro=2, seq=16, hidden=64):
    input_bytes = micro * seq * hidden * 4
    for o in outs:
        plain, rc = o[False], o[True]
        if plain["last"]:
            assert plain["losses"] == rc["losses"]  # bitwise: same dropout masks on replay
        for k, p in plain["params"].items():
            assert torch.equal(p, rc["params"][k]), k
        a_total = plain["stats"]["peak_stashed_bytes"] / plain["stats"]["max_inflight"]
        bound = rc["stats"]["max_inflight"] * input_bytes + a_total
        assert rc["stats"]["peak_stashed_bytes"] <= bound, (o[True]["coords"], rc["stats"], bound)
        # and it is a real saving whenever more than one microbatch is in flight
        if plain["stats"]["max_inflight"] > 1:
            assert rc["stats"]["peak_stashed_bytes"] < 0.75 * plain["stats"]["peak_stashed_bytes"]


def test_recompute_single_process_gpipe_and_2bw():
    for schedule in ("gpipe", "2bw"):
        _check([_both(None, schedule)])


def test_recompute_tensor_and_pipeline_parallel_2bw():
    _check(run_workers(_both, 4, (2, 2, 1), "2bw"))
