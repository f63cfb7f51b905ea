"""Per-layer counting (parameters, FLOPs, activation bytes) and the profile schema."""

import json

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import (
    analytic_layer_costs,
    analytic_microbatch_costs,
    embedding_params,
    head_params,
    layer_costs_from_json,
    layer_forward_flops,
    layer_params,
    layer_stash_bytes,
    load_profile,
    tied_params,
)

V100 = load_cluster("aws-p3.16xlarge")


@pytest.mark.parametrize("kind, tokentypes", [("gpt", 0), ("bert", 2)])
def test_parameter_count_matches_the_model(kind, tokentypes):
    # A vocabulary that needs no padding, so the planner's count equals ModelConfig's.
    m = ModelConfig(kind, 24, 1024, 16, 512, 512, 128 * 393, num_tokentypes=tokentypes)
    one_stage = m.num_layers * layer_params(m, 1) + embedding_params(m, 1) + head_params(m, 1) - tied_params(m, 1)
    assert one_stage == m.num_parameters()


def test_tensor_parallel_splits_the_big_matrices():
    m = ModelConfig("gpt", 32, 2304, 32, 512, 512, 50257)
    h = 2304
    assert layer_params(m, 1) == 12 * h * h + 13 * h
    replicated = 6 * h  # projection bias, second MLP bias, two LayerNorms
    assert layer_params(m, 4) == (12 * h * h + 13 * h - replicated) // 4 + replicated
    assert tied_params(m, 1) == 50304 * h and tied_params(m, 2) == 50432 * h // 2


def test_layer_flops():
    m = ModelConfig("gpt", 2, 64, 4, 16, 16, 300)
    b, s, h = 2, 16, 64
    assert layer_forward_flops(m, b, 1) == 24 * b * s * h * h + 4 * b * s * s * h
    assert layer_forward_flops(m, b, 4) == layer_forward_flops(m, b, 1) / 4


def test_activation_bytes_are_korthikanti():
    # fp16, dropout on, f = 4h: s*b*h*(34 + 5*a*s/h) at t = 1, s*b*h*(10 + 24/t + 5*a*s/(h*t)) otherwise.
    m = ModelConfig("gpt", 32, 2304, 32, 512, 512, 50257, hidden_dropout=0.1, attention_dropout=0.1)
    s, h, a, b = 512, 2304, 32, 3
    assert layer_stash_bytes(m, b, 1, 2) == s * b * h * 34 + 5 * a * s * s * b
    assert layer_stash_bytes(m, b, 4, 2) == s * b * h * 10 + (24 * s * b * h + 5 * a * s * s * b) // 4
    # Without dropout there are no masks and no dropout outputs.
    nodrop = ModelConfig("gpt", 32, 2304, 32, 512, 512, 50257)
    assert layer_stash_bytes(nodrop, b, 1, 2) == s * b * h * 32 + 2 * a * s * s * b


def test_analytic_times_and_bytes():
    m = ModelConfig("gpt", 32, 2304, 32, 512, 512, 50257, hidden_dropout=0.1, attention_dropout=0.1)
    c = analytic_microbatch_costs(m, V100, "fp16", 1, 8)
    speed = V100.peak("fp16") * V100.efficiency.fraction(8 * 512 * 2304)
    assert c.layer.forward_s == pytest.approx(layer_forward_flops(m, 8, 1) / speed)
    assert c.layer.backward_s == pytest.approx(2 * c.layer.forward_s)
    assert c.layer.input_bytes == 8 * 512 * 2304 * 2
    assert c.layer.tp_allreduce_forward_bytes == 0  # t = 1: nothing to all-reduce
    c4 = analytic_microbatch_costs(m, V100, "fp16", 4, 8)
    assert c4.layer.tp_allreduce_forward_bytes == 2 * c.layer.input_bytes
    # The head keeps the fp32 softmax of the logits.
    assert c.head.stash_bytes >= 8 * 512 * 50304 * 4
    assert c.tied_params == tied_params(m, 1)
    # Larger microbatches are more efficient per sample.
    c1 = analytic_microbatch_costs(m, V100, "fp16", 1, 1)
    assert c.layer.forward_s / 8 < c1.layer.forward_s


def test_profile_round_trip(tmp_path):
    m = ModelConfig("gpt", 4, 64, 4, 16, 16, 300)
    costs = analytic_layer_costs(m, V100, "fp16", (1, 2), (1, 2, 4))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(costs.to_json()))
    loaded = load_profile(str(path))
    assert loaded.table == costs.table
    assert loaded.tensor_sizes() == (1, 2) and loaded.micro_batch_sizes(2) == (1, 2, 4)
    assert loaded.source.startswith("profile ")


@pytest.mark.parametrize("data, match", [
    ({"format": "other"}, "format"),
    ({"format": "megatron_2bw-profile-v1", "entries": []}, "non-empty"),
    ({"format": "megatron_2bw-profile-v1", "entries": [{"tensor_parallel": 1}]}, "micro_batch_size"),
    ({"format": "megatron_2bw-profile-v1",
      "entries": [{"tensor_parallel": 1, "micro_batch_size": 1, "layer": {"forward_s": 1}}]}, "missing"),
])
def test_bad_profiles(data, match):
    with pytest.raises(ConfigError, match=match):
        layer_costs_from_json(data, "p.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile("/no/such/profile.json")
