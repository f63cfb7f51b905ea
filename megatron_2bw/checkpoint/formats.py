"""The checkpoint formats under their ``--ckpt-format`` names: one small protocol the trainer and the
launcher ask, instead of an ``if`` on the format at every call site.

A format answers five questions: is this iteration folder mine (``detect``), what does this rank read
before any process group exists (``read_before_init``), does it fit the run (``check_compatible``), how
does it go into the live stage (``restore``) and how is it written (``save``). Adding a format is its own
module plus one entry in :data:`FORMATS`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

from ..errors import ConfigError
from . import checkpointing, dist_checkpoint
from .layout import iteration_dir


@dataclass
class SaveRequest:
    """What a save may need; each format takes its part (the torch format a payload per rank, torch_dist the
    rank-independent ``common`` state and the optional background writer)."""

    root: str
    iteration: int
    stage: Any
    state: Any
    tracker: Any
    payload: Callable[[], dict]
    common: Callable[[], dict]
    async_writer: Any = None


class CheckpointFormat(Protocol):
    name: str

    def detect(self, iter_dir: str) -> bool: ...
    def read_before_init(self, load: str, iteration: int, rank: int, cfg) -> dict: ...
    def check_compatible(self, sd: dict, cfg, weights_only: bool) -> None: ...
    def restore(self, sd: dict, stage, tracker, device, **options) -> None: ...
    def save(self, req: SaveRequest) -> str: ...


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


FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (TorchFormat(), TorchDistFormat())}


def get_format(name: str) -> CheckpointFormat:
    """The format ``--ckpt-format NAME`` names."""
    if name not in FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def detect(load: str, iteration: int) -> CheckpointFormat:
    """The format of the checkpoint at ``load``'s ``iteration`` (torch_dist first: its marker is explicit)."""
    idir = iteration_dir(load, iteration)
    return next(f for f in (FORMATS["torch_dist"], FORMATS["torch"]) if f.detect(idir))


def of_file(sd: dict) -> CheckpointFormat:
    """The format a read checkpoint came from (its ``format`` field)."""
    return FORMATS["torch_dist"] if sd.get("format") == dist_checkpoint.FORMAT else FORMATS["torch"]
