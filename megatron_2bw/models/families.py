"""The model families by ``--kind``: what differs between GPT and BERT for building and running a stage
(the layer's blocks, the head, the loss and the microbatch tensors), stated once as a table so the spec and
the trainer ask it instead of switching on the kind. The torch-free facts (causality, which options a family
takes, its head's arithmetic and Megatron names) are ``config/families.py``'s. A new family is one entry in
each table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config.families import FAMILIES as FACTS
from . import bert, gpt
from .transformer import LayerSpec, layer_spec


@dataclass(frozen=True)
class Family:
    causal: bool  # the attention masks future tokens (``config/families.py``)
    head: type  # the last stage's module: head(cfg, tp, seed, kernels, word, recipe=)
    loss: Callable  # loss(cfg, tp, cp) -> callable(out, batch)
    make_batch: Callable  # make_batch(sample, masks) -> the microbatch's tensors
    layer: Callable[..., LayerSpec] = layer_spec  # layer(cfg) -> the transformer layer's blocks


FAMILIES: dict[str, Family] = {
    "gpt": Family(causal=FACTS["gpt"].causal, head=gpt.GPTHead, loss=gpt.GPTLoss, make_batch=gpt.make_batch),
    "bert": Family(causal=FACTS["bert"].causal, head=bert.BertHead, loss=bert.BertLoss,
                   make_batch=lambda sample, masks=None: bert.make_batch(sample)),
}
