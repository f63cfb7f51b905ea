"""Loss scaling for fp16 (dynamic or constant); bf16 and fp32 use a constant scale of 1.

The overflow decision is made from the global gradient norm, which every rank of a model
replica computes identically, so every rank updates (or skips) the scale the same way.
"""

from __future__ import annotations


class LossScaler:
    def __init__(self, initial: float = 1.0, dynamic: bool = False, window: int = 1000, min_scale: float = 1.0,
                 factor: float = 2.0):
        self.scale, self.dynamic, self.window = float(initial), dynamic, window
        self.min_scale, self.factor = min_scale, factor
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / self.factor, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= self.factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])


def build_scaler(cfg) -> LossScaler:
    """fp16: dynamic unless --loss-scale is given; other dtypes: constant 1."""
    if cfg.dtype != "fp16":
        return LossScaler(1.0)
    if cfg.loss_scale is not None:
        return LossScaler(cfg.loss_scale)
    return LossScaler(cfg.initial_loss_scale, dynamic=True, window=cfg.loss_scale_window, min_scale=cfg.min_loss_scale)
