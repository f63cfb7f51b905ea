"""Megatron-Core (tests/mcore_reference.py) as the reference for its checkpoint format, both directions, GPT and
Llama (grouped-query attention, SwiGLU, RMSNorm, RoPE, untied output), at t = 1 and t = 2:

- ours -> Megatron-Core: ``checkpoint_util --saver mcore`` (``local`` names) loads into Megatron-Core's ``GPTModel``
  with no missing or unexpected key, each tensor rank its own shard; the ``transformer_engine`` names are exactly
  the keys of Megatron-Core's own ``sharded_state_dict`` (its key mapping of the local layers); logits equal ours;
- Megatron-Core -> ours: the checkpoint Megatron-Core's model writes (``state_dict_for_save_checkpoint`` with
  Megatron's args, torch format) loads through ``--loader mcore`` and gives Megatron-Core's logits.
All within 1e-4."""

from __future__ import annotations

import importlib.util
import os

import mcore_reference as mref
import pytest
import torch
import torch.distributed as dist
from export_helpers import gpt_logits, max_err, tiny
from multiproc import run_workers

from megatron_2bw.checkpoint.megatron_format import read_rank_files
from megatron_2bw.export.checkpoints import load_checkpoint, save_checkpoint
from megatron_2bw.export.model_io import build_full_model, load_full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4
KINDS = ("gpt", "llama")

pytestmark = pytest.mark.skipif(mref.available() is not None, reason=str(mref.available()))


def _checkpoint_util():
    spec = importlib.util.spec_from_file_location("checkpoint_util", os.path.join(ROOT, "tools", "checkpoint_util.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tokens(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(3))


def _ours_to_mcore(kind: str, t: int, root: str) -> dict:
    """``--saver mcore`` (local and transformer_engine names) into Megatron-Core's model on this tensor rank."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    ex, ours = tiny(kind)
    cfg, tokens = ex.cfg, _tokens(ex.cfg)
    src = os.path.join(root, f"{kind}_ours")
    if dist.get_rank() == 0:
        save_checkpoint(ex, src, "megatron")
        util = _checkpoint_util()
        for impl in ("local", "transformer_engine"):
            assert util.main(["--load-dir", src, "--save-dir", os.path.join(root, f"{kind}_{impl}"), "--saver", "mcore",
                              "--saver-transformer-impl", impl, "--target-tensor-parallel-size", str(t)]) == 0
    dist.barrier()
    model = mref.build(cfg, t, seed=1)
    local = read_rank_files(os.path.join(root, f"{kind}_local", "iter_0000011"))[(rank, 0)]["model"]
    missing, unexpected = model.load_state_dict(local, strict=False)
    err_local = max_err(mref.logits(model, tokens)[..., :cfg.vocab_size], gpt_logits(ours, tokens, cfg.vocab_size))
    te = read_rank_files(os.path.join(root, f"{kind}_transformer_engine", "iter_0000011"))[(rank, 0)]["model"]
    fresh = mref.build(cfg, t, seed=2)
    named = mref.te_named_tensors(fresh)
    te_tensors = {k: v for k, v in te.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for key, value in te_tensors.items():
            if key in named:
                named[key].copy_(value)
    err_te = max_err(mref.logits(fresh, tokens)[..., :cfg.vocab_size], gpt_logits(ours, tokens, cfg.vocab_size))
    return {"missing": sorted(missing), "unexpected": sorted(unexpected), "err_local": err_local,
            "te_only_ours": sorted(set(te_tensors) - set(named)), "te_only_mcore": sorted(set(named) - set(te_tensors)),
            "err_te": err_te}


def _mcore_to_ours(kind: str, t: int, root: str) -> dict:
    """Megatron-Core's own model and checkpoint; rank 0 loads it with ``--loader mcore``."""
    cfg = tiny(kind)[0].cfg
    model = mref.build(cfg, t, seed=5)
    mref.perturb(model)
    tokens = _tokens(cfg)
    theirs = mref.logits(model, tokens)
    path = os.path.join(root, f"{kind}_mcore")
    mref.save_torch_format(model, cfg, path, t, iteration=7)
    if dist.get_rank() != 0:
        return {}
    ex, _ = load_checkpoint(path, "mcore")
    ours = load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()
    vocab = cfg.padded_vocab_size(t)
    return {"iteration": ex.iteration, "err": max_err(gpt_logits(ours, tokens, vocab), theirs[..., :vocab]),
            "vocab": ex.cfg.vocab_size, "groups": ex.cfg.num_query_groups,
           "untied": ex.cfg.untie_embeddings_and_output_weights}


def _both_ways(root: str) -> dict:
    """On 2 processes: t = 1 (two data-parallel replicas) and t = 2, each kind both ways."""
    out = {}
    for t in (1, 2):
        mref.setup(t)
        path = os.path.join(root, f"t{t}")
        out[t] = {kind: (_ours_to_mcore(kind, t, path), _mcore_to_ours(kind, t, path)) for kind in KINDS}
    return out


def test_megatron_core_round_trips(tmp_path):
    results = run_workers(_both_ways, 2, str(tmp_path), timeout=300)
    for t in (1, 2):
        for kind in KINDS:
            for rank, res in enumerate(results):
                to_mcore = res[t][kind][0]
                print(f"t={t} {kind} rank {rank}: ours->mcore local {to_mcore['err_local']:.2e} "
                      f"transformer_engine {to_mcore['err_te']:.2e}")
                assert to_mcore["missing"] == [] and to_mcore["unexpected"] == [], to_mcore
                assert to_mcore["err_local"] < TOL
                assert to_mcore["te_only_ours"] == [] and to_mcore["te_only_mcore"] == [], to_mcore
                assert to_mcore["err_te"] < TOL
            back = results[0][t][kind][1]
            print(f"t={t} {kind}: mcore->ours {back['err']:.2e}")
            assert back["iteration"] == 7 and back["err"] < TOL, back
            if kind == "llama":
                assert back["groups"] == 2 and back["untied"]
