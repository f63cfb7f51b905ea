"""What one rank's engine is made of: built by :mod:`.build`, run by :class:`~.executor.PipelineRank`."""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.placement import Placement
from .accounting import StageStats
from .grad_reducer import GradReducer
from .transport import Transport
from .updater import Updater
from .weights import RankWeights


@dataclass
class RankParts:
    """What a rank's engine is made of; ``bounds``: where each model chunk's layers start in the flat list."""

    placement: Placement
    weights: RankWeights
    transport: Transport
    reducer: GradReducer
    updater: Updater
    stats: StageStats
    bounds: list[int]
