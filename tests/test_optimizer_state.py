"""Each optimizer states its checkpointable state once (``state_spans``), and both checkpoint formats read it.

- The spans are the live tensors: a whole tensor built from them, loaded back, leaves the optimizer as it
  was; Muon's second moment covers the AdamW elements only (zeros on its matrices in a whole tensor).
- gpu-review-2 N10: a ``--ckpt-format torch_dist`` save and restore of a Muon stage gives back Adam's
  second moment (it was restored as zeros: DCP read into a temporary). Every state family is compared
  with the saved stage's, bitwise, for Muon, Adam and SGD.
"""

from __future__ import annotations

import pytest
import torch

from megatron_2bw.checkpoint import dist_checkpoint as dc
from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.optimizer.flat import FlatAdam, FlatSGD
from megatron_2bw.optimizer.muon import FlatMuon, MuonMatrix
from megatron_2bw.optimizer.state import holes, whole
from megatron_2bw.parallel_state import ParallelState
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.weights import GlobalNames
from megatron_2bw.tensor_parallel.random import RNGTracker

CPU = torch.device("cpu")


def _optimizers(n: int = 200):
    mats = [MuonMatrix(0, (8, 10)), MuonMatrix(100, (5, 10))]  # AdamW on [80, 100) and [150, 200)
    return {"adam": FlatAdam(n, 100), "sgd": FlatSGD(n, 100, momentum=0.9),
            "muon": FlatMuon(n, 100, mats, weight_decay=0.1)}


@pytest.mark.parametrize("name", ["adam", "sgd", "muon"])
def test_spans_are_the_live_state_and_round_trip(name):
    opt = _optimizers()[name]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, generator=g)
    for _ in range(3):
        opt.update(w, w, torch.randn(200, generator=g), 1e-2)
    sd = opt.state_dict()
    kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    for spans in opt.state_spans().values():  # the spans are the storage the update writes
        for _, t in spans:
            t.zero_()
    assert all(float(v.abs().sum()) == 0 for v in opt.state_dict().values() if isinstance(v, torch.Tensor))
    opt.load_state_dict(kept)
    assert opt.steps == 3
    for k, v in opt.state_dict().items():
        assert torch.equal(v, kept[k]) if isinstance(v, torch.Tensor) else v == kept[k], k
    assert opt.state_bytes == sum(t.numel() * 4 for s in opt.state_spans().values() for _, t in s)


def test_muon_second_moment_covers_the_adamw_elements_only():
    opt = _optimizers()["muon"]
    spans = opt.state_spans()["exp_avg_sq"]
    assert holes(spans, 200) == [(0, 80), (100, 150)]  # the two matrices
    opt.update(torch.zeros(200), torch.zeros(200), torch.ones(200), 1e-2)
    sq = whole(spans, 200)
    assert float(sq[:80].abs().sum()) == 0 and float(sq[100:150].abs().sum()) == 0 and bool((sq[80:100] > 0).all())


def _stage(optimizer: str, dtype: str = "fp32"):
    cfg = get_preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0)
    tracker = RNGTracker(7, 0)
    spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker)
    opt = OptimizerConfig(optimizer, lr=1e-2, dtype=dtype, sgd_momentum=0.9)
    stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), ParallelState.single(),
                        PipelineConfig("flush", 1, 2), opt, (1, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker,
                        names=GlobalNames(0, tied=WORD))
    config = {"model": cfg.__dict__, "optimizer": opt.__dict__, "pipeline": {"layer_split": None}}
    return stage, spec, config


@pytest.mark.parametrize("optimizer", ["muon", "adam", "sgd"])
def test_torch_dist_restores_every_state_family(tmp_path, optimizer):
    """The review's N10 repro (gpt-tiny, flush, 3 steps): after a torch_dist save and restore into a fresh stage,
    every span the updater states (master, moments, momentum) and the step count equal the saved ones."""
    saved, spec, config = _stage(optimizer, "bf16")
    data = torch.randint(0, spec.cfg.vocab_size, (8, spec.cfg.seq_length + 1),
                         generator=torch.Generator().manual_seed(0))
    saved.train(3, lambda mb: spec.make_batch(data[mb % 8:mb % 8 + 1]), lambda t: 1e-2)
    common = dc.common_state(saved, iteration=3, config=config, args={}, consumed_samples=12, global_batch=4)
    dc.save(str(tmp_path), 3, saved, saved.rng, common)
    fresh, _, _ = _stage(optimizer, "bf16")
    dc.restore(dc.read_checkpoint(str(tmp_path), 3, 0, 1, (1, 1, 1, None)), fresh, fresh.rng, CPU)
    want, got = saved.updater.state_spans(), fresh.updater.state_spans()
    assert sorted(want) == sorted(got) and "master" in want
    n = saved.updater.optimizer.numel
    for name in want:
        a, b = whole(want[name], n), whole(got[name], n)
        assert float(a.abs().sum()) > 0 and torch.equal(a, b), name
    assert fresh.updater.state_scalars() == saved.updater.state_scalars() == {"steps": 3}
