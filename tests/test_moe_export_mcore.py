"""Megatron-Core checkpoints of MoE GPTs (issue 42), with megatron-core 0.16.1 itself as the reference
(tests/mcore_reference.py: its ``GPTModel`` built with its MoE local spec, ``get_gpt_layer_local_spec(num_experts=4,
moe_grouped_gemm=False)``, run on the CPU in a worker process):

- ours -> Megatron-Core: ``--saver mcore`` (local names) loads with no missing or unexpected key, logits within
  1e-5 of ours: a Qwen2-MoE-like model (softmax top-2, shared expert with its gate) and a DeepSeek-like router
  (sigmoid scores, group-limited top-k, scaling factor);
- Megatron-Core -> ours: the model's own ``state_dict_for_save_checkpoint`` with Megatron's args (its MoE flags
  among them) through ``--loader mcore`` gives its logits within 1e-5, and through checkpoint_util on to
  ``--saver hf`` (Qwen2MoeForCausalLM) and back with ``--loader hf --saver mcore``, Megatron-Core's tensors again.
At t = 2 (two processes, Megatron-Core's tensor group with experts whole on every tensor rank, expert tensor
parallel size 1): the shared experts are split as Megatron-Core splits them (``linear_fc1`` column-parallel, its
[gate; up] rows per rank; ``linear_fc2`` row-parallel; the gate whole), both ways, logits within 1e-5.
The Transformer Engine names round-trip exactly (no Transformer Engine here to load them into)."""

from __future__ import annotations

import os

import mcore_reference as mref
import pytest
import torch
from export_helpers import gpt_logits, max_err, tiny
from multiproc import run_workers
from test_offline_tools import tool

from megatron_2bw.checkpoint.megatron_format import read_rank_files
from megatron_2bw.config.moe import MoEConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.checkpoints import load_checkpoint, save_checkpoint
from megatron_2bw.export.model_io import build_full_model, load_full

pytestmark = pytest.mark.skipif(mref.available() is not None, reason=str(mref.available()))

TOL = 1e-5
CASES = {
    "shared-gate": MoEConfig(4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_shared_expert_intermediate_size=48,
                             moe_shared_expert_gate=True),
    "sigmoid-groups": MoEConfig(4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_router_score_function="sigmoid",
                                moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5),
}
EXPERT_KEYS = [f"mlp.experts.local_experts.{k}.linear_fc{j}.weight" for k in range(4) for j in (1, 2)]


def _model(name: str):
    return tiny("llama", num_layers=2, moe=CASES[name])


def _tokens(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(3))


def _ours_to_mcore(name: str, root: str) -> dict:
    ex, ours = _model(name)
    cfg, tokens = ex.cfg, _tokens(ex.cfg)
    path = os.path.join(root, f"{name}_ours")
    save_checkpoint(ex, path, "mcore", transformer_impl="local")
    state = read_rank_files(os.path.join(path, "iter_0000011"))[(0, 0)]["model"]
    model = mref.build(cfg, 1, seed=1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    theirs = mref.logits(model, tokens)[..., :cfg.vocab_size]
    return {"missing": sorted(missing), "unexpected": sorted(unexpected), "keys": sorted(state),
            "err": max_err(theirs, gpt_logits(ours, tokens, cfg.vocab_size))}


def _mcore_to_ours(name: str, root: str) -> dict:
    cfg = _model(name)[0].cfg
    model = mref.build(cfg, 1, seed=5)
    mref.perturb(model)
    tokens = _tokens(cfg)
    theirs = mref.logits(model, tokens)[..., :cfg.vocab_size]
    path = os.path.join(root, f"{name}_mcore")
    mref.save_torch_format(model, cfg, path, 1, iteration=7)
    ex, _ = load_checkpoint(path, "mcore")
    ours = load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()
    out = {"err": max_err(gpt_logits(ours, tokens, cfg.vocab_size), theirs), "moe": ex.cfg.moe}
    if name == "shared-gate":  # on through checkpoint_util: Megatron-Core -> Qwen2MoeForCausalLM -> Megatron-Core
        from transformers import AutoModelForCausalLM

        util, hf, again = tool("checkpoint_util"), os.path.join(root, "hf"), os.path.join(root, "again")
        out["to_hf"] = util.main(["--loader", "mcore", "--load-dir", path, "--save-dir", hf, "--saver", "hf"])
        with torch.no_grad():
            hf_logits = AutoModelForCausalLM.from_pretrained(hf).eval()(tokens).logits
        out["hf_err"] = max_err(hf_logits[..., :cfg.vocab_size], theirs)  # Megatron's args: the padded vocabulary
        out["back"] = util.main(["--loader", "hf", "--load-dir", hf, "--save-dir", again, "--saver", "mcore",
                                 "--saver-transformer-impl", "local"])
        mine = read_rank_files(os.path.join(again, "iter_0000000"))[(0, 0)]["model"]
        saved = {k: v for k, v in model.state_dict_for_save_checkpoint().items() if isinstance(v, torch.Tensor)}
        out["differ"] = sorted(k for k, v in saved.items() if k in mine and not torch.equal(mine[k], v))
        out["lacks"] = sorted(set(saved) - set(mine))
    return out


def _both_ways(root: str) -> dict:
    mref.setup(1)
    return {name: (_ours_to_mcore(name, root), _mcore_to_ours(name, root)) for name in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    (res,) = run_workers(_both_ways, 1, str(tmp_path_factory.mktemp("moe_mcore")), timeout=300)
    return res


@pytest.mark.parametrize("name", list(CASES))
def test_ours_load_into_megatron_core(results, name):
    to_mcore = results[name][0]
    print(f"{name}: ours -> mcore max |logit diff| {to_mcore['err']:.2e}")
    assert to_mcore["missing"] == [] and to_mcore["unexpected"] == [], to_mcore
    assert {f"decoder.layers.{i}.{k}" for i in range(2) for k in EXPERT_KEYS} <= set(to_mcore["keys"])
    assert to_mcore["err"] < TOL


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_core_state_dict_through_loader_mcore(results, name):
    back = results[name][1]
    print(f"{name}: mcore -> ours max |logit diff| {back['err']:.2e}")
    assert back["err"] < TOL
    assert back["moe"].num_experts == 4 and back["moe"] == CASES[name], back["moe"]
    if name == "shared-gate":
        print(f"mcore -> HF max |logit diff| {back['hf_err']:.2e}")
        assert back["to_hf"] == 0 and back["back"] == 0 and back["hf_err"] < TOL
        assert back["differ"] == [] and back["lacks"] == [], back


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_round_trip_is_exact(tmp_path, impl):
    ex, model = _model("shared-gate")
    save_checkpoint(ex, str(tmp_path), "mcore", transformer_impl=impl)
    state = read_rank_files(str(tmp_path / "iter_0000011"))[(0, 0)]["model"]
    norm = "decoder.layers.1.pre_mlp_layernorm.weight"  # an MoE layer's, under either impl
    assert norm in state and torch.equal(state[norm], ex.weights["2.ln2.weight"])
    stack = ex.weights["2.mlp.moe.experts.linear_fc1"]
    assert all(torch.equal(state[f"decoder.layers.1.mlp.experts.local_experts.{k}.linear_fc1.weight"], stack[k])
               for k in range(4))
    back, _ = load_checkpoint(str(tmp_path))
    assert back.cfg == ex.cfg and set(back.weights) == set(ex.weights)
    assert all(torch.equal(back.weights[n], ex.weights[n]) for n in ex.weights)


def test_refusals_are_one_line(tmp_path):
    ex, _ = tiny("llama", num_layers=2, moe=MoEConfig(4, moe_router_score_function="sigmoid",
                                                      moe_router_enable_expert_bias=True))
    with pytest.raises(ConfigError, match="--moe-router-enable-expert-bias state is not part of the exported"):
        save_checkpoint(ex, str(tmp_path / "a"), "mcore")


SHARED = "decoder.layers.1.mlp.shared_experts."


def _at_t2(root: str) -> dict:
    """On two processes at t = 2: each tensor rank's file of our export into its rank of Megatron-Core's model, and
    Megatron-Core's own files back through ``--loader mcore`` (rank 0)."""
    import torch.distributed as dist

    mref.setup(2, expert_tensor=1)
    rank = dist.get_rank()
    ex, ours = _model("shared-gate")
    cfg, tokens = ex.cfg, _tokens(ex.cfg)
    path, theirs_path = os.path.join(root, "t2_ours"), os.path.join(root, "t2_mcore")
    if rank == 0:
        save_checkpoint(ex, path, "mcore", t=2, transformer_impl="local")
    dist.barrier()
    state = read_rank_files(os.path.join(path, "iter_0000011"))[(rank, 0)]["model"]
    model = mref.build(cfg, 2, seed=1)
    missing, unexpected = model.load_state_dict(state, strict=False)
    out = {"missing": sorted(missing), "unexpected": sorted(unexpected),
           "err": max_err(mref.logits(model, tokens)[..., :cfg.vocab_size], gpt_logits(ours, tokens, cfg.vocab_size)),
           "shared": {k[len(SHARED):]: state[k] for k in state if k.startswith(SHARED)}, "whole": ex.weights}
    theirs = mref.build(cfg, 2, seed=5)
    mref.perturb(theirs)
    their_logits = mref.logits(theirs, tokens)[..., :cfg.vocab_size]
    mref.save_torch_format(theirs, cfg, theirs_path, 2, iteration=7)
    if rank == 0:
        back, _ = load_checkpoint(theirs_path, "mcore")
        mine = load_full(build_full_model(back.cfg), back.cfg, back.weights).eval()
        out["back_err"] = max_err(gpt_logits(mine, tokens, cfg.vocab_size), their_logits)
        again, _ = load_checkpoint(path)
        out["round_trip"] = sorted(n for n in ex.weights if not torch.equal(again.weights[n], ex.weights[n]))
    return out


def test_shared_experts_at_two_tensor_ranks(tmp_path):
    ranks = run_workers(_at_t2, 2, str(tmp_path), timeout=300)
    whole = ranks[0]["whole"]
    fc1, fc2, gate = (whole[f"2.mlp.moe.shared_experts.{n}"] for n in ("linear_fc1.weight", "linear_fc2.weight",
                                                                       "gate_weight"))
    (gate_rows, up_rows), f = fc1.chunk(2, 0), fc2.shape[1]  # SwiGLU: [gate; up], F = 48 each
    for r, res in enumerate(ranks):
        print(f"t=2 rank {r}: ours -> mcore max |logit diff| {res['err']:.2e}")
        assert res["missing"] == [] and res["unexpected"] == [] and res["err"] < TOL, res
        shared = res["shared"]  # by hand: this rank's half of the gate rows, then of the up rows; half the columns
        assert torch.equal(shared["linear_fc1.weight"], torch.cat([gate_rows[r * f // 2:(r + 1) * f // 2],
                                                                   up_rows[r * f // 2:(r + 1) * f // 2]]))
        assert torch.equal(shared["linear_fc2.weight"], fc2[:, r * f // 2:(r + 1) * f // 2])
        assert torch.equal(shared["gate_weight"], gate)
    print(f"t=2: mcore -> ours max |logit diff| {ranks[0]['back_err']:.2e}")
    assert ranks[0]["back_err"] < TOL and ranks[0]["round_trip"] == [], ranks[0]
