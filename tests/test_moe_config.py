"""MoE configuration: Megatron-Core's names and defaults, one-line refusals, the flags and their way back, the
not-yet-wired trainer's refusal, dense runs unchanged, and the presets' parameter counts."""

from __future__ import annotations

from dataclasses import asdict, fields, replace

import mcore_reference as mref
import pytest

from megatron_2bw.argv import megatron_args, to_argv
from megatron_2bw.cli import build_config, model_config, parse_args
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.config.moe import MoEConfig, parse_moe_layer_freq
from megatron_2bw.config.moe_presets import MOE_PRESETS, get_moe_preset, moe_layer_params, parameter_counts
from megatron_2bw.errors import ConfigError

TRAIN = ["--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "300", "--device", "cpu"]
BASE = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", *TRAIN]


@pytest.mark.skipif(mref.available() is not None, reason=str(mref.available()))
def test_defaults_are_megatron_cores():
    from megatron.core.transformer import TransformerConfig

    theirs = {f.name: f.default for f in fields(TransformerConfig)}
    for f in fields(MoEConfig):
        if f.name in ("num_experts", "expert_tensor_parallel_size"):
            continue  # num_moe_experts (required here); ETP None there means "= TP", only 1 is built here
        assert f.default == theirs[f.name], f.name


@pytest.mark.parametrize("kw, message", [
    ({"num_experts": 6, "expert_model_parallel_size": 4},
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    ({"moe_router_topk": 9}, "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "--moe-router-num-groups 3 does not divide"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "--moe-router-group-topk 5 must be between 1 and"),
    ({"moe_router_num_groups": 4}, "go together"),
    ({"moe_expert_capacity_factor": 0.0}, "--moe-expert-capacity-factor must be > 0"),
    ({"moe_expert_capacity_factor": -1.0}, "--moe-expert-capacity-factor must be > 0"),
    ({"expert_tensor_parallel_size": 2}, "--expert-tensor-parallel-size 2 is not supported"),
    ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type flex is not supported"),
    ({"moe_router_load_balancing_type": "sinkhorn"}, "--moe-router-load-balancing-type sinkhorn is not supported"),
    ({"moe_router_enable_expert_bias": True}, "needs --moe-router-score-function sigmoid"),
    ({"moe_pad_expert_input_to_capacity": True}, "needs --moe-expert-capacity-factor"),
    ({"moe_shared_expert_gate": True}, "needs --moe-shared-expert-intermediate-size"),
    ({"moe_shared_expert_intermediate_size": 16, "moe_shared_expert_overlap": True},
     "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type alltoall"),
    ({"moe_layer_freq": (0, 2)}, "must hold 0s and 1s"),
])
def test_bad_moe_config_is_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        MoEConfig(**{"num_experts": 8, **kw})
    assert "\n" not in str(e.value)


def test_moe_layer_freq_forms():
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("([0]*3+[1]*2)") == (0, 0, 0, 1, 1)
    assert parse_moe_layer_freq("[1,0,1]") == (1, 0, 1)
    with pytest.raises(ConfigError, match="--moe-layer-freq takes"):
        parse_moe_layer_freq("__import__('os')")
    assert MoEConfig(4, moe_layer_freq=2).moe_layers(5) == (True, False, True, False, True)
    with pytest.raises(ConfigError, match="lists 3 layers, the model has 4"):
        ModelConfig(num_layers=4, moe=MoEConfig(4, moe_layer_freq=(1, 1, 1)))


def test_expert_parallel_must_divide_data_times_context():
    assert Axes(expert=4, data=2, context=2).expert_data == 1
    assert Axes(data=3).expert_data == 3
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 4 does not divide data-parallel size 2 x "
                                          "--context-parallel-size 1"):
        Axes(expert=4, data=2, context=1)
    args = parse_args([*BASE, "--num-experts", "8", "--expert-model-parallel-size", "4"], "gpt")
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 4 does not divide data-parallel size 2"):
        build_config(args, "gpt", 2)  # checked by the run config, before the not-wired refusal


MOE_ARGV = ["--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "([0]*1+[1]*3)",
            "--moe-router-topk", "4", "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4",
            "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp64",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
            "--moe-z-loss-coeff", "1e-3", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
            "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.5",
            "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
            "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate", "--moe-shared-expert-overlap",
            "--moe-grouped-gemm",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-layer-recompute"]
WANT = MoEConfig(8, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1, 1, 1), moe_router_topk=4,
                 moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                 moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp64",
                 moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=1e-3,
                 moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
                 moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.5, moe_token_drop_policy="position",
                 moe_pad_expert_input_to_capacity=True, moe_shared_expert_intermediate_size=64,
                 moe_shared_expert_gate=True, moe_shared_expert_overlap=True, moe_grouped_gemm=True,
                 expert_model_parallel_size=2,
                 moe_layer_recompute=True)


def test_every_flag_reaches_the_config_and_comes_back():
    model = model_config(parse_args([*BASE, *MOE_ARGV], "gpt"), "gpt")
    assert model.moe == WANT
    assert asdict(WANT).keys() == {f.name for f in fields(MoEConfig)}
    dense = build_config(parse_args(BASE, "gpt"), "gpt", 2)
    cfg = replace(dense, model=replace(dense.model, moe=WANT))  # the trainer refuses to build it yet
    argv = [a for a in to_argv(cfg) if a != "--data-path"]  # mock data: an empty --data-path
    assert "--num-experts" in argv and "--moe-layer-freq" in argv
    assert model_config(parse_args([*argv, *TRAIN], "gpt"), "gpt") == cfg.model
    assert megatron_args(cfg)["num_experts"] == 8 and megatron_args(cfg)["moe_layer_freq"] == [0, 1, 1, 1]
    assert ModelConfig(**asdict(cfg.model)) == cfg.model  # a checkpoint's JSON (moe as a dict) reads back


def test_dense_is_unchanged_and_unwired_moe_refused_in_one_line():
    dense = build_config(parse_args(BASE, "gpt"), "gpt", 1)
    assert dense.model.moe is None and not any(a.startswith(("--moe", "--num-experts", "--expert-"))
                                               for a in to_argv(dense))
    assert megatron_args(dense)["num_experts"] is None and megatron_args(dense)["moe_grouped_gemm"] is False
    assert build_config(parse_args([*BASE, "--num-experts", "4"], "gpt"), "gpt", 1).model.moe.num_experts == 4
    assert build_config(parse_args([*BASE, "--num-experts", "4", "--save", "/tmp/x"], "gpt"), "gpt", 1).training.save
    ep2 = build_config(parse_args([*BASE, "--num-experts", "4", "--expert-model-parallel-size", "2", "--save",
                                   "/tmp/x"], "gpt"), "gpt", 2)  # the torch format gathers every expert at a save
    assert ep2.training.ckpt_format == "torch" and ep2.model.moe.expert_model_parallel_size == 2
    bias = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    with pytest.raises(ConfigError, match="the expert bias is saved in --ckpt-format torch_dist only") as e:
        build_config(parse_args([*BASE, "--num-experts", "4", *bias, "--save", "/tmp/x"], "gpt"), "gpt", 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--moe-router-topk needs --num-experts"):
        model_config(parse_args([*BASE, "--moe-router-topk", "2"], "gpt"), "gpt")
    with pytest.raises(ConfigError, match="unrecognized|--num-experts"):
        parse_args(["--model-preset", "bert-tiny", "--num-experts", "4", *TRAIN[:-4]], "bert")


def test_mixtral_8x7b_counts_by_hand_and_published():
    """32 layers: attention 2 * 4096^2 + 2 * 4096 * 1024 (8 key/value heads of 128), two RMSNorms, a router
    8 x 4096, 8 SwiGLU experts of 3 * 4096 * 14336 (2 active); embeddings and the untied output 32000 x 4096,
    the final norm. Published: 46.7B total, 12.9B active."""
    h, f, V, L = 4096, 14336, 32000, 32
    attn, expert = 2 * h * h + 2 * h * 1024 + 2 * h, 3 * h * f
    total = L * (attn + 8 * h + 8 * expert) + 2 * V * h + h
    active = L * (attn + 8 * h + 2 * expert) + 2 * V * h + h
    assert parameter_counts(MOE_PRESETS["mixtral-8x7b"]) == (total, active)
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9


def test_planner_presets_against_published_totals():
    """Qwen3-30B-A3B (30.5B / 3.3B published) has 128-channel heads at h = 2048; here heads are h / 32 = 64
    channels: the query and output projections each lack 2048 x 2048 and the keys and values 2048 x 256 per layer,
    48 x (2 x 2048^2 + 2 x 2048 x 256) = 0.45B fewer attention parameters, which is all the gap.
    DeepSeek-V3 (671B / 37B without its MTP module) uses latent attention; multi-head attention here."""
    qt, qa = parameter_counts(get_moe_preset("qwen3-30b-a3b"))
    missing = 48 * (2 * 2048 * 2048 + 2 * 2048 * 256)
    assert abs((qt + missing) / 30.5e9 - 1) < 0.01 and abs((qa + missing) / 3.3e9 - 1) < 0.02
    dt, da = parameter_counts(get_moe_preset("deepseek-v3-class"))
    assert abs(dt / 671e9 - 1) < 0.01 and abs(da / 37e9 - 1) < 0.06


def test_tiny_presets_by_hand():
    """deepseek-v3-tiny: h 64, one dense layer then 3 MoE layers of 16 experts (SwiGLU 32, top-4), a shared
    expert of 32, router 16 x 64; the dense MLP is SwiGLU 192."""
    m = get_moe_preset("deepseek-v3-tiny")
    assert m.moe.moe_layers(4) == (False, True, True, True) and m.moe.moe_router_enable_expert_bias
    expert, h = 3 * 64 * 32, 64
    assert moe_layer_params(m) == (16 * h + 16 * expert + expert, 16 * h + 4 * expert + expert)
    total, active = parameter_counts(m)
    dense = m.num_parameters()  # every layer with the dense MLP of 3 * 64 * 192
    assert total == dense + 3 * (16 * h + 17 * expert - 3 * h * 192)
    assert active == dense + 3 * (16 * h + 5 * expert - 3 * h * 192)
    for name in ("mixtral-tiny", "qwen3-moe-tiny"):
        t, a = parameter_counts(get_moe_preset(name))
        assert a < t < 1_000_000
    with pytest.raises(ConfigError, match="unknown MoE preset"):
        get_moe_preset("mixtral")


WORLD2 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize("extra, env, line", [
    (["--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--save", "/nonexistent"], {},
     "error: --moe-router-enable-expert-bias --save: the expert bias is saved in --ckpt-format torch_dist only"),
    (["--num-experts", "4", "--moe-router-topk", "5"], {}, "error: --moe-router-topk 5 must be between 1 and "
                                                           "--num-experts 4"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], WORLD2,  # a rank of 2: no peer, no hang
     "error: --expert-model-parallel-size 4 does not divide data-parallel size 2 x --context-parallel-size 1"),
], ids=["not-wired", "topk", "ep-vs-data"])
def test_pretrain_gpt_stops_in_one_line(extra, env, line):
    from e2e import PY, REPO, clean_env, run

    res = run([PY, f"{REPO}/pretrain_gpt.py", *BASE, *extra], env=clean_env(**env), timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.describe()
    assert [ln for ln in res.stderr.splitlines() if ln.strip()][-1].startswith(line), res.describe()
