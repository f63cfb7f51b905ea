"""The tensor-parallel split of every parameter is read off the parameters themselves (their ``Init``):
checked against what a t = 2 model actually holds on each rank (its shards, side by side, are the dense
tensor; a replicated one is the same everywhere), for GPT,
Llama (grouped queries, SwiGLU, untied) and BERT."""

import pytest
import torch
from torch import nn

from megatron_2bw.checkpoint.names import full_names
from megatron_2bw.checkpoint.reshard import is_vocab, split_dim
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.tensor_parallel.group import TPGroup


def _model(cfg, rank: int, size: int) -> dict[str, torch.Tensor]:
    layers = ModelSpec(cfg, ModelGroups(TPGroup(None, rank, size)), 7).build(0, cfg.num_layers + 2)
    return dict(nn.ModuleList(layers).named_parameters())


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "bert-tiny"])
def test_split_dims_match_what_each_rank_holds(preset):
    cfg = get_preset(preset)
    full, shards = _model(cfg, 0, 1), [_model(cfg, r, 2) for r in range(2)]
    assert set(full) == set(full_names(cfg))
    split = 0
    for name, p in full.items():
        dim, parts = split_dim(cfg, name), [s[name].detach() for s in shards]
        if dim is None:
            assert all(torch.equal(q, p.detach()) for q in parts), name  # replicated: the same tensor everywhere
            continue
        split += 1
        # the shards side by side along that dimension are the dense tensor (a vocabulary's padded rows aside)
        whole = torch.cat(parts, dim)
        assert torch.equal(whole.narrow(dim, 0, p.shape[dim]), p.detach()), name
        assert whole.shape[dim] == (cfg.padded_vocab_size(2) if is_vocab(cfg, name) else p.shape[dim]), name
    assert split >= 4 * cfg.num_layers  # every layer's column- and row-parallel matrices at least
