"""The one GEMM seam (tensor_parallel/gemm.py): every forward and weight-gradient GEMM of the model's linear
layers, a whole backward's and a split backward's fused W alike, goes through it (counted and perturbed here),
its products equal torch's own linear, the precision recipe is resolved once from the run's precision and
reaches every linear layer, and the recipe-state hook round-trips (empty for fp32/bf16/fp16)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiproc import run_workers
from pipeline_harness import _dataset
from torch import nn

from megatron_2bw.config.precision import RECIPES, Precision, precision_of
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.models.transformer import TransformerLayer
from megatron_2bw.pipeline.split_backward import accumulator, backward_input, backward_weight
from megatron_2bw.tensor_parallel import gemm
from megatron_2bw.tensor_parallel.group import TPGroup
from megatron_2bw.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel


def _matrices(module: nn.Module) -> list[nn.Parameter]:
    """The GEMM weights: every 2-D parameter of a stage without the embedding (whose tables are looked up);
    a head's copy of the tied word embedding is one (the logits' GEMM)."""
    return [p for p in module.parameters() if p.dim() == 2]


class _Seam:
    """The seam's kernels wrapped: the weights the forward GEMMs saw, the weight-gradient GEMMs run (into a
    buffer or not) and their products scaled by ``wscale``."""

    def __init__(self, monkeypatch, wscale: float = 1.0) -> None:
        self.fwd: list[torch.Tensor] = []
        self.wgrads = self.fused = self.dgrads = 0
        real_fwd, real_w, real_d = gemm.forward_gemm, gemm.wgrad, gemm.dgrad

        def dgrad(dy, w, recipe):
            self.dgrads += 1
            return real_d(dy, w, recipe)

        def forward_gemm(x, w, b, recipe):
            self.fwd.append(w)
            return real_fwd(x, w, b, recipe)

        def wgrad(dy, x, target, recipe):
            self.wgrads += 1
            if target is None:
                return real_w(dy, x, None, recipe) * wscale
            self.fused += 1
            return target.add_(real_w(dy, x, None, recipe) * wscale)

        for name, fn in (("forward_gemm", forward_gemm), ("wgrad", wgrad), ("dgrad", dgrad)):
            monkeypatch.setattr(gemm, name, fn)


def _layer(kind: str) -> tuple[TransformerLayer, torch.Tensor]:
    cfg = get_preset(kind, hidden_dropout=0.0, attention_dropout=0.0)
    layer = TransformerLayer(cfg, ModelGroups(), 3, 0, causal=True)
    torch.manual_seed(0)
    return layer, torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)


@pytest.mark.parametrize("kind", ["gpt-tiny", "llama-tiny"])
def test_every_gemm_of_a_layer_goes_through_the_seam(kind, monkeypatch):
    """Forward: each weight matrix enters one forward GEMM of the seam. Backward: with the seam's weight GEMM
    doubled, every weight matrix's gradient doubles and nothing else changes (no weight GEMM elsewhere)."""
    layer, x = _layer(kind)
    matrices = _matrices(layer)
    layer(x, {}).square().sum().backward()
    plain = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    seam = _Seam(monkeypatch, wscale=2.0)
    layer(x, {}).square().sum().backward()
    assert sorted(map(id, seam.fwd)) == sorted(map(id, matrices)) and seam.wgrads == seam.dgrads == len(matrices)
    for n, p in layer.named_parameters():
        want = 2 * plain[n] if p.dim() == 2 else plain[n]
        assert torch.equal(p.grad, want), n


@pytest.mark.parametrize(("kind", "d", "r"), [("gpt-tiny", 2, 1), ("bert-tiny", 2, 1), ("llama-tiny", 4, 1)])
def test_split_backward_weight_gemms_go_through_the_seam(kind, d, r, monkeypatch):
    """A split backward's W (the fused path, into the gradient buffers): every weight matrix of a stage
    (BERT's replicated head linears and the tied logits included) gets its gradient from the seam's
    ``wgrad`` into its buffer; doubled there, exactly those gradients double against the unperturbed W."""
    cfg = get_preset(kind, hidden_dropout=0.0, attention_dropout=0.0)
    spec = ModelSpec(cfg, ModelGroups(), 7)
    layers = nn.ModuleList(spec.build_stage(d, r))
    batch = spec.make_batch(_dataset(cfg, 2))
    params = list(layers.parameters())
    index = {accumulator(p): i for i, p in enumerate(params)}
    last = r == d - 1
    grads = []
    for scale in (1.0, 2.0):
        seam = _Seam(monkeypatch, wscale=scale)
        torch.manual_seed(1)
        x = torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
        out = x
        for layer in layers:
            out = layer(out, batch)
        out = spec.loss_fn()(out, batch) if last else out
        g = None if last else torch.linspace(-1, 1, out.numel()).view_as(out)
        for p in params:
            p.grad = torch.zeros_like(p)
        _, deferred = backward_input(out, g, x, index)
        assert seam.wgrads == 0, "I runs no weight GEMM"
        backward_weight(deferred, params, index, main_grads=False)
        assert seam.fused == seam.wgrads == len(_matrices(layers))  # each weight once, in place
        grads.append([p.grad.clone() for p in params])
    for p, a, b in zip(params, *grads, strict=True):
        assert torch.equal(b, 2 * a if p.dim() == 2 else a), p.shape


class _Patch:
    """``monkeypatch.setattr`` in a worker process (discarded afterwards)."""

    setattr = staticmethod(setattr)


def _sequence_parallel_worker() -> dict:
    """SwiGLU-shaped gate/up (one sequence-parallel column Function) and a sequence-parallel row GEMM at t = 2:
    the seam's calls, and whether exactly the weights' gradients double with its weight GEMM doubled."""
    tp = TPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    h, f = 8, 16
    gate, up = (ColumnParallelLinear(h, f, tp, seed=1, name=n, std=0.1, sequence_parallel=True) for n in "gu")
    down = RowParallelLinear(f, h, tp, seed=1, name="d", std=0.1, sequence_parallel=True)
    mods = nn.ModuleList([gate, up, down])
    torch.manual_seed(0)
    x = torch.randn(2, 8, h).chunk(tp.size, 1)[tp.rank].clone().requires_grad_()

    def step() -> dict[str, torch.Tensor]:
        mods.zero_grad()
        a, b = column_parallel(x, tp, [gate.weight, up.weight], [gate.bias, up.bias], True)
        down(F.silu(a) * b).square().sum().backward()
        return {n: p.grad.clone() for n, p in mods.named_parameters()}

    plain = step()
    seam = _Seam(_Patch, wscale=2.0)
    doubled = step()
    exact = all(torch.equal(doubled[n], 2 * g if g.dim() == 2 else g) for n, g in plain.items())
    return {"fwd": len(seam.fwd), "wgrad": seam.wgrads, "dgrad": seam.dgrads, "exact": exact}


def test_sequence_parallel_gemms_go_through_the_seam():
    """The hand-written sequence-parallel backward's GEMMs are the seam's too (2 processes)."""
    for out in run_workers(_sequence_parallel_worker, 2):
        assert out == {"fwd": 3, "wgrad": 3, "dgrad": 3, "exact": True}


def test_the_seam_equals_torchs_linear():
    """Forward bitwise; dX, dW, db against F.linear's autograd within fp32 rounding (dW = dY^T X here)."""
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w, b = torch.randn(6, 8, requires_grad=True), torch.randn(6, requires_grad=True)
    g = torch.randn(3, 5, 6)
    ref = F.linear(x, w, b)
    ref_grads = torch.autograd.grad(ref, (x, w, b), g)
    out = gemm.linear(x, w, b, precision_of("fp32"))
    assert torch.equal(out, ref)
    for a, r in zip(torch.autograd.grad(out, (x, w, b), g), ref_grads, strict=True):
        assert torch.allclose(a, r, rtol=0, atol=1e-5 * r.abs().max().item())


def test_recipe_resolved_once_and_handed_to_every_linear():
    assert {d: precision_of(d).dtype for d in ("fp32", "bf16", "fp16")} == {"fp32": "fp32", "bf16": "bf16",
                                                                           "fp16": "fp16"}
    assert not any(r.scaled for r in RECIPES.values())
    with pytest.raises(ConfigError, match="precision must be one of"):
        precision_of("fp8")
    with pytest.raises(ConfigError, match="GEMM kind"):
        Precision("x", "bf16", gemm="fp8-delayed")
    recipe = precision_of("bf16")
    cfg = get_preset("bert-tiny")
    model = nn.ModuleList(ModelSpec(cfg, ModelGroups(), 1, precision=recipe).build(0, cfg.num_layers + 2))
    linears = [m for m in model.modules() if hasattr(m, "gemm_state")]
    assert len(linears) == 4 * cfg.num_layers + 3 and all(m.recipe is recipe for m in linears)  # + BERT's head
    assert all(getattr(m, "recipe", recipe) is recipe for m in model.modules())  # the heads' tied logits too


def test_recipe_state_round_trips():
    """Empty under the native recipes; a scaled recipe's per-layer tensors (written here as one would) saved
    and restored by module path, outside the weights, and a mismatch refused."""
    build = lambda: nn.ModuleList(ModelSpec(get_preset("gpt-tiny"), ModelGroups(), 1, precision=precision_of("fp16"))
                                  .build(0, 3))  # noqa: E731
    model = build()
    assert gemm.gemm_state_dict(model) == {}
    qkv = model[1].attn.qkv.gemm_state
    qkv.tensors.update(amax_history=torch.arange(6.0).view(2, 3), scale=torch.tensor([0.5, 2.0, 4.0]))
    buf = io.BytesIO()
    torch.save(gemm.gemm_state_dict(model), buf)
    buf.seek(0)
    fresh = build()
    fresh[1].attn.qkv.gemm_state.tensors.update(amax_history=torch.zeros(2, 3), scale=torch.ones(3))
    gemm.load_gemm_state(fresh, torch.load(buf))
    assert list(gemm.gemm_state_dict(fresh)) == ["1.attn.qkv"]
    for k, v in qkv.tensors.items():
        assert torch.equal(fresh[1].attn.qkv.gemm_state.tensors[k], v)
    assert "gemm_state" not in "".join(n for n, _ in fresh.named_parameters())
    with pytest.raises(ValueError, match="does not match"):
        gemm.load_gemm_state(build(), gemm.gemm_state_dict(model))
