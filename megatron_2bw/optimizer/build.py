"""The flat optimizer a run's ``OptimizerConfig`` names: one place that knows every optimizer class."""

from __future__ import annotations

from .flat import FlatAdam, FlatSGD
from .muon import FlatMuon


def build_optimizer(cfg, numel: int, n_decay: int, device, fused: bool | None = None, *, muon=None):
    """The flat optimizer named by an ``OptimizerConfig`` (fused AdamW kernel when available).

    ``muon``: for ``--optimizer muon``, the keyword arguments of :class:`~.muon.FlatMuon` that
    describe the stage (its matrices, tensor-parallel group, shard); see ``Updater``.
    """
    if cfg.optimizer == "adam":
        return FlatAdam(numel, n_decay, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                        weight_decay=cfg.weight_decay, device=device, fused=fused)
    if cfg.optimizer == "muon":
        ratio = (cfg.muon_lr / cfg.lr if cfg.lr > 0 else 1.0) if cfg.muon_lr is not None else 1.0
        kw = {"matrices": [], **(muon or {})}
        return FlatMuon(numel, kw.pop("n_decay", n_decay), **kw, momentum=cfg.muon_momentum,
                        nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr_fn,
                        lr_ratio=ratio, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                        weight_decay=cfg.weight_decay, device=device, fused=fused)
    return FlatSGD(numel, n_decay, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay, device=device)
