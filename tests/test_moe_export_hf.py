"""Hugging Face export and import of MoE GPTs (issue 42): ``checkpoint_util --saver hf`` of a trained torch_dist
checkpoint writes ``MixtralForCausalLM`` (SwiGLU experts, RMSNorm, RoPE, no shared expert) or
``Qwen2MoeForCausalLM`` (a shared expert with its sigmoid gate, a dense first layer) with per-expert tensors on
disk, as the published checkpoints store them, and the run's tokenizer beside them. ``AutoModelForCausalLM``
loads it: logits within 1e-5 of ours (fp32) and transformers' greedy ``generate`` token for token ours
(``export.generation``, what tools/generate.py runs). ``--loader hf`` reads it back: our logits bitwise. Routing
neither class implements is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from export_helpers import gpt_logits, max_err
from multiproc import run_workers
from test_export_tokenizer import TEXT
from test_moe_training import _cli
from test_offline_tools import tool

from megatron_2bw.checkpoint.megatron_format import Exported
from megatron_2bw.config.moe import MoEConfig
from megatron_2bw.config.moe_presets import get_moe_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.checkpoints import load_checkpoint, save_checkpoint
from megatron_2bw.export.generation import CachedGPT, generate
from megatron_2bw.export.model_io import build_full_model, global_state_dict, load_full

TOL = 1e-5
TRAIN = ["--model-preset", "llama-tiny", "--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "3e-2", "--mock-data",
         "--device", "cpu", "--eval-iters", "0", "--log-interval", "1", "--seed", "1234", "--init-method-std", "0.2",
         "--ckpt-format", "torch_dist", "--save-interval", "2"]
SHAPES = {  # what checkpoint_util must write, and the flags that shape it
    "mixtral": ("MixtralForCausalLM", []),
    "qwen2_moe": ("Qwen2MoeForCausalLM", ["--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "48",
                                          "--moe-shared-expert-gate", "--moe-router-pre-softmax"]),
}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> list[str]:
    from tokenizers import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("bpe")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT] * 20, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save_model(str(d))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(d / "vocab.json"),
            "--merge-file", str(d / "merges.txt")]


def _train(root: str, tokenizer: list[str]) -> None:
    for name, (_, flags) in SHAPES.items():
        _cli([*TRAIN, *tokenizer, *flags, "--save", os.path.join(root, name)], os.path.join(root, f"{name}.jsonl"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, bpe) -> str:
    """Each shape trained 2 steps through the CLI (torch_dist), then exported by checkpoint_util."""
    root = str(tmp_path_factory.mktemp("moe_hf"))
    run_workers(_train, 1, root, bpe, timeout=300)
    for name in SHAPES:
        assert tool("checkpoint_util").main(["--load-dir", os.path.join(root, name), "--save-dir",
                                             os.path.join(root, f"{name}_hf"), "--saver", "hf"]) == 0
    return root


def _ours(path: str, loader: str = "auto"):
    ex, _ = load_checkpoint(path, loader)
    return ex, load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()


def _disk_keys(path: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", list(SHAPES))
def test_saver_hf_writes_per_expert_tensors_and_config(exported, name):
    hf_dir = os.path.join(exported, f"{name}_hf")
    with open(os.path.join(hf_dir, "config.json")) as f:
        conf = json.load(f)
    keys = _disk_keys(hf_dir)
    assert conf["architectures"] == [SHAPES[name][0]] and conf["num_experts_per_tok"] == 2
    if name == "mixtral":
        assert conf["num_local_experts"] == 4 and conf["intermediate_size"] == 128
        per_expert = {f"model.layers.{i}.block_sparse_moe.experts.{k}.w{j}.weight"
                      for i in range(2) for k in range(4) for j in (1, 2, 3)}
        assert {f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(2)} <= keys
    else:
        assert (conf["num_experts"], conf["moe_intermediate_size"], conf["shared_expert_intermediate_size"]) == (
            4, 128, 48)
        assert conf["mlp_only_layers"] == [0] and conf["norm_topk_prob"] is False
        per_expert = {f"model.layers.1.mlp.experts.{k}.{p}_proj.weight" for k in range(4)
                      for p in ("gate", "up", "down")}
        assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                "model.layers.1.mlp.shared_expert.gate_proj.weight"} <= keys
    assert per_expert <= keys and not any("gate_up_proj" in k for k in keys)


@pytest.mark.parametrize("name", list(SHAPES))
def test_hf_logits_generation_and_import_back(exported, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ex, ours = _ours(os.path.join(exported, name))
    hf_dir = os.path.join(exported, f"{name}_hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf).__name__ == SHAPES[name][0]
    vocab = ex.cfg.vocab_size
    tokens = torch.randint(0, vocab, (2, ex.cfg.seq_length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = max_err(hf(tokens).logits, gpt_logits(ours, tokens, vocab))
    print(f"{name}: HF vs ours max |logit diff| {err:.2e}")
    assert err < TOL
    prompt = tokens[0, :4].tolist()
    mine = generate(CachedGPT(ex.cfg, ex.weights), prompt, 10)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                         pad_token_id=0, eos_token_id=None, attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert mine == theirs[0, 4:].tolist() and len(set(mine)) > 2, (mine, theirs)
    from megatron_2bw.data.tokenizers import build_tokenizer

    t = ex.tokenizer
    ids = build_tokenizer(t["tokenizer_type"], None, t["vocab_file"], t["merge_file"]).tokenize(TEXT)
    assert AutoTokenizer.from_pretrained(hf_dir)(TEXT)["input_ids"] == ids  # the tokenizer travelled with it
    back, again = _ours(hf_dir, "hf")
    assert back.cfg.moe.num_experts == 4 and back.cfg.moe.moe_layers(2) == ex.cfg.moe.moe_layers(2)
    assert torch.equal(gpt_logits(again, tokens, vocab), gpt_logits(ours, tokens, vocab))


def _model(bias: bool = False, **moe) -> Exported:
    cfg = get_moe_preset("mixtral-tiny", num_layers=2, add_bias_linear=bias,
                         moe=MoEConfig(4, moe_router_topk=2, **moe))
    return Exported(cfg, global_state_dict(build_full_model(cfg)))


@pytest.mark.parametrize("moe, words", [
    ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
     "--moe-router-score-function sigmoid, --moe-router-enable-expert-bias"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, "--moe-router-num-groups"),
    ({"moe_router_topk_scaling_factor": 2.5}, "--moe-router-topk-scaling-factor"),
    ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
    ({"moe_shared_expert_intermediate_size": 32}, "a shared expert without --moe-shared-expert-gate"),
    ({"moe_layer_freq": 2}, "dense layers (--moe-layer-freq) without a shared expert"),
    ({"bias": True}, "linear biases (no --disable-bias-linear)"),
], ids=["sigmoid-bias", "groups", "scaling", "capacity", "ungated-shared", "dense-layers", "biases"])
def test_saver_hf_refuses_routing_hf_does_not_implement(tmp_path, moe, words):
    with pytest.raises(ConfigError) as e:
        save_checkpoint(_model(**moe), str(tmp_path / "hf"), "hf")
    line = str(e.value)
    assert line.startswith("--saver hf cannot write this MoE model") and words in line and "\n" not in line
    assert not os.path.exists(tmp_path / "hf" / "config.json")


def test_loader_hf_refuses_what_this_model_cannot_hold(tmp_path):
    """A Mixtral whose head_dim is not hidden / heads, or with a sliding window: one line, not a shape error."""
    from transformers import MixtralConfig, MixtralForCausalLM

    base = dict(vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4)
    for name, extra, words in (("hd", {"head_dim": 4}, "head_dim 4 is not hidden_size / num_attention_heads"),
                               ("sw", {"sliding_window": 8}, "sliding window (8) is not implemented")):
        MixtralForCausalLM(MixtralConfig(**base, **extra)).save_pretrained(str(tmp_path / name))
        with pytest.raises(ConfigError, match=words.replace("(", "\\(").replace(")", "\\)")):
            load_checkpoint(str(tmp_path / name), "hf")


def test_cli_weights_only_megatron_refused_trainer_torch_format_kept(exported, tmp_path, capsys):
    """Through checkpoint_util: an MoE model as Megatron-LM v2.x weights only is one line (that layout has no
    experts); with its optimizer state it becomes a trainer checkpoint in the torch format, every expert kept."""
    util, src = tool("checkpoint_util"), os.path.join(exported, "mixtral")
    assert util.main(["--load-dir", src, "--save-dir", str(tmp_path / "out"), "--no-optimizer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Megatron-LM v2.x's layout has no" in err, err
    assert not os.path.exists(tmp_path / "out")
    assert util.main(["--load-dir", src, "--save-dir", str(tmp_path / "torch"), "--target-tensor-parallel-size",
                      "2"]) == 0
    (a, _), (b, _) = load_checkpoint(src), load_checkpoint(str(tmp_path / "torch"))
    assert b.cfg.moe == a.cfg.moe and set(b.weights) == set(a.weights)
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)


def test_cli_saver_hf_refuses_deepseek_routing_in_one_line(tmp_path, capsys):
    """checkpoint_util from a Megatron-Core checkpoint of a DeepSeek-style router (sigmoid, groups, scaling)."""
    src = _model(moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
                 moe_router_topk_scaling_factor=2.5)
    save_checkpoint(src, str(tmp_path / "mc"), "mcore")
    assert tool("checkpoint_util").main(["--load-dir", str(tmp_path / "mc"), "--save-dir", str(tmp_path / "hf"),
                                         "--saver", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --saver hf cannot write this MoE model: its --moe-router-score-function sigmoid, "
                          "--moe-router-num-groups, --moe-router-topk-scaling-factor") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "hf")
