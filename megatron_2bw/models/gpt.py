"""GPT: causal language model (GPT-2 style or Llama style, by ModelConfig), as an ordered list of layers."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..fused import Kernels
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.group import TPGroup
from .embedding import OutputLayer, tied_logits, word_embedding
from .norms import norm


class GPTHead(nn.Module):
    """Final norm and the logits (this rank's vocab slice) through the tied word embedding, or through
    a separate output layer with ``--untie-embeddings-and-output-weights``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, kernels: Kernels | None, word_weight: nn.Parameter | None):
        super().__init__()
        self.tp, self.sequence_parallel = tp, cfg.sequence_parallel
        self.ln = norm(cfg, kernels, tp)
        if cfg.tied_output:
            # Same stage as the embedding: share its Parameter. Otherwise build the identical copy.
            self.word_weight = word_weight if word_weight is not None else word_embedding(cfg, tp, seed).weight
        else:
            self.output_layer = OutputLayer(cfg, tp, seed)

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer(self.ln(x))
        return tied_logits(self.ln(x), self.word_weight, self.tp, sequence_parallel=self.sequence_parallel)


class GPTLoss:
    """Mean LM loss over the tokens selected by ``loss_mask`` (vocab-parallel, never gathers logits)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        self.vocab_size, self.tp = cfg.vocab_size, tp

    def __call__(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        losses = vocab_parallel_cross_entropy(logits, batch["labels"], self.vocab_size, self.tp)
        mask = batch["loss_mask"]
        return (losses * mask).sum() / mask.sum().clamp(min=1)


def make_batch(tokens: torch.Tensor) -> dict:
    """Microbatch tensors from ``[b, s+1]`` token samples: inputs, shifted labels, loss mask."""
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(tokens.shape[0], tokens.shape[1] - 1),
    }
