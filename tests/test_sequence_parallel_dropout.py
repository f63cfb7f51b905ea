"""Dropout under sequence parallelism, against a dense reference with the same masks.

Megatron draws dropout in sequence-parallel regions (the embedding's and the layers' hidden dropout on
each rank's sequence shard) and in tensor-parallel regions (attention probabilities of each rank's
heads) from the tensor-parallel RNG fork, so the ranks' masks differ. Here every dropout call of a
t = 2 sequence-parallel Llama run (hidden and attention dropout 0.1; ``--attention-backend unfused``
so that the attention dropout is an ``F.dropout`` call too) records the noise it drew; the ranks'
noises, joined along dim 1 (the sequence of ``[b, s, h]``, the heads of ``[b, a, s, s]``), are replayed
into a single-process run of the dense model. The SP run must equal it (fp32: 1e-5): masks at the
right positions, and the backward through them. The ranks' masks must differ (the fork), and the same
run with recomputation must equal it bitwise (the fork's state is replayed).
"""

from __future__ import annotations

import pipeline_harness
import torch
import torch.nn.functional as F
from multiproc import run_workers
from pipeline_harness import matching_shard, train_tiny

from megatron_2bw.fused import Kernels
from megatron_2bw.models.spec import ModelSpec

KW = dict(kind="llama-tiny", steps=2, global_batch=4, micro=2, lr=1e-3, dropout=0.1)
REAL_DROPOUT = F.dropout


class DropoutTape:
    """Stands in for ``F.dropout``: draws the noise the real one would (same RNG use), records it, and
    applies it; with ``replay``, applies the given noises in call order instead of drawing."""

    def __init__(self, replay: list[torch.Tensor] | None = None):
        self.noise: list[torch.Tensor] = []
        self.replay = replay

    def __call__(self, x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        if self.replay is not None:
            noise = self.replay[len(self.noise)]
            assert noise.shape == x.shape, (len(self.noise), noise.shape, x.shape)
        else:
            noise = REAL_DROPOUT(torch.ones_like(x), p, True)
        self.noise.append(noise.detach().clone())
        return x * noise


def _train(tape: DropoutTape, **kw):
    class Spec(ModelSpec):  # the unfused core: attention dropout is an F.dropout call
        def __init__(self, *args, **k):
            super().__init__(*args, kernels=Kernels(attention="unfused"), **k)

    saved = pipeline_harness.ModelSpec
    pipeline_harness.ModelSpec, F.dropout = Spec, tape
    try:
        return train_tiny("flush", **KW, **kw)
    finally:
        pipeline_harness.ModelSpec, F.dropout = saved, REAL_DROPOUT


def _sp_runs(_):
    tape = DropoutTape()
    run = _train(tape, layout=(2, 1, 1), sequence_parallel=True)
    again = _train(DropoutTape(), layout=(2, 1, 1), sequence_parallel=True, recompute=True)
    return run, tape.noise, again


def test_sp_dropout_equals_the_dense_model_with_the_ranks_masks():
    outs = run_workers(_sp_runs, 2, None, timeout=300)
    (r0, n0, a0), (r1, n1, a1) = outs
    assert len(n0) == len(n1) > 0
    assert r0["coords"][0] == 0 and r1["coords"][0] == 1
    joined = [torch.cat([x, y], 1) for x, y in zip(n0, n1)]
    # hidden ([b, s/2, h]) and attention ([b, a/2, s, s]) noises both came, and each rank drew its own
    kinds = {x.dim() for x in n0}
    assert kinds == {3, 4}
    assert all(not torch.equal(x, y) for x, y in zip(n0, n1))
    ref = _train(DropoutTape(replay=joined))
    dloss = max(abs(a - b) for a, b in zip(r0["losses"], ref["losses"]))
    assert dloss < 1e-5, dloss
    assert r0["losses"] == r1["losses"]
    for r in (r0, r1):
        for name, p in r["params"].items():
            err = (matching_shard(ref["params"][name], p, r["coords"][0], 2) - p).abs().max().item()
            assert err < 1e-5, (name, err)
    # a different draw moves the result: the comparison can tell masks apart
    other = _train(DropoutTape())
    assert max(abs(a - b) for a, b in zip(other["losses"], ref["losses"])) > 1e-4
    # recomputation replays the fork's draws: the same run, bitwise
    for r, a in ((r0, a0), (r1, a1)):
        assert a["losses"] == r["losses"]
        assert all(torch.equal(a["params"][n], r["params"][n]) for n in r["params"])


def test_tape_is_the_real_dropout():
    """The stand-in draws and applies exactly what ``F.dropout`` does (so the SP run above is the engine's)."""
    x = torch.randn(3, 5, 7)
    torch.manual_seed(3)
    want = REAL_DROPOUT(x, 0.1, True)
    torch.manual_seed(3)
    assert torch.equal(DropoutTape()(x, 0.1, True), want)
