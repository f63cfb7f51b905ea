"""Tensor-parallel split/merge of full state dicts and their pipeline-stage slices.

How each parameter is split across t ranks (as ``tensor_parallel/layers.py`` holds it, read from each
parameter's ``Init`` by :func:`split_dim`):

* column-parallel (``attn.qkv``, ``mlp.fc1``, SwiGLU's ``mlp.gate`` and ``mlp.up``, weight and
  bias): contiguous row blocks. The QKV rows are grouped per head ([heads, 3, head_dim],
  Megatron's checkpoint_version 3.0 order; per query group [heads/groups + 2, head_dim] with
  grouped-query attention), so a block is whole heads (groups);
* row-parallel (``attn.proj``, ``mlp.fc2`` weight): contiguous column blocks, bias replicated;
* vocabulary-parallel (word embedding, an untied output layer, BERT's output bias): rows padded to a multiple of
  128 * t with zeros, then contiguous row blocks;
* everything else (LayerNorms, positions, BERT's dense head layers) is replicated.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..models.groups import ModelGroups
from ..models.spec import ModelSpec
from ..tensor_parallel import init
from .names import OUTPUT, WORD, Split, head_index, rank_names, stage_names


def is_vocab(cfg: ModelConfig, name: str) -> bool:
    return (name == WORD or (cfg.kind == "bert" and name == f"{head_index(cfg)}.lm_bias")
            or name == f"{head_index(cfg)}.{OUTPUT}")


def whole_model_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as one process holds the whole model: every expert local (expert-parallel size 1; a checkpoint
    records the size it was trained at, which shapes neither its global tensors nor their tensor split)."""
    if cfg.moe is None or cfg.moe.expert_model_parallel_size == 1:
        return cfg
    return replace(cfg, moe=replace(cfg.moe, expert_model_parallel_size=1))


@functools.lru_cache(maxsize=16)
def _split_dims(cfg: ModelConfig) -> dict[str, int | None]:
    """Every global name's tensor-parallel split dimension, read off the parameters themselves: each carries
    the :class:`~megatron_2bw.tensor_parallel.init.Init` its layer made it with (``dim``: None replicated; a
    parameter without one, as a plain norm, is replicated).
    Built once per model on the meta device, so resharding, checkpoint shards and export share the layers'
    own statement of it."""
    with init.deferred():
        model = nn.ModuleList(ModelSpec(whole_model_config(cfg), ModelGroups(), 0).build(0, cfg.num_layers + 2))
    return {name: getattr(getattr(p, "init", None), "dim", None) for name, p in model.named_parameters()}


def split_dim(cfg: ModelConfig, name: str) -> int | None:
    """The dimension ``name`` is split along across tensor ranks; None when replicated."""
    dims = _split_dims(cfg)
    if name not in dims:
        raise ConfigError(f"{name} is not a parameter of this {cfg.kind} model")
    return dims[name]


def pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with its first dimension cut or zero-padded to ``rows``."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], 0)


def split_tensor_parallel(cfg: ModelConfig, full: dict[str, torch.Tensor], t: int) -> list[dict[str, torch.Tensor]]:
    """The ``t`` shards of a full state dict, each as tensor rank r holds it."""
    cfg.check_tensor_parallel(t)
    padded = cfg.padded_vocab_size(t)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(t)]
    for name, value in full.items():
        dim = split_dim(cfg, name)
        if is_vocab(cfg, name):
            value = pad_vocab(value, padded)
        pieces = [value] * t if dim is None or t == 1 else value.chunk(t, dim=dim)
        for r in range(t):
            shards[r][name] = pieces[r].clone()
    return shards


def merge_tensor_parallel(cfg: ModelConfig, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full (t = 1) state dict from the shards of every tensor rank, in rank order.

    Vocabulary tensors come back padded to 128 rows' multiple (the t = 1 model's shape);
    replicated tensors are taken from rank 0 after checking every rank agrees.
    """
    t = len(shards)
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        dim = split_dim(cfg, name)
        values = [s[name] for s in shards]
        if dim is None or t == 1:
            if any(not torch.equal(values[0], v) for v in values[1:]):
                raise ConfigError(f"replicated parameter {name} differs between tensor-parallel shards")
            merged = values[0]
        else:
            merged = torch.cat(values, dim)
        if is_vocab(cfg, name):
            merged = pad_vocab(merged, cfg.padded_vocab_size(1))
        out[name] = merged.clone()
    return out


def stage_slice(cfg: ModelConfig, state: dict[str, torch.Tensor], d: int, r: int, split: Split = None,
                chunks: int = 1) -> dict[str, torch.Tensor]:
    """The part of a (full or tensor-sharded) state dict that pipeline stage ``r`` of ``d`` holds (all of its
    ``chunks`` model chunks)."""
    return {n: state[n] for n in rank_names(cfg, d, r, split, chunks)}


def join_stages(cfg: ModelConfig, stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A whole-model state dict from every stage's slice (checks the tied word-embedding copies agree)."""
    out: dict[str, torch.Tensor] = {}
    for part in stages:
        for name, value in part.items():
            if name in out:
                if not torch.equal(out[name], value):
                    raise ConfigError(f"pipeline stages disagree on the tied parameter {name}")
                continue
            out[name] = value
    missing = [n for n in stage_names(cfg, 1, 0) if n not in out]
    if missing:
        raise ConfigError(f"the pipeline stages lack {len(missing)} parameters, e.g. {missing[0]}")
    return out


def reshard(cfg: ModelConfig, full: dict[str, torch.Tensor], t: int, d: int,
            split: Split = None, chunks: int = 1) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Every (tensor rank, pipeline rank) file's state dict of a ``t x d`` layout (``chunks`` model chunks
    per rank: interleaved)."""
    shards = split_tensor_parallel(cfg, full, t)
    return {(tp, pp): stage_slice(cfg, shards[tp], d, pp, split, chunks) for tp in range(t) for pp in range(d)}


def unshard(cfg: ModelConfig, files: dict[tuple[int, int], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`reshard`: the full state dict from every (tensor, pipeline) rank's dict."""
    t = 1 + max(tp for tp, _ in files)
    d = 1 + max(pp for _, pp in files)
    if set(files) != {(a, b) for a in range(t) for b in range(d)}:
        raise ConfigError(f"checkpoint shards are incomplete for layout t={t} d={d}: have {sorted(files)}")
    per_tp = [join_stages(cfg, [files[(tp, pp)] for pp in range(d)]) for tp in range(t)]
    return merge_tensor_parallel(cfg, per_tp)
