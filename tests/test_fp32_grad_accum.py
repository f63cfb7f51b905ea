"""fp32 gradient accumulation for bf16/fp16 weights (--accumulate-allreduce-grads-in-fp32, default
with bf16): exact fp32 sums of the per-microbatch gradients, the same training on every schedule and
layout as the single process, closer to fp32 than bf16 accumulation, and fp32 runs untouched."""

from __future__ import annotations

import functools

import pipeline_harness
import torch
from torch import nn

from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig
from megatron_2bw.schedule.recompute_policy import RecomputePolicy
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, get_schedule

# one model chunk per rank: these compare against a one-stage run, which a chunked schedule (interleaved,
# V) cannot be; tests/test_interleaved_numerics.py covers those against the single process
ONE_CHUNK = tuple(s for s in SCHEDULE_NAMES if get_schedule(s).chunks == 1)
from multiproc import run_workers

from megatron_2bw.faults import FaultInjector
from megatron_2bw.pipeline.weights import RankWeights

BF16, FP32 = torch.bfloat16, torch.float32
KW = dict(steps=2, global_batch=16, micro=1, lr=3e-3, clip=1.0)  # m=8 per replica at w=2
NO_FAULT = (-1, -1)  # a rank that never exists: the harness builds a fault injector, the spy below
_SEEN: dict[int, torch.Tensor] = {}  # step -> this rank's gradient at REDUCE_GRADS (before any reduction)
_STAGES: list = []  # the stage a run built (to name its gradient buffer's elements)


class _GradSpy(FaultInjector):
    """Records each step's local gradient where the engine would poison it; injects nothing."""

    def poison(self, rank: int, step: int, grad: torch.Tensor) -> None:
        _SEEN[step] = grad.detach().clone()


def _recorded(build):
    """``build_stage`` that also records the rank it built."""
    def build_stage(*args, **kwargs):
        _STAGES.append(build(*args, **kwargs))
        return _STAGES[-1]
    return build_stage


def train(schedule: str, dtype: str = "fp32", fp32_grads: bool | None = None, layout=None, policy=None, **kw) -> dict:
    """``pipeline_harness.train_tiny`` with the gradient precision flag (None: the default for ``dtype``),
    optionally a recompute policy inside stages. Adds ``grad_dtype`` (of the buffers) and ``grads``:
    step -> {global name: this rank's gradient before any reduction, float64}."""
    class Spec(pipeline_harness.ModelSpec):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, recompute=policy, **kwargs)

    patched = ("OptimizerConfig", "FaultInjector", "ModelSpec", "build_stage")
    saved = {k: getattr(pipeline_harness, k) for k in patched}
    opt = functools.partial(OptimizerConfig, accumulate_allreduce_grads_in_fp32=fp32_grads)
    for k, v in zip(patched, (opt, _GradSpy, Spec, _recorded(saved["build_stage"]))):
        setattr(pipeline_harness, k, v)
    _SEEN.clear()
    _STAGES.clear()
    try:
        out = pipeline_harness.train_tiny(schedule, layout=layout, dtype=dtype, inject_inf=NO_FAULT, **{**KW, **kw})
    finally:
        for k, v in saved.items():
            setattr(pipeline_harness, k, v)
    names = _STAGES[-1].weights.state_views
    out["grad_dtype"] = _SEEN[0].dtype
    out["grads"] = {t: {k: v.double() for k, v in names(g).items()} for t, g in _SEEN.items()}
    return out


# ---------------------------------------------------------------------------- unit: RankWeights
class _Block(nn.Module):
    """A linear layer used twice (its gradient is a sum inside one backward) and a layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(24, 24), nn.LayerNorm(24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(torch.tanh(self.lin(x))))


def _weights(grad_dtype: torch.dtype | None) -> RankWeights:
    torch.manual_seed(0)
    return RankWeights(lambda: [_Block()], num_versions=2, num_grad_buffers=2, dtype=BF16,
                        device=torch.device("cpu"), grad_dtype=grad_dtype)


def _backward(w: RankWeights, slot: int, buf: int, x: torch.Tensor) -> None:
    w.point_grads(slot, buf)
    (w.slots[slot][0](x).float().square().mean() * 100).backward()


def test_fp32_buffer_is_the_exact_fp32_sum_of_the_microbatch_gradients():
    k = 12
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 24, generator=gen).to(BF16) for _ in range(k)]
    ref_module = _weights(None).slots[0][0]  # an independent copy with the same bf16 weights
    params = list(ref_module.parameters())
    per_mb = [torch.autograd.grad((ref_module(x).float().square().mean() * 100), params) for x in xs]
    want = [torch.zeros(p.shape) for p in params]
    for grads in per_mb:  # the fp32 sum, in microbatch order, of the bf16 per-microbatch gradients
        for acc, g in zip(want, grads):
            acc += g.float()
    exact = [sum(grads[i].double() for grads in per_mb) for i in range(len(params))]

    w32, w16 = _weights(FP32), _weights(None)
    assert w32.main_grads and not w16.main_grads
    assert w32.grad_flat[0].dtype == FP32 and w16.grad_flat[0].dtype == BF16
    assert w32.grad_bytes == 2 * 4 * w32.numel and w16.grad_bytes == 2 * 2 * w16.numel
    for w in (w32, w16):
        for x in xs:
            _backward(w, 0, 0, x)
        _backward(w, 1, 1, xs[0])  # the other version into the other buffer: buffer 0 untouched
    by_name = dict(zip(w32.names, w32.grad_views[0]))
    names = [n for n, _ in ref_module.named_parameters()]
    for name, acc in zip(names, want):
        assert torch.equal(by_name[f"0.{name}"], acc), name  # bitwise
    assert all(p.grad is None for p in w32.params[0] + w32.params[1])  # the bf16 gradients were freed
    assert torch.equal(dict(zip(w32.names, w32.grad_views[1]))["0.lin.weight"], per_mb[0][0].float())
    # bf16 accumulation rounds each partial sum: it is not the fp32 sum and is further from the exact one
    by16 = dict(zip(w16.names, w16.grad_views[0]))
    err32 = sum((by_name[f"0.{n}"].double() - e).square().sum() for n, e in zip(names, exact)).sqrt()
    err16 = sum((by16[f"0.{n}"].double() - e).square().sum() for n, e in zip(names, exact)).sqrt()
    norm = sum(e.square().sum() for e in exact).sqrt()
    assert not all(torch.equal(by16[f"0.{n}"].float(), a) for n, a in zip(names, want))
    assert err32 <= 1e-6 * norm and err16 > 2e-4 * norm, (float(err16 / norm), float(err32 / norm))


def test_same_dtype_gradients_keep_the_buffer_views():
    """fp32 weights (and bf16 with --grad-reduce-in-bf16): ``p.grad`` is the buffer view, no hooks."""
    for dtype, grad_dtype in ((FP32, None), (FP32, FP32), (BF16, BF16)):
        torch.manual_seed(0)
        w = RankWeights(lambda: [_Block()], num_versions=2, num_grad_buffers=2, dtype=dtype,
                         device=torch.device("cpu"), grad_dtype=grad_dtype)
        assert not w.main_grads and all(g.dtype == dtype for g in w.grad_flat)
        w.point_grads(1, 1)
        for p, view in zip(w.params[1], w.grad_views[1]):
            assert p.grad is view and not hasattr(p, "main_grad")
            assert not p._post_accumulate_grad_hooks
        _backward(w, 1, 1, torch.randn(4, 24).to(dtype))
        assert all(p.grad is view for p, view in zip(w.params[1], w.grad_views[1]))
        assert torch.count_nonzero(w.grad_flat[1]) > 0


# ---------------------------------------------------------------------------- single process
@functools.lru_cache(maxsize=None)
def single(schedule: str, dtype: str = "fp32", fp32_grads: bool | None = None, policy=None, recompute=False) -> dict:
    return train(schedule, dtype, fp32_grads, policy=policy, recompute=recompute)


def test_config_defaults_buffers_and_stats():
    """bf16 accumulates in fp32 unless --grad-reduce-in-bf16; fp16 only with the flag; fp32 always."""
    want = {("bf16", None): FP32, ("bf16", False): BF16, ("fp16", None): torch.float16, ("fp16", True): FP32,
            ("fp32", None): FP32}
    numel = sum(p.numel() for p in single("2bw", "fp32", None)["params"].values())  # the tied embedding counted once
    for (dtype, fp32), grad_dtype in want.items():
        assert OptimizerConfig(dtype=dtype, accumulate_allreduce_grads_in_fp32=fp32).torch_grad_dtype == grad_dtype
        out = single("2bw", dtype, fp32)
        assert out["grad_dtype"] == grad_dtype
        assert out["stats"]["grad_bytes"] == 2 * grad_dtype.itemsize * numel  # 2BW: two gradient buffers


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert all(torch.equal(p, b["params"][k]) for k, p in a["params"].items())
    assert all(torch.equal(g, b["grads"][t][k]) for t in a["grads"] for k, g in a["grads"][t].items())


def test_recomputation_accumulates_the_same_fp32_gradients():
    """Stage recomputation and recomputation inside stages replay the same bf16 backward: bitwise."""
    base = single("2bw", "bf16", None)
    for kw in (dict(recompute=True), dict(policy=RecomputePolicy("selective")),
               dict(policy=RecomputePolicy("full", "uniform", 2))):
        _same(base, single("2bw", "bf16", None, **kw))


# ---------------------------------------------------------------------------- pipelined
ORDERED = ("2bw", "flush")  # gpipe does flush's arithmetic in another order of microbatches


def _error(run: dict, ref: dict, steps: tuple[int, ...]) -> float:
    """Squared distance of this rank's gradients to the fp32 run's, over ``steps``."""
    return sum(float((g - ref["grads"][t][k]).square().sum()) for t in steps for k, g in run["grads"][t].items())


def _layout_runs(layout):
    out = {}
    for schedule in ONE_CHUNK:
        runs = {"bf16": train(schedule, "bf16", layout=layout), "fp16": train(schedule, "fp16", True, layout=layout)}
        if schedule in ORDERED:
            ref, rounded = train(schedule, layout=layout), train(schedule, "bf16", False, layout=layout)
            on_w0 = (0, 1) if schedule == "2bw" else (0,)  # the steps that run on W(0) in every precision
            runs["err"] = (_error(runs["bf16"], ref, on_w0), _error(rounded, ref, on_w0))
        out[schedule] = runs
    return out


def _reduced(ranks: list[dict], step: int) -> dict[str, torch.Tensor]:
    """The full gradient of ``step``: every rank's contribution summed per parameter (replicas; the
    word embedding's first- and last-stage parts), as the reductions do (t=1)."""
    total: dict[str, torch.Tensor] = {}
    for r in ranks:
        for k, g in r["grads"][step].items():
            total[k] = total[k] + g if k in total else g.clone()
    return total


def test_every_schedule_matches_the_single_process_and_is_closer_to_fp32():
    """d=2 (tied word embedding across stages) by w=2 (fp32 all-reduce), m=8 per replica, 2 steps.

    Gradients of the steps on W(0) equal the single process's up to the order of fp32 additions
    (rtol 1e-5, atol 1e-5 of the tensor's largest element; measured 3e-8), except the tied word
    embedding, whose two parts the single process adds in the model dtype inside one backward
    (relative norm error < 2^-8; measured 1.8e-3 bf16, 2.2e-4 fp16). Losses agree within 2e-4
    (measured 6.6e-5). Squared gradient error to the fp32 run: bf16 accumulation 1.24-1.27x fp32's.
    """
    outs = run_workers(_layout_runs, 4, (1, 2, 2))
    for schedule in ONE_CHUNK:
        for dtype, fp32 in (("bf16", None), ("fp16", True)):
            one, ranks = single(schedule, dtype, fp32), [o[schedule][dtype] for o in outs]
            assert all(r["grad_dtype"] == FP32 and not any(r["skipped"]) for r in ranks)
            for step in ((0, 1) if schedule == "2bw" else (0,)):
                got, want = _reduced(ranks, step), one["grads"][step]
                assert set(got) == set(want)
                for k, g in got.items():
                    if k == WORD:
                        assert (g - want[k]).norm() < 2**-8 * want[k].norm(), (schedule, dtype, step)
                    else:
                        torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-5 * float(want[k].abs().max()),
                                                   msg=lambda m, s=schedule, dt=dtype, k=k: f"{s} {dt} {k}: {m}")
            last = next(r for r in ranks if r["last"])
            torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(one["losses"]), rtol=0, atol=2e-4)
        if schedule in ORDERED:  # bf16 accumulation adds its rounding to the bf16 arithmetic both runs share
            err32, err16 = (sum(o[schedule]["err"][i] for o in outs) for i in (0, 1))
            assert err16 > 1.15 * err32, (schedule, err16, err32)
