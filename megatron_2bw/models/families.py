"""The model families by ``--kind``: what differs between GPT and BERT for building and running a stage
(the attention's causality, the head, the loss and the microbatch tensors), stated once as a table so the
spec and the trainer ask it instead of switching on the kind. A new family is one entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import bert, gpt


@dataclass(frozen=True)
class Family:
    causal: bool  # the attention masks future tokens
    head: type  # the last stage's module: head(cfg, tp, seed, kernels, word)
    loss: Callable  # loss(cfg, tp, cp) -> callable(out, batch)
    make_batch: Callable  # make_batch(sample, masks) -> the microbatch's tensors


FAMILIES: dict[str, Family] = {
    "gpt": Family(causal=True, head=gpt.GPTHead, loss=gpt.GPTLoss, make_batch=gpt.make_batch),
    "bert": Family(causal=False, head=bert.BertHead, loss=bert.BertLoss,
                   make_batch=lambda sample, masks=None: bert.make_batch(sample)),
}
