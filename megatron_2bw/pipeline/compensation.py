"""Stale-gradient compensation for PipeDream-2BW (``--2bw-compensation {none,predict,dc,ef}``).

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
of ``CHUNK`` elements. After every drain (end of :meth:`PipelineStage.train`) the newest
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

``ef`` (delay correction in the error-feedback style, after Zmushko et al. 2026's description:
the error a one-step delay makes is estimated and fed back into the gradient): the gradient 2BW
applies at step t, ``g_t = grad f_t(W(t-1))``, misses the change of the gradient between W(t-1)
and W(t). The last observed change over one step is ``e_t = g_t - g_{t-1}`` (``g_{t-1}`` taken
at W(t-2)), and one step's weight change W(t) - W(t-1) is close to the one before it, so
APPLY_UPDATE(t) feeds the optimizer ``g_t + gamma * e_t``, elementwise, with ``gamma`` =
``--2bw-ef-scale`` (default 1: the linear extrapolation of the gradient one step ahead). ``g``
is the unscaled, clipped gradient, as for ``dc`` (the global norm and the clipping are the
uncorrected gradient's; an overflow skips the step and leaves ``g_{t-1}`` as it was, the last
applied gradient). The first applied step has no ``g_{t-1}`` and is not corrected. The
optimizer never sees the uncorrected gradient, so this serves every optimizer (AdamW's moments
and Muon's momentum accumulate the corrected gradient; Muon then orthogonalizes it). Because
``e_t`` subtracts two minibatches' gradients it also carries their noise: a momentum absorbs
much of it, and ``gamma`` < 1 trades correction for noise.

Memory: one fp32 buffer of ``g_{t-1}`` per parameter (this rank's shard with the distributed
optimizer): 4 bytes per parameter, counted by the planner's memory model as optimizer state,
saved in checkpoints with the optimizer state (key ``ef_prev_grad``), so a resume is bitwise.
Neither gradient buffer can hold it: 2BW's two buffers are taken by steps t and t+1.
"""

from __future__ import annotations

import math

import torch

from ..config import COMPENSATIONS
from ..errors import ConfigError
from ..optimizer.flat import FlatAdam, FlatSGD

CHUNK = 1 << 20  # elements per pass: bounds the temporaries to a few MB

__all__ = ["CHUNK", "COMPENSATIONS", "check_compensation", "dc_correct", "ef_correct", "predict"]


def check_compensation(mode: str, optimizer: FlatAdam | FlatSGD) -> None:
    """Refuse a mode the optimizer cannot support, in one line."""
    if mode not in COMPENSATIONS:
        raise ConfigError(f"--2bw-compensation must be one of {', '.join(COMPENSATIONS)}, got {mode!r}")
    if mode == "predict" and not isinstance(optimizer, (FlatAdam, FlatSGD)):
        raise ConfigError("--2bw-compensation predict extrapolates Adam or SGD steps only: use ef or dc with "
                          "--optimizer muon")
    if mode == "predict" and isinstance(optimizer, FlatSGD) and optimizer.buf is None:
        raise ConfigError("--2bw-compensation predict needs a momentum to extrapolate with: use Adam or --sgd-momentum > 0")


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


def ef_correct(grad: torch.Tensor, prev: torch.Tensor, has_prev: bool, gamma: float) -> None:
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
