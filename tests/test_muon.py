"""Flat Muon (+ AdamW for the rest) against torch.optim.Muon and torch.optim.AdamW, in and out of place."""

import pytest
import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.optimizer import muon as muon_module
from megatron_2bw.optimizer.build import build_optimizer
from megatron_2bw.optimizer.muon import FlatMuon, MuonMatrix

SHAPES = [(24, 16), (16, 40), (32, 32)]  # tall, wide, square: both branches of NS and of the shape scale


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _layout():
    """Matrices at the front, then an AdamW-decayed 2-D tensor (an embedding) and vectors."""
    offsets, o = [], 0
    for a, b in SHAPES:
        offsets.append(o)
        o += a * b
    emb, vec = 10 * 8, 30
    return offsets, o, o + emb, o + emb + vec


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_flat_muon_equals_torch_muon_for_50_steps(nesterov, adjust, out_of_place, monkeypatch):
    monkeypatch.setattr(muon_module, "NS_DTYPE", torch.bfloat16)  # torch.optim.Muon's precision on every device
    g = torch.Generator().manual_seed(0)
    lr, wd, mu = 2e-2, 0.1, 0.9
    offsets, n_mat, n_decay, n = _layout()
    w0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(50)]
    opt = FlatMuon(n, n_decay, [MuonMatrix(o, s) for o, s in zip(offsets, SHAPES)], momentum=mu, nesterov=nesterov,
                   adjust_lr_fn=adjust, lr_ratio=10.0, betas=(0.9, 0.99), weight_decay=wd)
    bufs = [w0.clone(), torch.empty(n)]
    for i, gr in enumerate(grads):
        src, dst = (bufs[i % 2], bufs[(i + 1) % 2]) if out_of_place else (bufs[0], bufs[0])
        snapshot, grad_in = src.clone(), gr.clone()
        opt.update(src, dst, grad_in, lr=lr / 10)
        assert torch.equal(grad_in, gr)
        if out_of_place:
            assert torch.equal(src, snapshot)
    final = bufs[len(grads) % 2] if out_of_place else bufs[0]

    mats = [torch.nn.Parameter(w0[o:o + a * b].view(a, b).clone()) for o, (a, b) in zip(offsets, SHAPES)]
    emb = torch.nn.Parameter(w0[n_mat:n_decay].view(10, 8).clone())
    vec = torch.nn.Parameter(w0[n_decay:].clone())
    muon = torch.optim.Muon(mats, lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW([{"params": [emb], "weight_decay": wd}, {"params": [vec], "weight_decay": 0.0}],
                              lr=lr / 10, betas=(0.9, 0.99), eps=1e-8)
    for gr in grads:
        for p, o in zip(mats, offsets):
            p.grad = gr[o:o + p.numel()].view(p.shape).clone()
        emb.grad, vec.grad = gr[n_mat:n_decay].view(10, 8).clone(), gr[n_decay:].clone()
        muon.step()
        adamw.step()
    want = _flat([*mats, emb, vec]).detach()
    torch.testing.assert_close(final[:n_mat], want[:n_mat], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final[n_mat:], want[n_mat:], rtol=1e-5, atol=1e-6)
    # Muon really acts on the matrices: AdamW there ends elsewhere
    assert (final[:n_mat] - w0[:n_mat]).abs().max() > 0.1


def test_state_dict_round_trip_and_compact_second_moment():
    offsets, n_mat, n_decay, n = _layout()
    mats = [MuonMatrix(o, s) for o, s in zip(offsets, SHAPES)]
    a = FlatMuon(n, n_decay, mats, weight_decay=0.1)
    w, g = torch.randn(n), torch.Generator().manual_seed(3)
    for _ in range(3):
        a.update(w, w, torch.randn(n, generator=g), 1e-2)
    sd = a.state_dict()
    assert sd["exp_avg_sq"].numel() == n and sd["exp_avg_sq"][:n_mat].abs().sum() == 0
    assert a.state_bytes == (n + (n - n_mat)) * 4  # one buffer on the matrices, two on the rest
    b = FlatMuon(n, n_decay, mats, weight_decay=0.1)
    b.load_state_dict({k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd.items()})
    gr = torch.randn(n, generator=g)
    wa, wb = w.clone(), w.clone()
    a.update(wa, wa, gr, 1e-2)
    b.update(wb, wb, gr, 1e-2)
    assert torch.equal(wa, wb)


def test_config_validation_and_build():
    for kw, msg in [({"muon_momentum": 1.0}, "--muon-momentum"), ({"muon_ns_steps": 0}, "--muon-ns-steps"),
                    ({"muon_adjust_lr_fn": "x"}, "--muon-adjust-lr-fn"), ({"muon_lr": -1.0}, "--muon-lr"),
                    ({"optimizer": "lion"}, "--optimizer must be one of")]:
        with pytest.raises(ConfigError, match=msg):
            OptimizerConfig(**{"optimizer": "muon", **kw})
    opt = build_optimizer(OptimizerConfig("muon", lr=1e-3, muon_lr=2e-2), 10, 5, "cpu")
    assert isinstance(opt, FlatMuon) and opt.lr_ratio == pytest.approx(20.0)
