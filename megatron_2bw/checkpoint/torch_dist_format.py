"""``--ckpt-format torch_dist``: torch.distributed.checkpoint shards (``dist_checkpoint/``), read at any layout."""

from __future__ import annotations

from dataclasses import asdict

from . import dist_checkpoint
from .format_protocol import SaveRequest


class TorchDistFormat:
    """torch.distributed.checkpoint shards (``dist_checkpoint/``): any layout on load."""

    name = dist_checkpoint.FORMAT

    def detect(self, iter_dir: str) -> bool:
        return dist_checkpoint.is_dist_checkpoint(iter_dir)

    def read_before_init(self, load: str, iteration: int, rank: int, cfg) -> dict:
        p = cfg.parallel
        return dist_checkpoint.read_checkpoint(load, iteration, rank, p.world_size,
                                               (p.tensor, p.pipeline, p.data, cfg.pipeline.layer_split))

    def check_compatible(self, sd: dict, cfg, weights_only: bool) -> None:
        dist_checkpoint.check_compatible(sd, asdict(cfg.model), asdict(cfg.optimizer), weights_only=weights_only)

    def restore(self, sd: dict, stage, tracker, device, **options) -> None:
        dist_checkpoint.restore(sd, stage, tracker, device, **options)

    def save(self, req: SaveRequest) -> str:
        return dist_checkpoint.save(req.root, req.iteration, req.stage, req.tracker, req.common(), req.async_writer)


FORMAT = TorchDistFormat()
