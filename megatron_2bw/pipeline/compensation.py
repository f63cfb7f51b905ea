"""Stale-gradient compensation for PipeDream-2BW (``--2bw-compensation {none,predict,dc,ef,extrapolate}``).

Plain 2BW (``none``) computes step t's gradient on W(t-1) and applies it to W(t):
``W(t+1) = W(t) - lr * u(g_t(W(t-1)))`` (``u``: the optimizer's update). Both modes below keep
that schedule, the same two weight-version buffers and the same optimizer; they only change
which weights a step's microbatches run on (``predict``) or the gradient the optimizer consumes
(``dc``). Version v below is the schedule's weight version (step t runs on v = max(t-1, 0)).

``predict`` (weight prediction, in the spirit of SpecTrain and PipeMare): the microbatches of
step t run forward *and* backward on P(W(v)), the optimizer's own next step from W(v) taken
right after W(v) was written (optimizer state after k = number of applied updates), so they see
an estimate of W(t) instead of W(t-1). The update is unchanged: the gradient taken at P(W(v)) is
applied to the newest weights W(t) (kept in the fp32 master copy). P is exactly:

- AdamW (betas b1, b2, eps, decoupled weight decay wd on the decayed slice, lr = the learning
  rate of update v, i.e. the one that turns W(v) into W(v+1)): with moments m, s after k updates,
  ``g = m / (1 - b1^k)`` (the bias-corrected first moment, taken as the next gradient),
  ``s' = b2 * s + (1 - b2) * g^2``,
  ``P(W) = W * (1 - lr * wd) - lr * g / (sqrt(s' / (1 - b2^(k+1))) + eps)``.
  This is AdamW's step k+1 with gradient g; its first moment ``b1*m + (1-b1)*g`` bias-corrects
  back to exactly g. With k = 0 (no moments yet, including W(0) and W(-1) = W(0)) P(W) = W.
- SGD with momentum mu > 0: ``P(W) = W - lr * buf``, the step SGD takes next when the new
  gradient plus weight decay equals ``(1 - mu) * buf`` (the buffer then stays unchanged).
  Plain SGD keeps no direction to extrapolate with: ``predict`` is refused.

Memory: the model-dtype buffer of version v holds P(W(v)) instead of W(v); the newest W lives
in the fp32 master. In bf16/fp16 the master exists anyway, so ``predict`` costs no memory. In
fp32 there is no master: ``predict`` adds one, an fp32 copy of the stage's weights (4 bytes per
parameter, a third weight copy next to the two versions). Temporaries are computed in chunks
of ``CHUNK`` elements. After every drain (end of :meth:`PipelineRank.train`) the newest
version's buffer is set to W(step) so evaluation and checkpoints see the newest weights; the
next segment writes P(W(step)) back before it runs, so draining changes no result.

``dc`` (delay-compensated gradient, DC-ASGD, Zheng et al. 2017): APPLY_UPDATE(t) feeds the
optimizer ``g + lambda * g * g * (W(t) - W(t-1))`` instead of g, elementwise, where g is the
unscaled and clipped gradient (taken at W(t-1)) and W(t), W(t-1) are the two version buffers
2BW holds at that moment (model dtype, difference in fp32). No extra memory. ``g * g``
approximates the diagonal of the Hessian (outer-product approximation), so the term is a
first-order Taylor correction of the gradient from W(t-1) to W(t). The correction is applied
after clipping, so the global norm (and the clipping) is that of the uncorrected gradient, and
an overflow skips it with the update. ``lambda`` is ``--2bw-dc-lambda``, default 0.04, the
lambda0 of DC-ASGD's constant-lambda variant. Its relative size is ``lambda * |g| * |dW|``: with
token-averaged, norm-clipped gradients (|g| about 1e-4..1e-3 per element) and Adam steps of
about lr, it is around 1e-8 of g at the default, so ``dc`` then trains like plain 2BW; it acts
only with a far larger lambda, which nothing here tunes.

``ef`` (the update-level error-feedback correction of Zmushko et al. 2026, "One-Step Gradient
Delay is Not a Barrier for Large-Scale Asynchronous Pipeline Parallel LLM Pretraining", Algorithm 1,
as its public implementation reads it): optimizer-agnostic, it acts on the optimizer's *updates*,
not on the gradients, so AdamW, Muon and SGD keep their own rules untouched. Let ``D_t`` be the update
the optimizer makes at step t with 2BW's stale gradient ``g_t = grad f_t(x_{t-1})`` (decoupled weight
decay included). Plain 2BW applies ``D_t`` one step late. Read as error feedback, the delay is a lossy
"compression" of the update, and the error the last step made is estimated by the difference of two
consecutive updates and fed back into the applied update. The first update is applied uncorrected
(there is no earlier update to difference with), the correction starts at the second:

    x_1 = x_0 + D_0,      x_{t+1} = x_t + D_t + gamma * (D_t - D_{t-1})   (t >= 1),

with ``gamma`` = ``--2bw-ef-scale`` (default 1). ``x`` are the weights the model runs on (2BW's version
buffers, what evaluation and checkpoints' model weights hold). The optimizer steps its own iterate
``y_t = x_t - gamma * D_{t-1}`` (``y_0 = x_0``; ``D_t = U(y_t; g_t) - y_t``), kept in the fp32 master:
then ``y_{t+1} = y_t + D_t`` and ``x_{t+1} = y_{t+1} + gamma * D_t`` from the second update on, the
error-feedback invariant (the weights are the optimizer's trajectory moved ``gamma`` updates ahead, so
step t+1's gradient, taken at ``x_t``, is taken at about the point its update is applied to; what
remains of the delay error is ``D_t - D_{t-1}``, second order). The first update implies the master's
offset: ``y_1 = x_1 - gamma * D_0``, one update behind the weights from the start (an earlier version
of this rule corrected the first update too, ``x_1 = x_0 + (1 + gamma) D_0``, which left the weights
``gamma * D_0`` ahead of this rule's for the whole run). APPLY_UPDATE(t) runs the optimizer out of
place from the master ``y_t`` into a scratch buffer (``y_{t+1}``), then :func:`ef_apply` writes the
corrected weights into the version buffer ``slot(t+1)`` and the new iterate into the master, in
chunks of ``CHUNK`` elements; whether an update is the first is the optimizer's step count (0 before
it), so a resume, a skipped (overflowed) first step and a rolled-back speculation need no state of
their own. An overflow skips the step: ``y`` stays, ``x_{t+1} = x_t``. Drains change nothing (the
version buffers hold ``x``). Evaluating ``D_t`` at ``y_t`` rather than at ``x_t`` differs only through
decoupled weight decay, by ``lr * wd * gamma * D_{t-1}`` (1e-5 of an update).

Memory (the paper's appendix F: one extra model-sized buffer per stage): one fp32 buffer per
parameter, 4 bytes (this rank's shard with the distributed optimizer). In bf16/fp16 the master
``y`` exists anyway and the extra buffer is the scratch for ``y_{t+1}``; in fp32 the master is the
extra buffer (as for ``predict``) and the scratch is the free version buffer ``slot(t+1)`` (2BW
is done with W(t-1) by APPLY_UPDATE(t)). The planner's memory model charges it to 2BW candidates
(``ParamBytes.stale_correction``); the executor's ``StageStats`` counts it (master in
``weight_bytes``, the scratch in ``optimizer_bytes``). Checkpoints hold ``y`` as the master (both
formats), so a resume is bitwise; a checkpoint without a master starts with ``y = x`` (D = 0).

``extrapolate`` (this project's earlier ``ef``, kept under its own name: a gradient-level rule,
not the paper's): APPLY_UPDATE(t) feeds the optimizer ``g_t + gamma * (g_t - g_{t-1})``, the
linear extrapolation of the unscaled, clipped gradient one step ahead (``gamma`` =
``--2bw-ef-scale``; the global norm and the clipping are the uncorrected gradient's; an overflow
leaves ``g_{t-1}`` as it was; the first applied step is not corrected). Measured
(``docs/data/convergence_optimizers.json``) it helps AdamW in the aggressive regime (1.092x ->
1.036x Flush) but hurts it in the paper-like one and costs Muon 3-4%. Memory: one fp32 buffer of
``g_{t-1}`` per parameter (4 bytes, sharded), saved with the optimizer state (key
``extrapolate_prev_grad``).
"""

from __future__ import annotations

import math

import torch

from ..config import COMPENSATIONS
from ..errors import ConfigError
from ..optimizer.flat import FlatAdam, FlatSGD

CHUNK = 1 << 20  # elements per pass: bounds the temporaries to a few MB

__all__ = ["CHUNK", "COMPENSATIONS", "check_compensation", "dc_correct", "ef_apply", "extrapolate_correct", "predict"]


def check_compensation(mode: str, optimizer: FlatAdam | FlatSGD) -> None:
    """Refuse a mode the optimizer cannot support, in one line."""
    if mode not in COMPENSATIONS:
        raise ConfigError(f"--2bw-compensation must be one of {', '.join(COMPENSATIONS)}, got {mode!r}")
    if mode == "predict" and not isinstance(optimizer, (FlatAdam, FlatSGD)):
        raise ConfigError("--2bw-compensation predict extrapolates Adam or SGD steps only: use ef or dc with "
                          "--optimizer muon")
    if mode == "predict" and isinstance(optimizer, FlatSGD) and optimizer.buf is None:
        raise ConfigError("--2bw-compensation predict needs a momentum to extrapolate with: "
                          "use Adam or --sgd-momentum > 0")


def predict(optimizer: FlatAdam | FlatSGD, src: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
    """dst = P(src), the optimizer's predicted next step from ``src`` (fp32 newest weights)."""
    if optimizer.steps == 0:
        dst.copy_(src)
        return
    n = src.numel()
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        if isinstance(optimizer, FlatAdam):
            out = _adam_chunk(optimizer, src, lo, hi, lr)
        else:
            out = src[lo:hi] - lr * optimizer.buf[lo:hi]
        dst[lo:hi].copy_(out)


def _adam_chunk(opt: FlatAdam, src: torch.Tensor, lo: int, hi: int, lr: float) -> torch.Tensor:
    b1, b2 = opt.betas
    k = opt.steps
    g = opt.exp_avg[lo:hi] / (1 - b1**k)
    s = opt.exp_avg_sq[lo:hi] * b2
    s.addcmul_(g, g, value=1 - b2)
    denom = s.div_(1 - b2 ** (k + 1)).sqrt_().add_(opt.eps)
    out = src[lo:hi].clone()
    d_hi = min(max(opt.n_decay, lo), hi) - lo  # decayed elements in this chunk
    if opt.weight_decay and d_hi > 0:
        out[:d_hi].mul_(1 - lr * opt.weight_decay)
    return out.addcdiv_(g, denom, value=-lr)


def dc_correct(grad: torch.Tensor, newest: torch.Tensor, older: torch.Tensor, lam: float) -> None:
    """grad += lam * grad * grad * (newest - older), in place (fp32 ``grad``)."""
    if lam == 0 or not math.isfinite(lam):
        return
    n = grad.numel()
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        g = grad[lo:hi]
        delta = newest[lo:hi].float() - older[lo:hi].float()
        g.add_(delta.mul_(g).mul_(g), alpha=lam)


def extrapolate_correct(grad: torch.Tensor, prev: torch.Tensor, has_prev: bool, gamma: float) -> None:
    """grad += gamma * (grad - prev) and prev = the uncorrected grad, in place (fp32); without a
    previous gradient only ``prev`` is written."""
    if not has_prev:
        prev.copy_(grad)
        return
    n = grad.numel()
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        g, p = grad[lo:hi], prev[lo:hi]
        err = torch.sub(g, p)
        p.copy_(g)
        g.add_(err, alpha=gamma)


def ef_apply(master: torch.Tensor, new: torch.Tensor, dst: torch.Tensor, gamma: float, first: bool = False) -> None:
    """``ef``, in place: the corrected weights ``dst = new + gamma * (new - master)`` and the iterate
    ``master = new``; for the ``first`` update the weights ``dst = new`` (uncorrected) and the master
    ``new - gamma * (new - master)`` (one update behind them). ``new`` holds the optimizer's step from
    ``master`` and may be ``dst`` (fp32)."""
    n = master.numel()
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        y0, y1, x = master[lo:hi], new[lo:hi], dst[lo:hi]
        step = torch.sub(y1, y0)  # D_t
        y0.copy_(y1)
        if first:
            y0.sub_(step, alpha=gamma)
            if x.data_ptr() != y1.data_ptr():
                x.copy_(y1)
        elif x.data_ptr() == y1.data_ptr():
            x.add_(step, alpha=gamma)
        else:
            x.copy_(step.mul_(gamma).add_(y1))
