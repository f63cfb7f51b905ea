"""The single-process 2BW run equals an independent plain-PyTorch reference of its update rule.

Reference: W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0), for SGD; and Adam(W) whose
(unversioned) state consumes the 1-stale gradient and updates the newest weights. Written here
with torch.func.functional_call and torch.optim, sharing nothing with the engine but the model.

With a compensation (``--2bw-compensation``): ``predict`` runs step t's microbatches on
P(W(max(t-1, 0))), P = one more torch.optim step (on a copy of the weights and the optimizer
state) whose gradient is the bias-corrected first moment (Adam) or (1-mu)*buf - wd*W (SGD, the
gradient that leaves the momentum buffer unchanged); ``dc`` gives the optimizer
g + lambda * g * g * (W(t) - W(t-1)).
"""

import contextlib
import copy

import pytest
import torch
from pipeline_harness import train_tiny
from torch import nn
from torch.func import functional_call

from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec, run_layers

STEPS, B, MICRO, WD = 6, 8, 2, 0.01
# Adam's normalization amplifies last-bit differences of near-zero gradients by ~lr; keep it small
LR = {"sgd": 1e-2, "adam": 1e-3, "muon": 1e-3}  # muon: AdamW's part; the matrices take MUON_LR
MUON_LR = 2e-2
MUON = {"muon_lr": MUON_LR}


def _predicted(newest: dict, opt: torch.optim.Optimizer, optimizer: str, momentum: float) -> dict:
    """P(W): the weights after one more step of a copy of ``opt`` (see the module docstring)."""
    if not opt.state:  # no update applied yet: nothing to extrapolate with
        return {n: p.detach().clone() for n, p in newest.items()}
    twin = copy.deepcopy(opt)  # deepcopy maps the state onto copies of the parameters, in order
    old = [p for g in opt.param_groups for p in g["params"]]
    new_params = [p for g in twin.param_groups for p in g["params"]]
    by_id = {id(p): n for n, p in newest.items()}
    copies = {}
    for p_old, p_new in zip(old, new_params):
        n = by_id[id(p_old)]
        st = opt.state[p_old]
        if optimizer == "adam":
            b1 = twin.param_groups[0]["betas"][0]
            p_new.grad = st["exp_avg"] / (1 - b1 ** float(st["step"]))
        else:
            wd = next(g["weight_decay"] for g in opt.param_groups if any(q is p_old for q in g["params"]))
            p_new.grad = (1 - momentum) * st["momentum_buffer"] - wd * p_old.detach()
        copies[n] = p_new
    twin.step()
    return {n: p.detach().clone() for n, p in copies.items()}


MUON_MATRICES = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")


def _ns_fp32(grad, coefficients, steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration written out in fp32 (see :func:`fp32_newton_schulz`)."""
    a, b, c = coefficients
    x = grad.float().clone()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def fp32_newton_schulz():
    """Newton-Schulz in fp32 in torch.optim.Muon and in the engine: their bf16 rounding of U turns the
    last-bit gradient differences of two code paths (engine vs functional_call) into ~1e-3 weight
    differences within 6 steps (measured: 1.5e-3 in bf16, 5e-6 in fp32), which no tolerance derived
    from the arithmetic covers. The bf16 path itself is compared with torch on equal inputs in test_muon."""
    import torch.optim._muon as torch_muon

    from megatron_2bw.optimizer import muon

    saved = torch_muon._zeropower_via_newtonschulz, muon.NS_DTYPE
    torch_muon._zeropower_via_newtonschulz, muon.NS_DTYPE = _ns_fp32, torch.float32
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz, muon.NS_DTYPE = saved


class _MuonAdamW:
    """torch.optim.Muon on the transformer's linear weights, torch.optim.AdamW on the rest, stepped together."""

    def __init__(self, named: dict, lr: float, muon_lr: float, momentum: float = 0.95, nesterov: bool = True) -> None:
        mats = [p for n, p in named.items() if n.endswith(MUON_MATRICES)]
        rest = [p for n, p in named.items() if not n.endswith(MUON_MATRICES)]
        self.muon = torch.optim.Muon(mats, lr=muon_lr, weight_decay=WD, momentum=momentum, nesterov=nesterov)
        self.adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": WD},
                                        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                       lr=lr, betas=(0.9, 0.99), eps=1e-8)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def reference_2bw(optimizer: str, compensation: str = "none", lam: float = 0.0, momentum: float = 0.0,
                  steps: int = STEPS, stale: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``stale`` False: the flush schedule's rule (the gradient of W(t) updates W(t)).

    ``extrapolate``: the optimizer gets g_t + lam * (g_t - g_prev), g_prev the gradient of the previous
    step (none at step 0). ``ef`` (Zmushko et al.'s error feedback on the updates, gamma = lam): the
    optimizer runs unchanged on its own iterate y (``newest``); its update D_t = y(t+1) - y(t) is read off
    the parameters, and the weights the model runs on follow x(1) = x(0) + D_0 (the first update
    uncorrected), then x(t+1) = x(t) + D_t + lam * (D_t - D_{t-1}), kept as their own tensors; the
    iterate is y = x - lam * D_{t-1} (set back by lam * D_0 after the first update). Both written here from
    their definitions in compensation.py."""
    lr, stale_rule = LR[optimizer], stale
    cfg = get_preset("gpt-tiny")
    spec = ModelSpec(cfg, ModelGroups(), 1234)
    model = nn.ModuleList(spec.build(0, spec.num_items))
    loss_fn = spec.loss_fn()
    names = [n for n, _ in model.named_parameters()]
    newest = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    decay = [p for p in newest.values() if p.dim() >= 2]
    no_decay = [p for p in newest.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "muon":
        opt = _MuonAdamW(newest, lr, MUON_LR)
    else:
        opt = (torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), eps=1e-8) if optimizer == "adam"
               else torch.optim.SGD(groups, lr=lr, momentum=momentum))
    prev: dict[str, torch.Tensor] = {}  # extrapolate: the previous step's gradient; ef: the previous update D
    versions = [{n: p.detach().clone() for n, p in newest.items()}]  # versions[v] = W(v)
    run_on = [versions[0]]  # run_on[v]: what version v's microbatches compute on (P(W(v)) with predict)
    g = torch.Generator().manual_seed(99)
    data = torch.randint(0, cfg.vocab_size, (B * steps, cfg.seq_length + 1), generator=g)
    losses = []
    for t in range(steps):
        stale = {n: v.clone().requires_grad_(True) for n, v in run_on[max(t - 1, 0) if stale_rule else t].items()}
        total = 0.0
        for i in range(B // MICRO):
            batch = spec.make_batch(data[t * B + i * MICRO: t * B + (i + 1) * MICRO])
            out = run_layers_with(model, stale, batch)
            total = total + loss_fn(out, batch)
        mean = total / (B // MICRO)
        losses.append(mean.item())
        grads = torch.autograd.grad(mean, [stale[n] for n in names])
        for n, gr in zip(names, grads):
            if compensation == "dc":  # W(t) - W(t-1), the two versions 2BW holds
                gr = gr + lam * gr * gr * (versions[t][n] - versions[max(t - 1, 0)][n])
            if compensation == "extrapolate":
                g_prev = prev.get(n)
                prev[n] = gr
                gr = gr if g_prev is None else gr + lam * (gr - g_prev)
            newest[n].grad = gr
        before = {n: p.detach().clone() for n, p in newest.items()} if compensation == "ef" else None
        opt.step()  # the newest weights W(t) become W(t+1), using the gradient taken at W(t-1)
        if compensation == "ef":  # x(1) = x(0) + D_0; x(t+1) = x(t) + D_t + lam * (D_t - D_{t-1}) from t = 1
            x = {}
            for n, p in newest.items():
                upd = p.detach() - before[n]
                if n in prev:
                    x[n] = versions[-1][n] + upd + lam * (upd - prev[n])
                else:  # the first update, uncorrected; the optimizer's iterate y = x - lam * D_prev from here on
                    x[n] = versions[-1][n] + upd
                    with torch.no_grad():
                        p.sub_(upd, alpha=lam)
                prev[n] = upd
            versions.append(x)
            run_on.append(x)
            continue
        versions.append({n: p.detach().clone() for n, p in newest.items()})
        run_on.append(_predicted(newest, opt, optimizer, momentum) if compensation == "predict" else versions[-1])
    return losses, versions[-1]


def run_layers_with(model: nn.ModuleList, params: dict, batch: dict):
    class Seq(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, batch):
            return run_layers(list(self.layers), batch)

    return functional_call(Seq(model), {f"layers.{k}": v for k, v in params.items()}, (batch,))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_single_process_2bw_equals_plain_pytorch_reference(optimizer):
    ref_losses, ref_params = reference_2bw(optimizer)
    got = train_tiny("2bw", steps=STEPS, global_batch=B, micro=MICRO, optimizer=optimizer, lr=LR[optimizer],
                     weight_decay=WD)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(got["params"]) == set(ref_params)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=2e-6 if optimizer == "sgd" else 1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # the stale-gradient rule is really in effect: steps 0 and 1 both run on W(0)
    flush = train_tiny("flush", steps=2, global_batch=B, micro=MICRO, optimizer=optimizer, lr=LR[optimizer],
                       weight_decay=WD)
    assert got["losses"][1] != pytest.approx(flush["losses"][1], abs=1e-7)


# lambda large enough that the DC term moves the weights far beyond the comparison tolerance
DC_LAMBDA = 1e4
COMPENSATED = [("adam", "predict", 0.0), ("adam", "dc", 0.0), ("sgd", "predict", 0.9), ("sgd", "dc", 0.9)]


@pytest.mark.parametrize("optimizer, compensation, momentum", COMPENSATED)
def test_single_process_compensation_equals_plain_pytorch_reference(optimizer, compensation, momentum):
    kw = dict(steps=STEPS, global_batch=B, micro=MICRO, optimizer=optimizer, lr=LR[optimizer], weight_decay=WD,
              sgd_momentum=momentum)
    lam = DC_LAMBDA if compensation == "dc" else 0.0
    ref_losses, ref_params = reference_2bw(optimizer, compensation, lam, momentum)
    got = train_tiny("2bw", compensation=compensation, dc_lambda=lam, **kw)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # the compensation is really in effect: it moves the weights 10x beyond the tolerance
    plain = train_tiny("2bw", **kw)["params"]
    assert max((plain[n] - p).abs().max().item() for n, p in got["params"].items()) > 1e-4


@pytest.mark.parametrize("optimizer, mode", [("adam", "ef"), ("muon", "ef"), ("sgd", "ef"), ("adam", "extrapolate"),
                                             ("muon", "extrapolate")])
def test_single_process_ef_equals_plain_pytorch_reference(optimizer, mode):
    """``ef`` (x += D_t + gamma * (D_t - D_{t-1}), the updates' error feedback) and ``extrapolate``
    (g_t + gamma * (g_t - g_{t-1})) under AdamW, Muon and SGD, against the reference's own rules."""
    kw = dict(steps=STEPS, global_batch=B, micro=MICRO, optimizer=optimizer, lr=LR[optimizer], weight_decay=WD,
              opt_extra=MUON if optimizer == "muon" else None, sgd_momentum=0.9 if optimizer == "sgd" else 0.0)
    with fp32_newton_schulz():
        ref_losses, ref_params = reference_2bw(optimizer, mode, 1.0, 0.9 if optimizer == "sgd" else 0.0)
        got = train_tiny("2bw", compensation=mode, **kw)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    plain = train_tiny("2bw", **kw)["params"]
    assert max((plain[n] - p).abs().max().item() for n, p in got["params"].items()) > 1e-4


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_single_process_muon_equals_torch_muon_and_adamw(schedule):
    """--optimizer muon in the engine = torch.optim.Muon on the linear weights + torch.optim.AdamW on the rest."""
    with fp32_newton_schulz():
        ref_losses, ref_params = reference_2bw("muon", stale=schedule == "2bw")
        got = train_tiny(schedule, steps=STEPS, global_batch=B, micro=MICRO, optimizer="muon", lr=LR["muon"],
                         weight_decay=WD, opt_extra=MUON)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
