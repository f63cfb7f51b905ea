"""Interleaved runs' checkpoints: ``pretrain_gpt.py --pipeline-schedule interleaved-1f1b`` with Megatron's virtual
pipeline flags saves Megatron's ``model0``/``model1`` keys per rank, resumes bitwise, converts to and from a
non-interleaved layout with tools/checkpoint_util.py (optimizer state included: the global layer order is the
same), and its torch_dist checkpoint holds the same global tensors as its torch-format one."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch
from e2e import REPO, read_metrics, torchrun, train_losses

from megatron_2bw.checkpoint.trainer_reshard import read_dist_checkpoint, read_trainer_checkpoint
from megatron_2bw.export.checkpoints import load_checkpoint

TOOL = os.path.join(REPO, "tools", "checkpoint_util.py")
# 4 layers on d = 2 ranks, one layer per virtual stage: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
ARGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 6 --lr 1e-3 --log-interval 1 --eval-interval 1000 --eval-iters 0 "
        "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 100 --make-vocab-size-divisible-by 8 "
        "--pipeline-model-parallel-size 2 --pipeline-schedule interleaved-1f1b "
        "--num-layers-per-virtual-pipeline-stage 1 --save-interval 3").split()


def _train(tmp, name: str, *extra: str):
    save, metrics = str(tmp / name), str(tmp / f"{name}.jsonl")
    res = torchrun("pretrain_gpt.py", [*ARGS, "--save", save, "--metrics-file", metrics,
                                       "--data-cache-path", str(tmp / "cache"), *extra], nproc=2)
    assert res.returncode == 0, res.describe()
    return save, train_losses(read_metrics(metrics))


def _util(*args: str) -> None:
    """tools/checkpoint_util.py in this process (no interpreter start per conversion)."""
    spec = importlib.util.spec_from_file_location("checkpoint_util", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.run(list(args))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interleaved")
    save, losses = _train(tmp, "straight")
    return tmp, save, losses


def _same_families(a, b) -> None:
    assert set(a.families) == set(b.families)
    for fam in a.families:
        assert set(a.families[fam]) == set(b.families[fam]), fam
        for n, v in a.families[fam].items():
            assert torch.equal(v, b.families[fam][n]), (fam, n)


def test_saves_model0_model1_and_resumes_bitwise(straight):
    tmp, save, losses = straight
    sd = torch.load(os.path.join(save, "iter_0000006", "mp_rank_00_001", "model_optim_rng.pt"), weights_only=False)
    assert "model" not in sd and {"model0", "model1"} <= set(sd)
    assert sd["args"].virtual_pipeline_model_parallel_size == 2 and sd["layout"]["chunks"] == 2
    # Megatron's chunk-local layer numbers; the last virtual stage holds the final norm and the tied copy
    assert "layers.0.input_layernorm.weight" in sd["model0"]["language_model"]["encoder"]
    assert "final_layernorm.weight" in sd["model1"]["language_model"]["encoder"]
    assert "word_embeddings_for_head" in sd["model1"] and "word_embeddings_for_head" not in sd["model0"]
    resume = tmp / "resume"
    os.makedirs(resume)
    shutil.copytree(os.path.join(save, "iter_0000003"), resume / "iter_0000003")
    (resume / "latest_checkpointed_iteration.txt").write_text("3\n")
    _, again = _train(tmp, "resume", "--load", str(resume))
    assert sorted(again) == sorted(losses)[3:]  # the steps after the checkpoint
    assert all(again[i] == losses[i] for i in again), (again, losses)


def test_checkpoint_util_converts_to_and_from_one_chunk(straight):
    tmp, save, _ = straight
    flat, back, one = str(tmp / "flush_d2"), str(tmp / "back"), str(tmp / "d1")
    _util("--load-dir", save, "--save-dir", flat, "--target-pipeline-parallel-size", "2", "--target-schedule", "flush")
    _util("--load-dir", flat, "--save-dir", back, "--target-pipeline-parallel-size", "2",
          "--target-schedule", "interleaved-1f1b", "--target-virtual-pipeline-parallel-size", "2")
    _util("--load-dir", save, "--save-dir", one, "--target-schedule", "flush")
    src = read_trainer_checkpoint(save)
    for path in (flat, back, one):
        _same_families(src, read_trainer_checkpoint(path))  # weights, Adam moments: every tensor moved bitwise
    sd = torch.load(os.path.join(flat, "iter_0000006", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
    assert "model" in sd and "model0" not in sd and "chunks" not in sd["layout"]
    sd = torch.load(os.path.join(back, "iter_0000006", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
    assert {"model0", "model1"} <= set(sd) and sd["layout"]["chunks"] == 2
    ex, _ = load_checkpoint(save)
    assert all(torch.equal(v, src.families["model"][n].float()) for n, v in ex.weights.items())
    # weights only (the Megatron saver) also writes and reads model0/model1
    weights = str(tmp / "weights_il")
    _util("--load-dir", save, "--save-dir", weights, "--no-optimizer", "--target-pipeline-parallel-size", "2",
          "--target-schedule", "interleaved-1f1b")
    ex2, _ = load_checkpoint(weights)
    assert all(torch.equal(v, ex.weights[n]) for n, v in ex2.weights.items())


def test_a_one_chunk_run_refuses_an_interleaved_checkpoint_in_one_line(straight):
    tmp, save, _ = straight
    i = ARGS.index("--num-layers-per-virtual-pipeline-stage")
    args = [a if a != "interleaved-1f1b" else "flush" for a in ARGS[:i] + ARGS[i + 2:]]
    res = torchrun("pretrain_gpt.py", [*args, "--load", save, "--no-load-optim",
                                       "--data-cache-path", str(tmp / "cache"), "--save", str(tmp / "refused")],
                   nproc=2, real=True)
    assert res.returncode != 0
    assert "holds 2 model chunk(s) per pipeline rank but this run uses 1" in res.output, res.describe()


def test_torch_dist_holds_the_same_global_tensors(straight):
    tmp, save, losses = straight
    dist_save, dist_losses = _train(tmp, "dist", "--ckpt-format", "torch_dist")
    assert dist_losses == losses
    _same_families(read_trainer_checkpoint(save), read_dist_checkpoint(dist_save))


_V = ARGS.index("--num-layers-per-virtual-pipeline-stage")
ZBV = [a if a != "interleaved-1f1b" else "zb-v" for a in ARGS[:_V] + ARGS[_V + 2:]]  # its 2 chunks are fixed


def test_config_refusals_are_one_line():
    from megatron_2bw.cli import build_config, parse_args
    from megatron_2bw.errors import ConfigError

    def refused(argv, pattern):
        with pytest.raises(ConfigError, match=pattern) as info:
            build_config(parse_args(argv, "gpt"), "gpt", 2)
        assert "\n" not in str(info.value)

    refused([*ZBV, "--save", "x"], r"--ckpt-format torch cannot hold zb-v's V layout yet")
    refused([*ARGS, "--virtual-pipeline-model-parallel-size", "2"], r"mutually exclusive")
    refused([*ARGS[:ARGS.index("--num-layers-per-virtual-pipeline-stage") + 1], "3",
             *ARGS[ARGS.index("--num-layers-per-virtual-pipeline-stage") + 2:]], r"must divide the 2 layers")
    flush = [a if a != "interleaved-1f1b" else "flush" for a in ARGS]
    refused(flush, r"needs --pipeline-schedule interleaved-1f1b")
    assert build_config(parse_args([*ARGS, "--save", "x"], "gpt"), "gpt", 2).pipeline.chunks == 2


def test_zbv_trains_end_to_end_and_resumes_bitwise_from_torch_dist(tmp_path):
    save, metrics = str(tmp_path / "zbv"), str(tmp_path / "zbv.jsonl")
    common = [*ZBV, "--ckpt-format", "torch_dist", "--data-cache-path", str(tmp_path / "cache")]
    res = torchrun("pretrain_gpt.py", [*common, "--save", save, "--metrics-file", metrics], nproc=2)
    assert res.returncode == 0, res.describe()
    losses = train_losses(read_metrics(metrics))
    assert losses[max(losses)] < losses[0]  # it learns
    resume = tmp_path / "resume"
    os.makedirs(resume)
    shutil.copytree(os.path.join(save, "iter_0000003"), resume / "iter_0000003")
    (resume / "latest_checkpointed_iteration.txt").write_text("3\n")
    res = torchrun("pretrain_gpt.py", [*common, "--load", str(resume), "--save", str(resume),
                                       "--metrics-file", str(tmp_path / "again.jsonl")], nproc=2)
    assert res.returncode == 0, res.describe()
    again = train_losses(read_metrics(str(tmp_path / "again.jsonl")))
    assert sorted(again) == sorted(losses)[3:] and all(again[i] == losses[i] for i in again), (again, losses)
