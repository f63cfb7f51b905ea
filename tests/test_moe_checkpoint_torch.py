"""MoE checkpoints in ``--ckpt-format torch`` through the CLI (issue 42): each file (one per tensor and pipeline
rank) holds every expert's stack whole, the global expert axis, with its 2BW, master and optimizer state, at any
expert-parallel size it was saved at. Saved at EP = 1: a resume at the saving layout replays the uninterrupted run
bitwise, and a resume at EP = 2 gives its losses within 1e-6, Adam and Muon. Saved at EP = 2 (data rank 0 gathers
the other expert pieces, and with the distributed optimizer their shards over the expert-data group): the same
file layout, resumed bitwise at EP = 2 and within 1e-6 at EP = 1 and 4 (Adam and Muon, with and without the
distributed optimizer, t = 1 and 2), bitwise the global tensors of the same run's torch_dist save, and read and
resharded by the offline tools as that save is."""

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


# Saved at EP = 2, --ckpt-step 2 resumes from the first of two saves (iterations 2 and 4). Per cell: its world,
# its flags. ``adam``: no distributed optimizer, every rank's state whole. ``muon-zero``: the dense state
# sharded over the two data ranks, the experts' not (their expert-data group is one rank). ``ef-zero-w4``: four
# data ranks, the experts' master (2BW's ef keeps one in fp32) and Adam state sharded over expert-data groups of
# two, 2BW's two weight versions. ``t2-zero``: two tensor ranks (each writes its file, gathering over its own
# expert group) of two data ranks, resumed at EP 1 on two processes. The two distributed cells at t = 1 also save
# in torch_dist (``-dist``), the reference for the gathered state: its global tensors are written by each rank at
# their offsets, no gather.
ZERO = ["--use-distributed-optimizer"]
EF = ["--pipeline-schedule", "2bw", "--2bw-compensation", "ef"]
T2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2_CELLS = {"adam": (2, []), "muon-zero": (2, [*OPTIMIZERS["muon"], *ZERO]), "ef-zero-w4": (4, [*EF, *ZERO]),
             "t2-zero": (4, [*T2, *ZERO])}
TWINS = ("muon-zero", "ef-zero-w4")
EP1 = ["--expert-model-parallel-size", "1"]
EP4 = ["--expert-model-parallel-size", "4", *EP2[2:]]
AT2 = ["--ckpt-step", "2"]


def _flags(extra: list[str]) -> list[str]:
    """``extra`` after the flush schedule (a later --pipeline-schedule wins)."""
    return [*FLUSH, *extra] if "--pipeline-schedule" not in extra else list(extra)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> dict:
    """Per cell: the uninterrupted EP = 2 run (saving at 2 and 4) and its resumes from iteration 2 at EP = 2
    (the saving layout), EP = 1 (one process; two for ``t2-zero``) and, for ``adam`` and ``ef-zero-w4``, EP = 4."""
    root = str(tmp_path_factory.mktemp("moe_torch_ep2"))
    ck = {c: os.path.join(root, c) for c in EP2_CELLS}
    saves: dict[int, list] = {2: [], 4: []}
    resumes: dict[int, list] = {1: [], 2: [], 4: []}
    for c, (world, f) in EP2_CELLS.items():
        saves[world] += [(f"{c}-full", [*EP2, *_flags(f), *SAVE, "--save", ck[c]]),
                         (f"{c}-same", [*EP2, *_flags(f), *AT2, "--load", ck[c]])]
        if c in TWINS:
            saves[world].append((f"{c}-dist", [*EP2, *_flags(f), *SAVE, "--ckpt-format", "torch_dist",
                                               "--save", f"{ck[c]}-dist"]))
        resumes[2 if "--tensor-model-parallel-size" in f else 1].append(
            (f"{c}-ep1", [*EP1, *_flags(f), *AT2, "--load", ck[c]]))
    resumes[4] += [(f"{c}-ep4", [*EP4, *_flags(f), *AT2, "--load", ck[c]])
                   for c, (world, f) in EP2_CELLS.items() if c in ("adam", "ef-zero-w4")]
    losses = {}
    for world, runs in ((2, saves[2]), (4, saves[4] + resumes[4]), (2, resumes[2]), (1, resumes[1])):
        got = run_workers(_session, world, runs, root, timeout=600)[0]
        losses.update({name: loss for (name, _), loss in zip(runs, got)})
    return {"root": root, "losses": losses}


@pytest.mark.parametrize("cell", list(EP2_CELLS))
def test_ep2_save_resumes_at_ep1_2_and_4(ep2, cell):
    got = ep2["losses"]
    full = got[f"{cell}-full"]
    assert len(full) == 4 and got[f"{cell}-same"] == full[2:], (cell, got)  # the saving layout: bitwise
    for other in ("ep1", "ep4"):
        resumed = got.get(f"{cell}-{other}")
        if resumed is None:
            continue
        diff = max(abs(a - b) for a, b in zip(resumed, full[2:]))
        print(f"{cell}: {other} resume of an EP 2 save vs uninterrupted max |loss diff| {diff:.2e}")
        assert len(resumed) == 2 and diff < 1e-6, (cell, other, resumed, full)


@pytest.mark.parametrize("cell", TWINS)
def test_ep2_file_holds_every_expert_as_torch_dist_does(ep2, cell):
    """Data rank 0's file holds each stack [4, 2F, h] whole, in the layout an EP = 1 save has, and every
    per-parameter state of it (the weights, 2BW's older version, ef's fp32 master, the Adam or Muon state)
    equals, bitwise, the global tensor the same run's torch_dist save holds under that name: the experts of
    piece 1 gathered from data rank 1 (and from their shards over the expert-data group), in expert order."""
    import torch

    from megatron_2bw.checkpoint.compat import model_config
    from megatron_2bw.checkpoint.dist_checkpoint.reader import read_whole
    from megatron_2bw.checkpoint.megatron_format import read_rank_files
    from megatron_2bw.checkpoint.trainer_format import newest_weights

    sd = read_rank_files(os.path.join(ep2["root"], cell, "iter_0000002"))[(0, 0)]
    _, families = read_whole(os.path.join(ep2["root"], f"{cell}-dist", "iter_0000002"))
    st = sd["stage"]
    mine = {"model": newest_weights(sd, model_config(sd["config"])), "older": st["older"], "master": st["master"],
            **{f"optimizer.{k}": v for k, v in st["optimizer"].items() if isinstance(v, dict)}}
    mine = {k: v for k, v in mine.items() if v is not None}
    want = {"model", "older", "master"} if cell == "ef-zero-w4" else {"model"}
    assert set(families) == set(mine) and want < set(mine), (set(families), set(mine))  # and optimizer state
    name = "1.mlp.moe.experts.linear_fc1"
    assert sd["model"]["language_model"]["encoder"]["layers.0.mlp.experts.linear_fc1"].shape[0] == 4
    for family, ref in families.items():  # torch_dist stores a stack as [E, out * in]
        assert set(ref) == set(mine[family]) and mine[family][name].shape[0] == ref[name].shape[0] == 4, family
        bad = [n for n, t in ref.items() if not torch.equal(mine[family][n].reshape(t.shape), t)]
        assert not bad, (family, bad)


def test_ep2_file_reads_and_reshards_as_torch_dist_does(ep2, tmp_path):
    """The offline readers take the EP = 2 torch checkpoint as its torch_dist twin: the export's reader gives the
    same model, bitwise, and tools/checkpoint_util.py reshards both to t = 2 (torch files, with the optimizer
    state) into the same files."""
    import torch
    from test_offline_tools import tool

    from megatron_2bw.checkpoint.megatron_format import read_rank_files
    from megatron_2bw.export.checkpoints import load_checkpoint

    mine, dist = (os.path.join(ep2["root"], c) for c in ("muon-zero", "muon-zero-dist"))
    (a, a_opt), (b, b_opt) = load_checkpoint(mine), load_checkpoint(dist)
    assert a.iteration == b.iteration == 4 and a_opt and b_opt and a.cfg == b.cfg
    assert set(a.weights) == set(b.weights) and all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
    util, out = tool("checkpoint_util"), {}
    for name, src in (("torch", mine), ("dist", dist)):
        dst = str(tmp_path / name)
        assert util.main(["--load-dir", src, "--save-dir", dst, "--target-tensor-parallel-size", "2"]) == 0
        out[name] = read_rank_files(os.path.join(dst, "iter_0000004"))
    assert set(out["torch"]) == set(out["dist"]) == {(0, 0), (1, 0)}
    for key, f in out["torch"].items():
        named = _per_name(f["stage"])
        ref = _per_name(out["dist"][key]["stage"])
        assert set(named) == set(ref) and "optimizer.exp_avg" in named, (set(named), set(ref))
        for state, by_name in ref.items():
            assert set(by_name) == set(named[state]) and all(torch.equal(named[state][n], t)
                                                             for n, t in by_name.items()), (key, state)
        assert named["optimizer.exp_avg"]["1.mlp.moe.experts.linear_fc1"].shape[0] == 4
        assert torch.equal(f["model"]["language_model"]["encoder"]["layers.0.mlp.experts.linear_fc1"],
                           out["dist"][key]["model"]["language_model"]["encoder"]["layers.0.mlp.experts.linear_fc1"])


def _per_name(stage: dict) -> dict[str, dict]:
    """A file's per-parameter states (2BW's older version, the master, each optimizer state) by name."""
    out = {k: v for k, v in stage.items() if k in ("older", "master") and v is not None}
    out.update({f"optimizer.{k}": v for k, v in stage["optimizer"].items() if isinstance(v, dict)})
    return out


def test_the_updater_leaves_the_expert_segment_to_the_expert_gather():
    """At an EP > 1 torch-format save the expert segment's master and optimizer state are gathered once, by the
    expert gather: the updater's ``state_dict(skip=...)`` neither gathers nor copies that segment (its range
    stays zeros for the gather to fill) and places every other segment as before."""
    from types import SimpleNamespace

    import torch

    from megatron_2bw.pipeline.updater import Updater

    class Part:
        def __init__(self, start: int, values: torch.Tensor):
            self.seg, self.values, self.calls = SimpleNamespace(of=lambda t: t[start:start + len(values)]), values, 0

        def full(self, everywhere: bool, copy: bool) -> dict:
            self.calls += 1
            return {"master": self.values.clone(), "optimizer.exp_avg": 2 * self.values}

    dense, experts = Part(0, torch.arange(1.0, 5.0)), Part(6, torch.arange(10.0, 13.0))
    up = Updater.__new__(Updater)
    up.reducer, up.parts, up.weights = None, [dense, experts], SimpleNamespace(numel=9)
    up.scaler, up.state_scalars = SimpleNamespace(state_dict=dict), dict
    sd = up.state_dict(everywhere=False, copy=False, skip=frozenset({1}))
    assert experts.calls == 0 and dense.calls == 1
    assert sd["master"].tolist() == [1, 2, 3, 4, 0, 0, 0, 0, 0]
    assert sd["optimizer"]["exp_avg"].tolist() == [2, 4, 6, 8, 0, 0, 0, 0, 0]
    assert up.state_dict()["master"].tolist() == [1, 2, 3, 4, 0, 0, 10, 11, 12] and experts.calls == 1
