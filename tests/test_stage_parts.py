"""The stage's parts on their own: the Updater against torch.optim, global parameter names
against the full model's, the transport's units against the grouping proof, checkpoint payloads,
RNG snapshots and the fault injector."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.faults import KILL_ITER_ENV, KILL_RANK_ENV, FaultInjector
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.pipeline.transport import Transport
from megatron_2bw.pipeline.updater import Updater
from megatron_2bw.pipeline.weights import GlobalNames, RankWeights, sized_weights
from megatron_2bw.schedule.grouping import COMM_OPS, comm_groups
from megatron_2bw.schedule.schedules import stage_actions
from megatron_2bw.schedule.stages import stage_range
from megatron_2bw.tensor_parallel.random import RNGTracker
from megatron_2bw.tensor_parallel.recompute import RNGSnapshot


def _adamw_reference(w0: torch.Tensor, n_decay: int, grads: list[torch.Tensor], lr: float, clip: float) -> torch.Tensor:
    a, b = nn.Parameter(w0[:n_decay].clone()), nn.Parameter(w0[n_decay:].clone())
    opt = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.99), eps=1e-8)
    for g in grads:
        a.grad, b.grad = g[:n_decay].clone(), g[n_decay:].clone()
        torch.nn.utils.clip_grad_norm_([a, b], clip)
        opt.step()
    return torch.cat([a.detach(), b.detach()])


@pytest.mark.parametrize("versions", [1, 2])
def test_updater_unscales_clips_and_steps_like_torch(versions):
    w = sized_weights(1000, dtype=torch.float32, device=torch.device("cpu"), num_versions=versions, params_per_view=100)
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(w.numel, generator=g)
    for f in w.flat:
        f.copy_(w0)
    upd = Updater(w, OptimizerConfig("adam", lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_beta2=0.99))
    grads, scale = [torch.randn(w.numel, generator=g) for _ in range(4)], 8.0
    upd.scaler.scale = scale  # a constant scale other than 1, to see the unscaling
    for t, grad in enumerate(grads):
        w.grad_flat[w.grad_buffer(t)].copy_(grad * scale)
        assert upd.loss_scale(t) == scale  # fixed for step t by its first backward
        out = upd.step_alone(t, 1e-2)
        assert out.norm == pytest.approx(float(grad.norm()), rel=1e-5) and not out.skipped
        assert torch.count_nonzero(w.grad_flat[w.grad_buffer(t)]) == 0
    torch.testing.assert_close(w.flat[w.slot(len(grads))], _adamw_reference(w0, w.n_decay, grads, 1e-2, 0.5),
                               rtol=1e-5, atol=1e-6)


def test_updater_skips_an_overflow_and_backs_off_the_scale():
    w = sized_weights(300, dtype=torch.float16, device=torch.device("cpu"), params_per_view=100)
    w.flat[0].normal_()
    upd = Updater(w, OptimizerConfig("adam", dtype="fp16", initial_loss_scale=1024.0))
    assert upd.master is not None and torch.equal(upd.master, w.flat[0].float())
    w.grad_flat[0].fill_(1.0)
    w.grad_flat[0][7] = float("inf")
    before = w.flat[0].clone()
    out = upd.step_alone(0, 1e-3)
    assert out.skipped and out.loss_scale == 1024.0 and upd.scaler.scale == 512.0
    assert torch.equal(w.flat[w.slot(1)], before)  # W(1) = W(0)
    assert torch.count_nonzero(w.grad_flat[0]) == 0


def _full_names(cfg, spec: ModelSpec) -> dict[str, torch.Size]:
    full = nn.ModuleList(spec.build(0, cfg.num_layers + 2))
    return {n: p.shape for n, p in full.named_parameters()}


@pytest.mark.parametrize("kind", ["gpt-tiny", "bert-tiny"])
def test_global_names_are_the_full_models_names(kind):
    cfg = get_preset(kind)
    spec = ModelSpec(cfg, ModelGroups(), 1234)
    full = _full_names(cfg, spec)
    d = 2
    seen: dict[str, torch.Size] = {}
    for r in range(d):
        start, _ = stage_range(cfg.num_layers, d, r)
        w = RankWeights(functools.partial(spec.build_stage, d, r), num_versions=1, dtype=torch.float32,
                         device=torch.device("cpu"), names=GlobalNames(start, tied=WORD))
        views = w.state_views(w.flat[0])
        assert len(views) == len(w.names)
        seen.update({n: v.shape for n, v in views.items()})
    assert seen == full  # the last stage's tied copy is named like the embedding's weight


def test_transport_units_are_the_proven_groups():
    acts = stage_actions("2bw", 2, 1, 4, 0, 3)
    grouped = Transport(0, None, (1, 2), torch.float32, torch.device("cpu"), mode="grouped")
    units = list(grouped.units(acts))
    assert [a for u in units for a in u] == acts
    starts = {}
    i = 0
    for u in units:
        if u[0].op in COMM_OPS:
            starts[i] = i + len(u)
        else:
            assert len(u) == 1
        i += len(u)
    assert starts == comm_groups(acts)


def test_rng_snapshot_restores_every_stream():
    tracker = RNGTracker(5, 0)
    snap = RNGSnapshot.from_dict(RNGSnapshot.capture(torch.device("cpu"), tracker, host_libraries=True).as_dict())
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(tracker.get_state().float().sum()))
    with tracker.fork():
        torch.rand(3)
    snap.restore(torch.device("cpu"), tracker)
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(tracker.get_state().float().sum()))
    assert again == first


def test_fault_injector_poisons_only_its_rank_and_step():
    faults = FaultInjector(poison_grads=frozenset({(1, 3)}))
    grad = torch.zeros(4)
    faults.poison(0, 3, grad)
    faults.poison(1, 2, grad)
    assert torch.isfinite(grad).all()
    faults.poison(1, 3, grad)
    assert grad[0] == float("inf") and torch.isfinite(grad[1:]).all()
    assert FaultInjector.from_env({}) is None
    assert (FaultInjector.from_env({KILL_RANK_ENV: "2", KILL_ITER_ENV: "5"})
            == FaultInjector(kill_rank=2, kill_iteration=5))


def test_fault_injector_kills_the_chosen_rank():
    code = ("from megatron_2bw.faults import FaultInjector\n"
            "f = FaultInjector(kill_rank=1, kill_iteration=3)\n"
            "f.before_forward(0, 9); f.before_forward(1, 2); print('alive', flush=True); f.before_forward(1, 3)\n"
            "print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 1 and res.stdout == "alive\n"
    assert "error: rank 1: fault injection" in res.stderr and "exiting at iteration 3" in res.stderr
