"""MoE checkpoints in ``--ckpt-format torch`` through the CLI (issue 42): saved at expert-parallel size 1, each
file (one per tensor and pipeline rank) holds every expert's stack whole, the global expert axis, with its 2BW,
master and optimizer state; a resume at the saving layout replays the uninterrupted run bitwise, and a resume at
EP = 2 (two data ranks, each taking its half of every stack) gives its losses within 1e-6, Adam and Muon. Saving
at EP > 1 in this format stays refused in one line (test_moe_config.py): data rank 0 writes, and it holds only
its own experts there."""

from __future__ import annotations

import os

import pytest
from multiproc import run_workers
from test_moe_checkpoint import EP2, FLUSH, _session
from test_moe_checkpoint import OPTIMIZERS as VARIANTS

OPTIMIZERS = {k: VARIANTS[k] for k in ("adam", "muon")}  # the expert bias is saved by torch_dist only
SAVE = ["--ckpt-format", "torch", "--save-interval", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("moe_torch_ckpt"))
    full = [(f"{o}-full", [*FLUSH, *f, *SAVE, "--save", os.path.join(root, o)]) for o, f in OPTIMIZERS.items()]
    (full,) = run_workers(_session, 1, full, root, timeout=600)
    for opt in OPTIMIZERS:  # resume from iteration 2: point the tracker back
        with open(os.path.join(root, opt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    same = [(f"{o}-same", [*FLUSH, *f, "--load", os.path.join(root, o)]) for o, f in OPTIMIZERS.items()]
    (same,) = run_workers(_session, 1, same, root, timeout=600)
    ep2 = [(f"{o}-ep2", [*EP2, *f, "--load", os.path.join(root, o)]) for o, f in OPTIMIZERS.items()]
    (ep2, _) = run_workers(_session, 2, ep2, root, timeout=600)
    return {"root": root, "full": dict(zip(OPTIMIZERS, full)), "same": dict(zip(OPTIMIZERS, same)),
            "ep2": dict(zip(OPTIMIZERS, ep2))}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_torch_format_resumes_bitwise_and_at_another_expert_layout(runs, opt):
    full, same, ep2 = runs["full"][opt], runs["same"][opt], runs["ep2"][opt]
    assert len(full) == 4 and len(same) == 2 and len(ep2) == 2, (full, same, ep2)
    assert same == full[2:], (same, full)  # the saving layout: bitwise
    print(f"{opt}: EP 2 resume vs uninterrupted max |loss diff| {max(abs(a - b) for a, b in zip(ep2, full[2:])):.2e}")
    assert max(abs(a - b) for a, b in zip(ep2, full[2:])) < 1e-6, (ep2, full)


def test_files_hold_every_expert(runs):
    """The (only) rank file holds each layer's whole stack [E, 2F, h] under the encoder's ``mlp.experts`` names."""
    import torch

    from megatron_2bw.checkpoint.megatron_format import read_rank_files

    sd = read_rank_files(os.path.join(runs["root"], "adam", "iter_0000002"))[(0, 0)]
    enc = sd["model"]["language_model"]["encoder"]
    fc1 = enc["layers.0.mlp.experts.linear_fc1"]
    assert fc1.shape[0] == 4 and fc1.dim() == 3 and "layers.0.mlp.router.weight" in enc
    assert sd["stage"]["optimizer"]["exp_avg"]["1.mlp.moe.experts.linear_fc1"].shape == fc1.shape
    assert not torch.equal(fc1[0], fc1[1])


def test_reshard_of_a_model_trained_at_ep2():
    """A checkpoint records the expert-parallel size it ran at; its global tensors (every expert) reshard to any
    t x d alike: the experts and router whole on every tensor rank, the attention split."""
    import torch

    from megatron_2bw.checkpoint.reshard import reshard, unshard
    from megatron_2bw.config.moe import MoEConfig
    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.export.model_io import build_full_model, global_state_dict

    cfg = get_preset("llama-tiny", num_layers=2, moe=MoEConfig(4, expert_model_parallel_size=2))
    full = global_state_dict(build_full_model(cfg))
    files = reshard(cfg, full, 2, 2)
    stack = full["1.mlp.moe.experts.linear_fc1"]
    assert stack.shape[0] == 4 and all(torch.equal(files[(tp, 0)]["1.mlp.moe.experts.linear_fc1"], stack)
                                       for tp in range(2))
    assert files[(1, 0)]["1.attn.qkv.weight"].shape[0] == full["1.attn.qkv.weight"].shape[0] // 2
    back = unshard(cfg, files)
    assert set(back) == set(full) and all(torch.equal(back[n], full[n]) for n in full)
