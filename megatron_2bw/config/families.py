"""What differs between the model families (``--kind``), torch-free: the facts the config checks, the
arithmetic, the planner, the checkpoint names and the exports ask instead of comparing the kind. The
models' side of the table (builders, loss, batches) is ``models/families.py``; a new family is one entry
in each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

Model = Any  # a ModelConfig


@dataclass(frozen=True)
class HeadParam:
    """A parameter of a family's head beyond the final norm and the output layer."""

    name: str  # its path in the head module ("pooler.weight")
    shape: tuple[int, ...]
    split: int | None  # the dimension split over the tensor group; None: replicated
    megatron: tuple[str, ...]  # its path in a Megatron-LM v2 checkpoint's ``model`` dict


class HeadArith:
    """A head with nothing beyond the final norm and the (tied or own) output layer: GPT's."""

    megatron: ClassVar[dict[str, tuple[str, ...]]] = {}  # each extra parameter's path in a Megatron-LM v2 checkpoint

    def params(self, model: Model, vocab: int) -> list[HeadParam]:
        """The extra parameters, ``vocab`` the output rows (padded on a rank, the real vocabulary in the count)."""
        return []

    def extra_params(self, model: Model, vocab: int, t: int) -> int:
        """Their count on one GPU of a ``t``-way tensor group."""
        ps = self.params(model, vocab)
        split = sum(_numel(p.shape) for p in ps if p.split is not None)
        return split // t + sum(_numel(p.shape) for p in ps if p.split is None)

    def extra_macs(self, model: Model) -> int:
        """Multiply-adds per token of its replicated GEMMs beside the logits (forward)."""
        return 0

    def extra_stash_bytes(self, model: Model, b: int, e: int) -> int:
        return 0

    def extra_wgrad_stash_bytes(self, model: Model, b: int, e: int) -> int:
        """Output gradients a split backward's I catches for the extra parameters' deferred W."""
        return 0

    def extra_wgrad_input_bytes(self, model: Model, b: int, e: int) -> int:
        """What their W reads of the stash."""
        return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class BertHeadArith(HeadArith):
    """BERT's head (``models/bert.py``): the masked-LM transform (dense, GeLU, LayerNorm), the output bias over
    the vocabulary, the pooler and the sentence-order classifier."""

    megatron = {  # lm_head and binary_head sit beside language_model
        "lm_dense.weight": ("lm_head", "dense.weight"),
        "lm_dense.bias": ("lm_head", "dense.bias"),
        "lm_ln.weight": ("lm_head", "layernorm.weight"),
        "lm_ln.bias": ("lm_head", "layernorm.bias"),
        "lm_bias": ("lm_head", "bias"),
        "pooler.weight": ("language_model", "pooler", "dense.weight"),
        "pooler.bias": ("language_model", "pooler", "dense.bias"),
        "sop.weight": ("binary_head", "weight"),
        "sop.bias": ("binary_head", "bias"),
    }

    def params(self, model: Model, vocab: int) -> list[HeadParam]:
        h = model.hidden_size
        shapes = {"lm_dense.weight": (h, h), "lm_bias": (vocab,), "pooler.weight": (h, h), "sop.weight": (2, h),
                  "sop.bias": (2,)}
        return [HeadParam(n, shapes.get(n, (h,)), 0 if n == "lm_bias" else None, path)
                for n, path in self.megatron.items()]

    def extra_macs(self, model: Model) -> int:
        return model.hidden_size ** 2  # the LM transform (replicated); the pooler's [b, h] GEMMs left out

    def extra_stash_bytes(self, model: Model, b: int, e: int) -> int:
        return 3 * b * model.seq_length * model.hidden_size * e  # the transform's input, GeLU's, the norm's

    def extra_wgrad_stash_bytes(self, model: Model, b: int, e: int) -> int:
        # the LM-head transform's GEMM's and norm's output gradients, the pooler's and binary head's ([b, h], [b, 2])
        h = model.hidden_size
        return 2 * b * model.seq_length * h * e + e * b * (h + 2)

    def extra_wgrad_input_bytes(self, model: Model, b: int, e: int) -> int:
        # the transform's GEMM input and its norm's (with fp32 statistics), the binary head's input (the
        # pooler's is a view of hidden states already counted)
        h, s = model.hidden_size, model.seq_length
        return 2 * b * s * h * e + 2 * b * s * 4 + e * b * h


@dataclass(frozen=True)
class Family:
    causal: bool  # the attention masks future tokens
    gpt_options: bool  # --sequence-parallel, RoPE, SwiGLU, grouped-query attention, untied output, no linear biases
    padding_mask: bool  # every batch carries an attention mask (BERT's padding)
    megatron_stack: str  # Megatron-Core's name of the layer stack
    head: HeadArith


FAMILIES: dict[str, Family] = {
    "gpt": Family(causal=True, gpt_options=True, padding_mask=False, megatron_stack="decoder", head=HeadArith()),
    "bert": Family(causal=False, gpt_options=False, padding_mask=True, megatron_stack="encoder",
                   head=BertHeadArith()),
}
