"""Input embeddings, and the output projection: tied to the word embedding (GPT-2, BERT) or its own (Llama)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..config.precision import Precision
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.init import Init, parameter
from ..tensor_parallel.layers import VocabParallelEmbedding, column_parallel
from ..tensor_parallel.mappings import copy_to_tp, seq_shard
from ..tensor_parallel.random import RNGTracker

WORD_EMBEDDING = "embedding.word"
OUTPUT_LAYER = "head.output_layer"


def word_embedding(cfg: ModelConfig, tp: TPGroup, seed: int) -> VocabParallelEmbedding:
    """The word embedding; its weight is marked ``shared_embedding`` (tied with the output layer).

    When the first and last stage differ, each builds this same weight (same seed and name) and
    the pipeline all-reduces their gradients over the embedding group, so the two copies receive
    identical updates and stay tied in every schedule.
    """
    emb = VocabParallelEmbedding(
        cfg.vocab_size, cfg.padded_vocab_size(tp.size), cfg.hidden_size, tp,
        seed=seed, name=WORD_EMBEDDING, std=cfg.init_method_std, sequence_parallel=cfg.sequence_parallel,
    )
    emb.weight.shared_embedding = cfg.tied_output  # untied: the last stage has its own output layer
    return emb


class Embedding(nn.Module):
    """word + position (+ token type) embeddings, then dropout. Pipeline signature: forward(x, batch)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, rng: RNGTracker | None = None):
        super().__init__()
        self.word = word_embedding(cfg, tp, seed)
        # sequence parallelism: the output is this rank's sequence shard (positions and dropout too)
        self.tp, self.sharded = tp, cfg.sequence_parallel and tp.size > 1
        self.rng = rng
        self.position = (  # None with RoPE: positions enter each attention layer's q and k instead
            parameter(Init("embedding.position", seed, (cfg.max_position_embeddings, cfg.hidden_size),
                           cfg.init_method_std))
            if cfg.position_embedding_type == "learned_absolute" else None
        )
        self.tokentype = (
            parameter(Init("embedding.tokentype", seed, (cfg.num_tokentypes, cfg.hidden_size), cfg.init_method_std))
            if cfg.num_tokentypes else None
        )
        self.dropout = cfg.hidden_dropout

    def forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        tokens = batch["tokens"]
        h = self.word(tokens)
        if self.position is not None:
            ids = batch.get("position_ids")  # --reset-position-ids: per-document positions, [b, s]
            if ids is None:
                pos = self.position[: tokens.shape[1]]
                h = h + (seq_shard(pos, self.tp) if self.sharded else pos)
            elif self.sharded:  # this rank's slice of the sequence (dim 1 of [b, s]); the table's gradient summed
                h = h + F.embedding(ids.chunk(self.tp.size, dim=1)[self.tp.rank], copy_to_tp(self.position, self.tp))
            else:
                h = h + F.embedding(ids, self.position)
        if self.tokentype is not None:
            h = h + F.embedding(batch["token_types"], self.tokentype)
        if self.sharded and self.rng is not None and self.training and self.dropout > 0:
            with self.rng.fork():
                return F.dropout(h, self.dropout, True)
        return F.dropout(h, self.dropout, self.training)


def tied_logits(x: torch.Tensor, word_weight: torch.Tensor, tp: TPGroup, bias: torch.Tensor | None = None,
                sequence_parallel: bool = False, recipe: Precision | None = None) -> torch.Tensor:
    """This rank's slice of the output logits, ``[..., padded_vocab / t]``, from the tied weight
    (under sequence parallelism, of the whole sequence: the shards are all-gathered first)."""
    return column_parallel(x, tp, [word_weight], [bias], sequence_parallel, recipe)[0]


class OutputLayer(nn.Module):
    """The untied output layer (``--untie-embeddings-and-output-weights``): a vocab-parallel weight of
    its own on the last stage, shaped like the word embedding (padded rows zero) but never all-reduced
    with it (Megatron-Core's ``output_layer``)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, recipe: Precision | None = None):
        super().__init__()
        self.tp, self.sequence_parallel, self.recipe = tp, cfg.sequence_parallel, recipe
        self.weight = VocabParallelEmbedding(
            cfg.vocab_size, cfg.padded_vocab_size(tp.size), cfg.hidden_size, tp,
            seed=seed, name=OUTPUT_LAYER, std=cfg.init_method_std,
        ).weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tied_logits(x, self.weight, self.tp, sequence_parallel=self.sequence_parallel, recipe=self.recipe)
