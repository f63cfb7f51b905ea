"""Tensor-parallel split/merge and pipeline restacking of full state dicts."""

from __future__ import annotations

import pytest
import torch
from export_helpers import tiny

from megatron_2bw.checkpoint.names import full_names, stage_names
from megatron_2bw.checkpoint.reshard import join_stages, merge_tensor_parallel, reshard, split_tensor_parallel, unshard
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.model_io import build_full_model, global_state_dict
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.tensor_parallel.group import TPGroup


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("t", [2, 4])
def test_split_matches_tensor_parallel_layers(kind, t):
    """Rank r's shard of the seed's full model is exactly what tensor_parallel/ builds on rank r."""
    cfg = get_preset(f"{kind}-tiny")
    full = global_state_dict(build_full_model(cfg, seed=5))
    shards = split_tensor_parallel(cfg, full, t)
    for r in range(t):
        layers = torch.nn.ModuleList(ModelSpec(cfg, ModelGroups(TPGroup(None, r, t)), 5).build(0, cfg.num_layers + 2))
        held = dict(layers.named_parameters())
        assert set(held) == set(shards[r])
        for name, p in held.items():
            assert torch.equal(p.detach(), shards[r][name]), (r, name)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_split_then_merge_is_identity(kind):
    ex, _ = tiny(kind)
    for t in (1, 2, 4):
        back = merge_tensor_parallel(ex.cfg, split_tensor_parallel(ex.cfg, ex.weights, t))
        assert all(torch.equal(back[n], v) for n, v in ex.weights.items())
    for t, d in ((1, 2), (2, 4), (4, 1)):
        files = reshard(ex.cfg, ex.weights, t, d)
        assert set(files) == {(a, b) for a in range(t) for b in range(d)}
        back = unshard(ex.cfg, files)
        assert all(torch.equal(back[n], v) for n, v in ex.weights.items())


def test_vocab_padding_follows_t():
    ex, _ = tiny("gpt")  # vocabulary 300: 384 rows at t = 1, 512 at t = 4
    shards = split_tensor_parallel(ex.cfg, ex.weights, 4)
    assert [s["0.word.weight"].shape[0] for s in shards] == [128] * 4
    joined = torch.cat([s["0.word.weight"] for s in shards])
    assert torch.equal(joined[:300], ex.weights["0.word.weight"][:300]) and not joined[300:].any()


def test_stages_partition_the_model():
    cfg = get_preset("gpt-tiny")
    for d in (1, 2, 4):
        seen = [n for r in range(d) for n in stage_names(cfg, d, r)]
        assert sorted(set(seen)) == sorted(full_names(cfg))
        assert len(seen) == len(full_names(cfg)) + (d > 1)  # the last stage's tied word-embedding copy


def test_disagreeing_shards_are_refused():
    ex, _ = tiny("gpt")
    shards = split_tensor_parallel(ex.cfg, ex.weights, 2)
    shards[1]["1.ln1.weight"] = shards[1]["1.ln1.weight"] + 1
    with pytest.raises(ConfigError, match="differs between tensor-parallel shards"):
        merge_tensor_parallel(ex.cfg, shards)
    stages = [dict(x) for x in reshard(ex.cfg, ex.weights, 1, 2).values()]
    stages[1]["0.word.weight"] = stages[1]["0.word.weight"] * 2
    with pytest.raises(ConfigError, match="disagree on the tied parameter"):
        join_stages(ex.cfg, stages)
