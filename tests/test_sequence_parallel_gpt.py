"""GPT (learned absolute positions, LayerNorm, biases) under sequence parallelism equals the single process.

Each tensor rank adds only its sequence slice of the position embedding, so each computes the gradient of
its own rows only; the replicated table stays equal on every rank only if those gradients are summed over
the tensor group (Megatron adds the full table before scattering the sequence, whose backward gathers).
Llama (rotary positions) is covered by ``test_llama.py``'s layouts."""

from __future__ import annotations

import pytest
from multiproc import run_workers
from pipeline_harness import matching_shard, train_tiny

KW = dict(kind="gpt-tiny", steps=4, global_batch=4, lr=0.1, optimizer="sgd")  # SGD: Adam turns the rounding
# noise of the key bias's gradient (0 in exact arithmetic: softmax ignores it) into lr-sized steps


def _runs(layout):
    return [train_tiny("flush", layout=layout, sequence_parallel=True, **KW),
            train_tiny("flush", layout=layout, sequence_parallel=True, **{**KW, "clip": 1.0})]


@pytest.mark.parametrize("layout", [(2, 1, 1), (2, 2, 1)], ids=["t2d1", "t2d2"])
def test_gpt_sequence_parallel_matches_single_process(layout):
    t = layout[0]
    refs = [train_tiny("flush", **KW), train_tiny("flush", **{**KW, "clip": 1.0})]
    outs = run_workers(_runs, t * layout[1] * layout[2], layout, timeout=240)
    for k, ref in enumerate(refs):
        runs = [o[k] for o in outs]
        dloss = max(abs(a - b) for r in runs if r["last"] for a, b in zip(r["losses"], ref["losses"]))
        dparam = max((matching_shard(ref["params"][n], p, r["coords"][0], t) - p).abs().max().item()
                     for r in runs for n, p in r["params"].items())
        assert dloss < 1e-5 and dparam < 1e-5, (k, dloss, dparam)
