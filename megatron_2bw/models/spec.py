"""What the pipeline needs from a model: build a stage's layers, the loss, and microbatch tensors.

The pipeline never imports GPT or BERT; it takes a ``ModelSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..config.precision import Precision
from ..context_parallel.group import shard_batch
from ..fused import Kernels
from ..schedule.placement import Placement
from ..schedule.recompute_policy import RecomputePolicy
from ..schedule.stages import chunk_ranges, stage_range
from ..tensor_parallel.random import RNGTracker
from . import gpt
from .embedding import Embedding
from .families import FAMILIES
from .groups import ModelGroups
from .transformer import TransformerLayer, apply_recompute

if TYPE_CHECKING:
    from ..context_parallel.group import CPGroup
    from ..tensor_parallel.group import TPGroup


@dataclass
class ModelSpec:
    cfg: ModelConfig
    groups: ModelGroups  # the process groups every layer talks over (tensor, context, experts), built once
    seed: int
    rng: RNGTracker | None = None
    kernels: Kernels | None = None
    split: tuple[int, ...] | None = None  # layers per stage (schedule/stages.py); None: even
    recompute: RecomputePolicy | None = None  # recomputation inside the stage (schedule/recompute_policy.py)
    masks: gpt.DocumentMasks | None = None  # GPT: --eod-mask-loss / --reset-position-ids / --reset-attention-mask
    precision: Precision | None = None  # the GEMM recipe (config/precision.py); None: the weights' dtype

    @property
    def tp(self) -> TPGroup:
        return self.groups.tp

    @property
    def cp(self) -> CPGroup | None:
        """Context parallelism: each microbatch's sequence sharded over its ranks (None: whole sequences)."""
        return self.groups.cp

    @property
    def num_items(self) -> int:
        """Length of the ordered layer list: embedding, transformer layers, head."""
        return self.cfg.num_layers + 2

    def build(self, start: int, end: int, word: nn.Parameter | None = None) -> list[nn.Module]:
        """Layers ``start .. end-1`` of [embedding, L transformer layers, head]; only these are built.

        A head on the same stage as the embedding shares its word-embedding Parameter (``word``: the
        embedding's built in another chunk of the rank); on another stage it builds an identical copy (kept
        tied by the pipeline).
        """
        cfg, family = self.cfg, FAMILIES[self.cfg.kind]
        blocks = family.layer(cfg)
        layers: list[nn.Module] = []
        emb = None
        for i in range(start, end):
            if i == 0:
                emb = Embedding(cfg, self.tp, self.seed, rng=self.rng)
                layers.append(emb)
            elif i <= cfg.num_layers:
                layers.append(TransformerLayer(cfg, self.groups, self.seed, i - 1, causal=family.causal, rng=self.rng,
                                               kernels=self.kernels, recipe=self.precision, spec=blocks))
            else:
                layers.append(family.head(cfg, self.tp, self.seed, self.kernels,
                                          emb.word.weight if emb is not None else word, recipe=self.precision))
        apply_recompute(layers, self.recompute)
        return layers

    def build_stage(self, d: int, r: int) -> list[nn.Module]:
        """Stage ``r`` of ``d`` under this spec's split."""
        return self.build(*self.stage_range(d, r))

    def build_chunks(self, ranges: list[tuple[int, int]]) -> list[list[nn.Module]]:
        """A rank's model chunks (one layer list per ``stages.chunk_ranges`` range), built separately: a head
        never shares a Parameter with an embedding of another chunk (the pipeline keeps them tied)."""
        parts = [self.build(lo, hi) for lo, hi in ranges if not (hi == self.num_items and lo > 0)]
        heads = [(lo, hi) for lo, hi in ranges if hi == self.num_items and lo > 0]
        if heads:  # a V: the head's chunk on the embedding's rank shares its word embedding
            word = next((p[0].word.weight for p, (lo, _) in zip(parts, [r for r in ranges if r not in heads])
                         if lo == 0), None)
            built = {heads[0]: self.build(*heads[0], word=word)}
            it = iter(parts)
            parts = [built[r] if r in built else next(it) for r in ranges]
        return parts

    def rank_build(self, d: int, r: int,
                   place: Placement | None = None) -> tuple[Callable[[], list], list[tuple[int, int]]]:
        """(builder, layer-list ranges by chunk) of pipeline rank ``r``: one chunk, its stage under this spec's
        split; several (``place``), its virtual stages of the ``place.num_stages`` even ones (interleaved:
        ``c * d + r``; V: ``r`` and ``2d - 1 - r``), the builder returning one layer list per chunk (what
        ``PipelineRank`` takes)."""
        if place is None or place.chunks == 1:
            return (lambda: self.build_stage(d, r)), [self.stage_range(d, r)]
        ranges = chunk_ranges(self.cfg.num_layers, place.stages_of(r), place.num_stages)
        return (lambda: self.build_chunks(ranges)), ranges

    def stage_range(self, d: int, r: int) -> tuple[int, int]:
        """Half-open range of layer-list indices of stage ``r`` of ``d`` (``schedule/stages.py``)."""
        return stage_range(self.cfg.num_layers, d, r, self.split)

    def loss_fn(self) -> Callable[[object, dict], torch.Tensor]:
        return FAMILIES[self.cfg.kind].loss(self.cfg, self.tp, self.cp)

    def make_batch(self, sample) -> dict:
        """Tensors of one microbatch from stacked samples (GPT: ``[b, s+1]`` tokens; BERT: dict), this
        context rank's part of the sequence under context parallelism."""
        if self.cp is None:
            return FAMILIES[self.cfg.kind].make_batch(sample, self.masks)
        masks = self.masks and replace(self.masks, document_ids=True)  # no rank builds the whole [s, s] mask
        return shard_batch(FAMILIES[self.cfg.kind].make_batch(sample, masks), self.cp)


def run_layers(layers: list[nn.Module], batch: dict, x=None):
    """Plain sequential forward of a layer list (the single-process reference path)."""
    for layer in layers:
        x = layer(x, batch)
    return x
