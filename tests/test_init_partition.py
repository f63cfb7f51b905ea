"""Initialization on the meta device, materialized straight into the flat buffers (tensor_parallel/init.py).

Two paths: ``--use-cpu-initialization`` (every full weight drawn on the CPU from (seed, name) and
split: the same model at every layout) and the default per-partition path (each rank draws only
its own shards, on its device). Checked: a rank's peak memory while its stage is built follows its
own parameters, not the model's (a child process per build, its peak RSS reset before); the CPU
path's t = 2 shards are the t = 1 weights split, bitwise (the same draws, sliced); the
per-partition path draws no full matrix, is bitwise the same on a rerun, and has the right
statistics per init method (N(0, std^2), the output projections std / sqrt(2 L), zero biases and
vocabulary padding).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.pipeline.weights import RankWeights
from megatron_2bw.tensor_parallel import init
from megatron_2bw.tensor_parallel.group import TPGroup

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_harness import matching_shard  # noqa: E402

CPU = torch.device("cpu")


def _cfg(kind: str = "gpt", layers: int = 2, h: int = 64) -> ModelConfig:
    return ModelConfig(kind=kind, num_layers=layers, hidden_size=h, num_attention_heads=4, vocab_size=300,
                       seq_length=16, max_position_embeddings=32)


def _stage(cfg: ModelConfig, *, t: int = 1, tp: int = 0, d: int = 1, r: int = 0, cpu_init: bool,
           versions: int = 2) -> RankWeights:
    spec = ModelSpec(cfg, ModelGroups(TPGroup(None, tp, t)), seed=1234)
    return RankWeights(lambda: spec.build_stage(d, r), num_versions=versions, dtype=torch.float32, device=CPU,
                        tp_rank=tp, cpu_init=cpu_init)


def _named(w: RankWeights) -> dict[str, torch.Tensor]:
    return w.state_views(w.flat[0])


# --------------------------------------------------------------------------- peak memory follows the partition
def _child(d: int, r: int) -> None:
    """Build stage r of d (per partition) and print its parameters and the peak RSS the build added."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    cfg = ModelConfig(kind="gpt", num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=512,
                      seq_length=32, max_position_embeddings=32)
    spec = ModelSpec(cfg, ModelGroups(), seed=1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
    before = status("VmRSS")
    w = RankWeights(lambda: spec.build_stage(d, r), num_versions=2, dtype=torch.float32, device=CPU, cpu_init=False)
    print(json.dumps({"numel": w.numel, "peak_added": status("VmHWM") - before,
                      "buffers": w.weight_bytes + w.grad_bytes}))


def _build_in_child(d: int, r: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, __file__, str(d), str(r)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_a_rank_allocates_its_own_stage_only():
    whole, quarter = _build_in_child(1, 0), _build_in_child(4, 1)
    # the model has 6.5M parameters; a middle stage of d = 4 holds two of the eight layers
    assert quarter["numel"] / whole["numel"] == pytest.approx(0.23, abs=0.03)
    for run in (whole, quarter):  # two weight versions and two gradient buffers, nothing more (no module copy)
        assert run["peak_added"] < 1.15 * run["buffers"] + 8 * 2**20, run
    assert quarter["peak_added"] / whole["peak_added"] < 0.35, (quarter, whole)


# --------------------------------------------------------------------------- the CPU path: the same model at every t
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_cpu_initialization_shards_are_the_t1_weights_split(kind):
    cfg = _cfg(kind)
    dense = _named(_stage(cfg, cpu_init=True, versions=1))
    for tp in range(2):
        w = _stage(cfg, t=2, tp=tp, cpu_init=True)
        for name, local in _named(w).items():
            assert torch.equal(local, matching_shard(dense[name], local, tp, 2)), name
        assert torch.equal(w.flat[0], w.flat[1])  # both 2BW versions start equal


def test_both_paths_agree_at_t1_and_differ_at_t2():
    """At t = 1 a shard is the whole tensor, drawn from the CPU path's stream: the same bits on the CPU."""
    cfg = _cfg()
    assert torch.equal(_stage(cfg, cpu_init=True).flat[0], _stage(cfg, cpu_init=False).flat[0])
    a, b = _stage(cfg, t=2, cpu_init=True).flat[0], _stage(cfg, t=2, cpu_init=False).flat[0]
    assert not torch.equal(a, b)


# --------------------------------------------------------------------------- the per-partition path
def test_per_partition_draws_no_full_matrix(monkeypatch):
    cfg = _cfg()
    drawn = []
    monkeypatch.setattr(init, "normal_full", lambda shape, *a, **k: drawn.append(shape) or torch.zeros(shape))
    _stage(cfg, t=2, tp=1, cpu_init=False)
    assert drawn == []
    _stage(cfg, t=2, tp=1, cpu_init=True)  # the CPU path: full matrices, e.g. the (3h, h) QKV weight
    assert (3 * 64, 64) in drawn


@pytest.mark.parametrize("norm, seq_par", [("LayerNorm", False), ("RMSNorm", False), ("LayerNorm", True)])
def test_every_parameter_is_deferred_norms_included(norm, seq_par):
    """Inside ``init.deferred()`` no parameter is made on the host (the norms' ones and zeros were), and
    once the stage is built they are ones and zeros on both paths, as the modules make them."""
    from dataclasses import replace

    from torch import nn

    cfg = replace(_cfg(), normalization=norm, sequence_parallel=seq_par)
    spec = ModelSpec(cfg, ModelGroups(TPGroup(None, 0, 2)), seed=1234)
    with init.deferred():
        mods = nn.ModuleList(spec.build_stage(1, 0))
    assert [n for n, p in mods.named_parameters() if not p.is_meta] == []
    eager = nn.ModuleList(spec.build_stage(1, 0))  # outside deferred(): the modules' own values
    norms = {n: p for n, p in eager.named_parameters() if "ln" in n}
    assert norms and all(torch.equal(p, torch.ones_like(p) if n.endswith("weight") else torch.zeros_like(p))
                         for n, p in norms.items())
    for cpu_init in (True, False):
        w = _stage(cfg, t=2, cpu_init=cpu_init)
        built = dict(zip(w.names, w.state_views(w.flat[1]).values()))  # by module name; the second version too
        for n, p in norms.items():
            assert torch.equal(built[n], p), (n, cpu_init)


def test_per_partition_is_deterministic_and_distributed_as_initialized():
    cfg = _cfg(layers=4, h=128)
    shards = [_stage(cfg, t=2, tp=tp, cpu_init=False) for tp in range(2)]
    again = _stage(cfg, t=2, tp=1, cpu_init=False)
    assert torch.equal(again.flat[0], shards[1].flat[0]) and torch.equal(again.flat[1], shards[1].flat[0])
    std, out_std = cfg.init_method_std, cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    a, b = _named(shards[0]), _named(shards[1])
    vocab_rows = cfg.padded_vocab_size(2) // 2
    checked = 0
    for name, x in a.items():
        if name.endswith("bias"):
            assert not x.any() and not b[name].any(), name
            continue
        if x.dim() < 2:  # norm weights: ones
            continue
        if "word" in name:  # rank 0 holds rows 0..vocab/2-1 (all real); rank 1 the rest, padding zero
            assert not b[name][cfg.vocab_size - vocab_rows:].any()
            x = x[:cfg.vocab_size]
        want = out_std if name.endswith(("proj.weight", "fc2.weight")) else std
        n = x.numel()
        # the sample std of n normal draws is within 5 standard errors (std / sqrt(2n)) of the truth
        assert abs(float(x.std()) - want) < 5 * want / math.sqrt(2 * n), (name, float(x.std()), want)
        assert abs(float(x.mean())) < 5 * want / math.sqrt(n), name
        split = "position" not in name
        assert torch.equal(x, b[name][:x.shape[0]]) != split, name  # shards differ; replicated tensors agree
        checked += 1
    assert checked == 2 + 4 * cfg.num_layers  # word, position; qkv, proj, fc1, fc2 per layer


def test_the_flag_chooses_the_path_and_reaches_the_stage():
    from megatron_2bw.cli import build_config, parse_args

    argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--device", "cpu"]
    assert build_config(parse_args(argv, "gpt"), "gpt", 1).system.use_cpu_initialization is False  # Megatron's default
    assert build_config(parse_args([*argv, "--use-cpu-initialization"], "gpt"), "gpt", 1).system.use_cpu_initialization


if __name__ == "__main__":  # the child of test_a_rank_allocates_its_own_stage_only
    _child(int(sys.argv[1]), int(sys.argv[2]))
