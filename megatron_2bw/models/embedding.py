"""Input embeddings and the tied output projection shared by GPT and BERT."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.init import normal_full
from ..tensor_parallel.layers import VocabParallelEmbedding
from ..tensor_parallel.mappings import copy_to_tp

WORD_EMBEDDING = "embedding.word"


def word_embedding(cfg: ModelConfig, tp: TPGroup, seed: int) -> VocabParallelEmbedding:
    """The word embedding; its weight is marked ``shared_embedding`` (tied with the output layer).

    When the first and last stage differ, each builds this same weight (same seed and name) and
    the pipeline all-reduces their gradients over the embedding group, so the two copies receive
    identical updates and stay tied in every schedule.
    """
    emb = VocabParallelEmbedding(
        cfg.vocab_size, cfg.padded_vocab_size(tp.size), cfg.hidden_size, tp,
        seed=seed, name=WORD_EMBEDDING, std=cfg.init_method_std,
    )
    emb.weight.shared_embedding = True
    return emb


class Embedding(nn.Module):
    """word + position (+ token type) embeddings, then dropout. Pipeline signature: forward(x, batch)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int):
        super().__init__()
        self.word = word_embedding(cfg, tp, seed)
        self.position = nn.Parameter(
            normal_full((cfg.max_position_embeddings, cfg.hidden_size), cfg.init_method_std, seed, "embedding.position")
        )
        self.tokentype = (
            nn.Parameter(normal_full((cfg.num_tokentypes, cfg.hidden_size), cfg.init_method_std, seed, "embedding.tokentype"))
            if cfg.num_tokentypes else None
        )
        self.dropout = cfg.hidden_dropout

    def forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        tokens = batch["tokens"]
        pos = batch.get("position_ids")  # --reset-position-ids: per-document positions
        h = self.word(tokens) + (self.position[: tokens.shape[1]] if pos is None else F.embedding(pos, self.position))
        if self.tokentype is not None:
            h = h + F.embedding(batch["token_types"], self.tokentype)
        return F.dropout(h, self.dropout, self.training)


def tied_logits(x: torch.Tensor, word_weight: torch.Tensor, tp: TPGroup, bias: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's slice of the output logits, ``[..., padded_vocab / t]``, from the tied weight."""
    return F.linear(copy_to_tp(x, tp), word_weight, bias)
