"""2BW with a stale-gradient compensation equals its plain-PyTorch reference under every layout.

The reference (``test_2bw_semantics.reference_2bw``) is written with torch.optim and
functional_call, independently of the engine; the single-process runs are checked against it
there, the multi-process layouts (d in {1, 2}, w in {1, 2}) here. Also: what ``predict`` costs in
memory per precision, that draining between segments changes nothing, and the refusals.
"""

import pytest
import torch
from multiproc import run_workers
from pipeline_harness import matching_shard, train_tiny
from test_2bw_semantics import DC_LAMBDA, LR, MICRO, MUON, STEPS, WD, B, fp32_newton_schulz, reference_2bw

from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.pipeline.updater import Updater
from megatron_2bw.pipeline.weights import sized_weights

MODES = ("none", "predict", "dc")
LAYOUTS = [(1, 2, 1), (1, 1, 2), (1, 2, 2)]  # (t, d, w); (1, 1, 1) is test_2bw_semantics
KW = dict(steps=STEPS, global_batch=B, micro=MICRO, optimizer="adam", lr=LR["adam"], weight_decay=WD)


def _lam(mode: str) -> float:
    return DC_LAMBDA if mode == "dc" else 0.0


@pytest.fixture(scope="module")
def references():
    return {mode: reference_2bw("adam", mode, _lam(mode)) for mode in MODES}


def _all_modes(layout):
    return {mode: train_tiny("2bw", layout=layout, compensation=mode, dc_lambda=_lam(mode), **KW) for mode in MODES}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "t{}d{}w{}".format(*l))
def test_layout_equals_reference_in_every_mode(layout, references):
    t, d, w = layout
    outs = run_workers(_all_modes, t * d * w, layout, timeout=420)
    for mode in MODES:
        ref_losses, ref_params = references[mode]
        last = [o[mode] for o in outs if o[mode]["last"]]
        for o in last:
            torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        seen = set()
        for o in outs:
            for name, p in o[mode]["params"].items():
                want = matching_shard(ref_params[name], p, o[mode]["coords"][0], o[mode]["t"])
                torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, mode=mode, name=name: f"{mode} {name}: {m}")
                seen.add(name)
        assert seen == set(ref_params), "layout does not cover every parameter"


def test_predict_memory_per_precision():
    """bf16: the prediction lives in the idle version buffer (no extra bytes); fp32: one fp32 weight copy."""
    def weights(dtype, mode):
        return train_tiny("2bw", dtype=dtype, compensation=mode, **dict(KW, steps=2))["stats"]["weight_bytes"]

    numel = sum(p.numel() for p in train_tiny("2bw", **dict(KW, steps=1))["params"].values())
    assert weights("bf16", "predict") == weights("bf16", "none") == 2 * numel * 2 + numel * 4
    assert weights("fp32", "predict") == weights("fp32", "none") + numel * 4 == 3 * numel * 4
    assert weights("fp32", "dc") == weights("fp32", "none")


def test_bf16_predict_tracks_the_fp32_reference():
    """The bf16 prediction (fp32 master -> bf16 idle buffer) follows the exact fp32 rule to bf16 precision."""
    ref_losses, _ = reference_2bw("adam", "predict")
    none_losses, _ = reference_2bw("adam", "none")
    got = train_tiny("2bw", dtype="bf16", compensation="predict", **KW)["losses"]
    err = max(abs(a - b) for a, b in zip(got, ref_losses))
    assert err < 2e-2, (got, ref_losses)
    assert max(abs(a - b) for a, b in zip(ref_losses, none_losses)) > 1e-4  # predict changes the losses at all


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["predict", "dc"])
def test_draining_and_resuming_between_segments_changes_nothing(mode, dtype):
    """Drained after steps 2 and 3 (evaluation, checkpoint), or resumed there from the stage's state_dict
    in a fresh stage: bitwise the same losses and newest weights."""
    a = train_tiny("2bw", compensation=mode, dc_lambda=_lam(mode), dtype=dtype, **KW)
    for reload in (False, True):
        b = train_tiny("2bw", compensation=mode, dc_lambda=_lam(mode), dtype=dtype, segments=(2, 1, 3), reload=reload,
                       **KW)
        assert a["losses"] == b["losses"], reload
        assert all(a["params"][k].equal(b["params"][k]) for k in a["params"]), reload


def test_refusals():
    for schedule in ("flush", "gpipe"):
        with pytest.raises(ConfigError, match="only applies to --pipeline-schedule 2bw"):
            PipelineConfig(schedule, 1, 2, compensation="predict")
    with pytest.raises(ConfigError, match="--2bw-compensation must be one of"):
        PipelineConfig("2bw", 1, 2, compensation="spec")
    with pytest.raises(ConfigError, match="--2bw-dc-lambda"):
        PipelineConfig("2bw", 1, 2, compensation="dc", dc_lambda=-1.0)
    w = sized_weights(64, dtype=torch.float32, device=torch.device("cpu"), params_per_view=16)
    with pytest.raises(ConfigError, match="needs a momentum"):
        Updater(w, OptimizerConfig("sgd", sgd_momentum=0.0), "predict")


# --------------------------------------------------------------------------- ef, every optimizer
EF_LAYOUTS = [(1, 2, 1), (2, 2, 2)]  # (t, d, w); (1, 1, 1): test_2bw_semantics
EF_OPTIMIZERS = ("adam", "muon")


def _ef_kw(optimizer: str) -> dict:
    return dict(steps=STEPS, global_batch=B, micro=MICRO, optimizer=optimizer, lr=LR[optimizer], weight_decay=WD,
                compensation="ef", opt_extra=MUON if optimizer == "muon" else None)


def _ef_runs(layout):
    with fp32_newton_schulz():  # Muon's comparison across code paths (test_2bw_semantics)
        return {o: train_tiny("2bw", layout=layout, **_ef_kw(o)) for o in EF_OPTIMIZERS}


@pytest.mark.parametrize("layout", EF_LAYOUTS, ids=lambda l: "t{}d{}w{}".format(*l))
def test_ef_equals_reference_under_every_layout(layout):
    """``ef`` (x += D_t + (D_t - D_{t-1}), error feedback on the optimizer's updates) under AdamW and Muon at
    (t, d, w), against the plain-PyTorch rule (torch.optim on its iterate, the corrected weights apart)."""
    t, d, w = layout
    with fp32_newton_schulz():
        refs = {o: reference_2bw(o, "ef", 1.0) for o in EF_OPTIMIZERS}
    outs = run_workers(_ef_runs, t * d * w, layout, timeout=420)
    for o in EF_OPTIMIZERS:
        ref_losses, ref_params = refs[o]
        for r in outs:
            if r[o]["last"]:
                torch.testing.assert_close(torch.tensor(r[o]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        seen = set()
        for r in outs:
            for name, p in r[o]["params"].items():
                want = matching_shard(ref_params[name], p, r[o]["coords"][0], r[o]["t"])
                _assert_close_ef(p, want, f"{o} {name}", LR[o] if t > 1 else 0.0)
                seen.add(name)
        assert seen == set(ref_params)


def _assert_close_ef(got: torch.Tensor, want: torch.Tensor, what: str, amplified_lr: float) -> None:
    """1e-5 (as the other layouts), except: at t > 1 (another summation order) an element whose gradient is
    near zero has an AdamW step m / sqrt(v) that a last-bit change of the gradient can move by up to ~lr
    per step, which ef then doubles; those few elements (<= 0.1%) are held to 2 * lr * STEPS."""
    bad = (got - want).abs() > 1e-5 + 1e-4 * want.abs()
    if amplified_lr == 0.0 or not bad.any():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    assert bad.float().mean().item() <= 1e-3, (what, int(bad.sum()))
    assert (got - want).abs().max().item() <= 2 * amplified_lr * STEPS, what


def test_ef_memory_is_one_fp32_buffer_per_parameter():
    """ef and extrapolate cost one fp32 buffer per parameter: ef's master iterate in fp32 (weight bytes),
    its scratch in bf16 (optimizer bytes), extrapolate's previous gradient; the planner counts the same,
    on 2BW only."""
    from megatron_2bw.planner.memory_model import ParamBytes

    def stats(mode, dtype="fp32"):
        st = train_tiny("2bw", dtype=dtype, compensation=mode, **dict(KW, steps=1))["stats"]
        return st["weight_bytes"] + st["optimizer_bytes"], st["optimizer_bytes"]

    numel = sum(p.numel() for p in train_tiny("2bw", **dict(KW, steps=1))["params"].values())
    for dtype in ("fp32", "bf16"):
        for mode in ("ef", "extrapolate"):
            assert stats(mode, dtype)[0] == stats("none", dtype)[0] + 4 * numel, (mode, dtype)
    assert stats("ef", "bf16")[1] == stats("none", "bf16")[1] + 4 * numel  # the scratch; the master exists anyway
    assert stats("ef", "fp32")[1] == stats("none", "fp32")[1]  # the master is the extra buffer
    for precision in ("fp32", "bf16"):
        for mode in ("ef", "extrapolate"):
            assert ParamBytes.for_precision(precision, compensation=mode).stale_correction == 4
    assert ParamBytes.for_precision("bf16", compensation="predict").stale_correction == 0
    assert ParamBytes.for_precision("fp32", compensation="predict").stale_correction == 4
    assert ParamBytes.for_precision("fp32", compensation="dc").stale_correction == 0


def test_ef_first_update_uncorrected_then_error_feedback():
    """``ef`` as published (Zmushko et al. 2026, Algorithm 1): x1 = x0 + D0, then x_{t+1} = x_t + D_t +
    gamma * (D_t - D_{t-1}), D_t the AdamW step of the optimizer's iterate y_t = x_t - gamma * D_{t-1};
    the Updater's version buffers and master against those lines in plain tensors, step for step."""
    n, gamma, lr, wd = 1024, 0.5, 1e-2, 0.1
    w = sized_weights(n, dtype=torch.float32, device=torch.device("cpu"), params_per_view=n // 4)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(n, generator=g)
    for buf in w.flat:
        buf.copy_(x0)
    upd = Updater(w, OptimizerConfig("adam", lr=lr, weight_decay=wd, adam_beta2=0.99, clip_grad=0.0), compensation="ef",
                  ef_scale=gamma)
    half = w.n_decay
    y = [x0[:half].clone().requires_grad_(True), x0[half:].clone().requires_grad_(True)]
    ref = torch.optim.AdamW([{"params": y[:1], "weight_decay": wd}, {"params": y[1:], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.99), eps=1e-8)
    x, d_prev = x0.clone(), None
    for step in range(4):
        grad = torch.randn(n, generator=g)
        w.grad_flat[w.grad_buffer(step)].copy_(grad)
        upd.apply(step, float(grad.square().sum()), lr)
        before = torch.cat([p.detach() for p in y])
        y[0].grad, y[1].grad = grad[:half].clone(), grad[half:].clone()
        ref.step()
        d = torch.cat([p.detach() for p in y]) - before
        x = x + d if d_prev is None else x + d + gamma * (d - d_prev)
        if d_prev is None:  # the master offset the first update implies: y1 = x1 - gamma * D0
            with torch.no_grad():
                y[0].sub_(gamma * d[:half])
                y[1].sub_(gamma * d[half:])
        d_prev = d
        torch.testing.assert_close(w.flat[w.slot(step + 1)], x, rtol=0, atol=1e-6, msg=f"weights after update {step}")
        torch.testing.assert_close(upd.master, torch.cat([p.detach() for p in y]), rtol=0, atol=1e-6)
    assert upd.optimizer.steps == 4
