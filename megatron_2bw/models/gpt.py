"""GPT: causal language model (GPT-2 style or Llama style, by ModelConfig), as an ordered list of layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..config.precision import Precision
from ..context_parallel.group import CPGroup
from ..context_parallel.loss import masked_mean
from ..fused import Kernels
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.group import TPGroup
from .embedding import OutputLayer, tied_logits, word_embedding
from .norms import norm


class GPTHead(nn.Module):
    """Final norm and the logits (this rank's vocab slice) through the tied word embedding, or through
    a separate output layer with ``--untie-embeddings-and-output-weights``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, kernels: Kernels | None,
                 word_weight: nn.Parameter | None, recipe: Precision | None = None):
        super().__init__()
        self.tp, self.sequence_parallel, self.recipe = tp, cfg.sequence_parallel, recipe
        self.ln = norm(cfg, kernels, tp)
        if cfg.tied_output:
            # Same stage as the embedding: share its Parameter. Otherwise build the identical copy.
            self.word_weight = word_weight if word_weight is not None else word_embedding(cfg, tp, seed).weight
        else:
            self.output_layer = OutputLayer(cfg, tp, seed, recipe)

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer(self.ln(x))
        return tied_logits(self.ln(x), self.word_weight, self.tp, sequence_parallel=self.sequence_parallel,
                           recipe=self.recipe)


class GPTLoss:
    """Mean LM loss over the tokens selected by ``loss_mask`` (vocab-parallel, never gathers logits; over the
    whole sequence of the context-parallel group)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, cp: CPGroup | None = None):
        self.vocab_size, self.tp, self.cp = cfg.vocab_size, tp, cp

    def __call__(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        losses = vocab_parallel_cross_entropy(logits, batch["labels"], self.vocab_size, self.tp)
        return masked_mean(losses, batch["loss_mask"], self.cp)


@dataclass(frozen=True)
class DocumentMasks:
    """Megatron's ``--eod-mask-loss``, ``--reset-position-ids`` and ``--reset-attention-mask`` with the eod id."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    document_ids: bool = False  # context parallelism: the mask as documents' ids [b, s] (context_parallel/blocks.py)

    @classmethod
    def from_config(cls, data, eod: int | None) -> "DocumentMasks | None":
        """The options of a ``DataConfig`` (None when none is on)."""
        flags = (data.eod_mask_loss, data.reset_position_ids, data.reset_attention_mask)
        return cls(int(eod), *flags) if any(flags) and eod is not None else None


def ltor_masks_and_position_ids(tokens: torch.Tensor, opts: DocumentMasks) -> dict:
    """Megatron's ``get_ltor_masks_and_position_ids`` on input ``tokens [b, s]``, vectorized.

    ``loss_mask`` is 0 where the *input* is eod (the prediction of the next document's first token);
    with ``reset_position_ids`` a position counts from the token after the last eod before it (the eod
    itself ends its document); with ``reset_attention_mask`` a query attends to keys of its own
    document at or before it. The mask is boolean ``[b, 1, s, s]``, True = attend (torch's convention;
    Megatron's is the negation); with ``opts.document_ids`` each token's document number ``[b, s]``.
    Absent keys mean Megatron's defaults (all ones, ``arange``, causal).
    """
    b, s = tokens.shape
    dev = tokens.device  # built where the tokens are (on the GPU, no [b, s, s] host-to-device copy)
    is_eod = tokens == opts.eod
    loss_mask = torch.ones(b, s, device=dev)
    if opts.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    out = {"loss_mask": loss_mask}
    if opts.reset_position_ids:
        idx = torch.arange(s, device=dev).expand(b, s)
        after_eod = torch.where(is_eod, idx + 1, torch.zeros_like(idx))  # a document starts after each eod
        starts = torch.cummax(after_eod, dim=1).values
        starts = torch.cat([torch.zeros(b, 1, dtype=starts.dtype, device=dev), starts[:, :-1]], dim=1)  # eods before
        out["position_ids"] = idx - starts
    if opts.reset_attention_mask:
        e = is_eod.long()
        doc = torch.cumsum(e, dim=1) - e  # document number: eods strictly before the position
        if opts.document_ids:  # each context-parallel core builds the rows and columns it needs
            out["attention_mask"] = doc
        else:
            causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
            out["attention_mask"] = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
    return out


def make_batch(tokens: torch.Tensor, masks: DocumentMasks | None = None) -> dict:
    """Microbatch tensors from ``[b, s+1]`` token samples: inputs, shifted labels, loss mask (and with
    ``masks``, Megatron's document-aware loss mask, position ids and attention mask)."""
    inputs = tokens[:, :-1].contiguous()
    batch = {"tokens": inputs, "labels": tokens[:, 1:].contiguous()}
    if masks is None:
        batch["loss_mask"] = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        return batch
    return {**batch, **ltor_masks_and_position_ids(inputs, masks)}
