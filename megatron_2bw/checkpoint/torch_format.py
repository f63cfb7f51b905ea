"""``--ckpt-format torch``: Megatron's ``mp_rank_TT_PPP/model_optim_rng.pt`` per rank (``checkpointing.py``),
read at this layout only (``tools/checkpoint_util.py`` reshards it offline)."""

from __future__ import annotations

from dataclasses import asdict

from . import checkpointing, dist_checkpoint
from .format_protocol import SaveRequest


class TorchFormat:
    """Megatron's ``mp_rank_TT_PPP/model_optim_rng.pt`` per rank (``checkpointing.py``): this layout only."""

    name = "torch"

    def detect(self, iter_dir: str) -> bool:
        return not dist_checkpoint.is_dist_checkpoint(iter_dir)

    def read_before_init(self, load: str, iteration: int, rank: int, cfg) -> dict:
        from ..parallel_state import coords_of

        t, d, w = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data
        tp, _, pp = coords_of(rank, t, w)
        return checkpointing.load_rank_file(load, iteration, t, d, tp, pp)

    def check_compatible(self, sd: dict, cfg, weights_only: bool) -> None:
        checkpointing.check_compatible(sd, asdict(cfg.model), cfg.pipeline.schedule, asdict(cfg.optimizer),
                                       weights_only=weights_only, split=cfg.pipeline.layer_split,
                                       chunks=cfg.pipeline.chunks)

    def restore(self, sd: dict, stage, tracker, device, **options) -> None:
        checkpointing.restore(sd, stage, tracker, device, **options)

    def save(self, req: SaveRequest) -> str:
        return checkpointing.save(req.root, req.iteration, req.state, req.payload)


FORMAT = TorchFormat()
