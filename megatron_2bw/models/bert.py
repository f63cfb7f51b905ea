"""BERT: bidirectional encoder with a masked-LM head (tied embeddings) and a sentence-order head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..config.precision import Precision
from ..context_parallel.group import CPGroup
from ..context_parallel.loss import first_token_only, masked_mean
from ..fused import Kernels, layer_norm
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.init import Init, parameter
from ..tensor_parallel.layers import ReplicatedLinear
from .embedding import tied_logits, word_embedding


class BertHead(nn.Module):
    """Final LayerNorm; masked-LM transform + tied logits (+ vocab-parallel bias); SOP pooler + classifier."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, kernels: Kernels | None,
                 word_weight: nn.Parameter | None, recipe: Precision | None = None):
        super().__init__()
        self.tp, self.recipe = tp, recipe
        h, std = cfg.hidden_size, cfg.init_method_std
        self.ln = layer_norm(h, cfg.layernorm_epsilon, kernels)
        self.lm_dense = ReplicatedLinear(h, h, seed=seed, name="head.lm_dense", std=std, recipe=recipe)
        self.lm_ln = layer_norm(h, cfg.layernorm_epsilon, kernels)
        self.word_weight = word_weight if word_weight is not None else word_embedding(cfg, tp, seed).weight
        self.lm_bias = parameter(Init("head.lm_bias", seed, (cfg.padded_vocab_size(tp.size),), None, 0, tp.rank,
                                      tp.size))
        self.lm_bias.tensor_parallel = tp.size > 1
        self.pooler = ReplicatedLinear(h, h, seed=seed, name="head.pooler", std=std, recipe=recipe)
        self.sop = ReplicatedLinear(h, 2, seed=seed, name="head.sop", std=std, recipe=recipe)

    def forward(self, x: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.ln(x)
        lm = self.lm_ln(F.gelu(self.lm_dense(x), approximate="tanh"))
        logits = tied_logits(lm, self.word_weight, self.tp, self.lm_bias, recipe=self.recipe)
        sop = self.sop(torch.tanh(self.pooler(x[:, 0])))
        return logits, sop


class BertLoss:
    """Masked-LM loss (mean over masked positions) plus sentence-order-prediction loss.

    The gradient flows through the sum; :meth:`parts` also returns the two terms (detached) so the
    engine can report them separately (Megatron logs ``lm loss`` and ``sop loss``).
    """

    components = ("lm_loss", "sop_loss")  # the names :meth:`parts` returns, in this order

    def __init__(self, cfg: ModelConfig, tp: TPGroup, cp: CPGroup | None = None):
        self.vocab_size, self.tp, self.cp = cfg.vocab_size, tp, cp

    def parts(self, output: tuple[torch.Tensor, torch.Tensor],
              batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the total for backward, {"lm_loss": MLM, "sop_loss": SOP} detached)."""
        logits, sop = output
        losses = vocab_parallel_cross_entropy(logits, batch["labels"], self.vocab_size, self.tp)
        lm = masked_mean(losses, batch["loss_mask"], self.cp)
        so = first_token_only(F.cross_entropy(sop.float(), batch["sop_label"]), self.cp)  # [CLS]: context rank 0
        return lm + so, {"lm_loss": lm.detach(), "sop_loss": so.detach()}

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], batch: dict) -> torch.Tensor:
        return self.parts(output, batch)[0]


def random_samples(n: int, seq_length: int, vocab_size: int, generator: torch.Generator,
                   mask_prob: float = 0.15) -> dict:
    """``n`` stacked random samples in the dataset's layout (segment B is the second half), for
    measurements and tests that need BERT-shaped data without a corpus."""
    s = seq_length
    return dict(
        tokens=torch.randint(0, vocab_size, (n, s), generator=generator),
        token_types=(torch.arange(s) >= s // 2).long().expand(n, s).contiguous(),
        labels=torch.randint(0, vocab_size, (n, s), generator=generator),
        loss_mask=(torch.rand(n, s, generator=generator) < mask_prob).float(),
        padding_mask=torch.ones(n, s),
        sop_label=torch.randint(0, 2, (n,), generator=generator),
    )


def make_batch(sample: dict) -> dict:
    """Microbatch tensors from stacked BERT samples; padding becomes a boolean attention mask."""
    pad = sample["padding_mask"].bool()
    return {
        "tokens": sample["tokens"],
        "token_types": sample["token_types"],
        "labels": sample["labels"],
        "loss_mask": sample["loss_mask"].float(),
        "sop_label": sample["sop_label"].long().view(-1),
        "attention_mask": pad[:, None, None, :],
    }
