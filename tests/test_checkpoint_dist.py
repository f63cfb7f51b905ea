"""``--ckpt-format torch_dist`` (issue 21): DCP checkpoints written by every rank, resumed at the same
layout bitwise, at another t, d, w or without the distributed optimizer with the same losses as
resharding offline with tools/checkpoint_util.py and resuming; a corrupted shard refused in one line;
a killed asynchronous save leaves the previous checkpoint the newest.

One save run (t=2 d=2 w=2: 8 processes, 2BW, bf16, the distributed optimizer, 3 steps, saves at 2
and 3) is shared; each resume runs the one remaining step. The loaded state is the same on both
paths, so the losses agree to the last bit; the comparison allows 1e-6.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from ckpt_runs import DATA, _ckpt_data, gpt_args, one_rank_run, train  # noqa: F401
from e2e import PY, REPO, once, read_metrics, run, train_losses
from multiproc import run_workers

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint import dist_checkpoint as dc
from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.faults import SAVE_FAULT_ENV
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import build_state, coords_of
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.executor import PipelineRank
from megatron_2bw.pipeline.weights import GlobalNames
from megatron_2bw.tensor_parallel.random import RNGTracker

TOOL = os.path.join(REPO, "tools", "checkpoint_util.py")
START, END = 2, 3
DIST = ("--ckpt-format", "torch_dist")
ZERO = ("--use-distributed-optimizer",)
TOL = 1e-6


def _args(*, t: int, d: int, iters: int = END, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--model-preset", "gpt-tiny", "--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
            str(d), "--pipeline-schedule", "2bw", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", str(iters), "--lr", "1e-2", "--lr-decay-style", "constant", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--device", "cpu", "--bf16", *DATA, *extra]


def _launch(args: list[str], nproc: int, metrics: str, timeout: float = 420):
    res = train([*args, "--metrics-file", metrics], nproc=nproc, timeout=timeout)
    assert res.returncode == 0, res.describe()
    return train_losses(read_metrics(metrics))


@pytest.fixture(scope="module")
@once
def saved(tmp_path_factory):
    """t=2 d=2 w=2, torch_dist, the distributed optimizer: 3 steps, checkpoints at 2 and 3."""
    out = tmp_path_factory.mktemp("dist_save")
    save = str(out / "ckpt")
    losses = _launch([*_args(t=2, d=2, extra=(*DIST, *ZERO, "--async-save")), "--save", save, "--save-interval", "2"],
                     8, str(out / "m.jsonl"))
    return save, losses


def _at_start(saved, tmp_path) -> str:
    src = str(tmp_path / "src")
    shutil.copytree(saved[0], src)
    ck.write_tracker(src, START)
    shutil.rmtree(ck.iteration_dir(src, END))
    return src


def test_files_every_rank_wrote_and_manifest(saved):
    idir = ck.iteration_dir(saved[0], END)
    names = sorted(os.listdir(idir))
    assert names == sorted([".metadata", "manifest.json", *[f"__{r}_0.distcp" for r in range(8)]]), names
    assert ck.read_tracker(saved[0]) == END
    assert not [n for n in os.listdir(saved[0]) if ".tmp." in n]


def test_same_layout_resume_is_bitwise(saved, tmp_path):
    """The saves above were asynchronous; this resume saves synchronously at its end: the same files."""
    src = _at_start(saved, tmp_path)
    again = str(tmp_path / "again")
    resumed = _launch([*_args(t=2, d=2, extra=(*DIST, *ZERO)), "--load", src, "--save", again], 8,
                      str(tmp_path / "m.jsonl"))
    assert sorted(resumed) == [START] and resumed[START] == saved[1][START], (resumed, saved[1])
    (ca, a), (cb, b) = (dc.read_whole(ck.iteration_dir(root, END)) for root in (saved[0], again))
    assert sorted(a) == sorted(b) == ["master", "model", "older", "optimizer.exp_avg", "optimizer.exp_avg_sq"]
    for family in a:  # bitwise the same state, written asynchronously and synchronously
        assert all(torch.equal(a[family][n], b[family][n]) for n in a[family]), family
    assert (ca["step"], ca["scaler"], ca["optimizer"]) == (cb["step"], cb["scaler"], cb["optimizer"])


@functools.cache
def _tool():
    """tools/checkpoint_util.py loaded once into this process: the reference conversions run its ``main`` here
    (the same code as its command line, without an interpreter start and imports per conversion)."""
    spec = importlib.util.spec_from_file_location("checkpoint_util", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _util(*args: str) -> None:
    assert _tool().main(list(args)) == 0, args


def _offline(src: str, dst: str, t: int, d: int, *flags: str) -> str:
    _util("--load-dir", src, "--save-dir", dst, "--target-tensor-parallel-size", str(t),
          "--target-pipeline-parallel-size", str(d), *flags)
    return dst


TARGETS = [(1, 4, 2, True), (2, 1, 4, True), (2, 2, 2, False), (1, 1, 8, False)]  # t, d, w, distributed optimizer


@pytest.fixture(scope="module")
@once
def resharded(saved, tmp_path_factory) -> tuple[str, dict]:
    """The saved run's checkpoint at START, and tools/checkpoint_util.py's offline reshard of it to every (t, d) of
    TARGETS (shared by the state comparison and the resumed losses: one tool launch per layout)."""
    out = tmp_path_factory.mktemp("resharded")
    src = _at_start(saved, out)
    layouts = sorted({(t, d) for t, d, _, _ in TARGETS})
    return src, {(t, d): _offline(src, str(out / f"t{t}d{d}"), t, d) for t, d in layouts}


def test_resharded_resume_trains_like_offline_reshard(resharded, saved, tmp_path):
    """The losses at t=1 d=4 w=1 (t, d and w all changed; 4 processes per launch), the distributed optimizer's
    shards of both w = 2 replicas gathered; the other layouts are compared state for state below (cheaper)."""
    t, d, extra = 1, 4, ZERO
    src, offline_dirs = resharded
    online = _launch([*_args(t=t, d=d, extra=extra), "--load", src], 4, str(tmp_path / "online.jsonl"))
    offline_dir = offline_dirs[(t, d)]
    assert not dc.is_dist_checkpoint(ck.iteration_dir(offline_dir, START))  # the torch format
    offline = _launch([*_args(t=t, d=d, extra=extra), "--load", offline_dir], 4, str(tmp_path / "offline.jsonl"))
    assert sorted(online) == sorted(offline) == [START]
    assert abs(online[START] - offline[START]) <= TOL, (online, offline)
    # the state moved: the loss is that of the saved run's step (bf16 across layouts: a loose bound)
    assert abs(online[START] - saved[1][START]) < 0.05, (online, saved[1])


def _stage(common: dict, t: int, d: int, w: int, zero: bool) -> tuple[PipelineRank, RNGTracker]:
    state = build_state(Axes(tensor=t, data=w, pipeline=d), torch.device("cpu"))
    cfg = ck.model_config(common["config"])
    tracker = RNGTracker(1234 + 100 * state.pp_rank, state.tp_rank)
    spec = ModelSpec(cfg, ModelGroups.of(state), 1234, rng=tracker)
    opt = OptimizerConfig(**{**common["config"]["optimizer"], "use_distributed_optimizer": zero})
    stage = build_stage(lambda: spec.build_stage(d, state.pp_rank), spec.loss_fn(), state,
                          PipelineConfig("2bw", 1, 8 // w), opt, (1, cfg.seq_length, cfg.hidden_size),
                          rng_tracker=tracker, names=GlobalNames(spec.stage_range(d, state.pp_rank)[0], tied=WORD))
    return stage, tracker


def _state_case(src: str, offline: dict) -> list[str]:
    """Every target layout: the state DCP loads equals the state of the offline-resharded torch checkpoint."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []
    for t, d, w, zero in TARGETS:
        sd = dc.read_checkpoint(src, START, rank, world, (t, d, w, None))
        online, tracker = _stage(sd["common"], t, d, w, zero)
        dc.restore(sd, online, tracker, torch.device("cpu"))
        tp, _, pp = coords_of(rank, t, w)
        ref, tracker = _stage(sd["common"], t, d, w, zero)
        ck.restore(ck.load_rank_file(offline[(t, d)], START, t, d, tp, pp), ref, tracker, torch.device("cpu"))
        a, b = online.state_dict(), ref.state_dict()
        if (a["step"] != b["step"] or a["step"] != START
                or online.updater.scaler.state_dict() != ref.updater.scaler.state_dict()):
            bad.append(f"{(t, d, w, zero)}: step or scaler")
        pairs = [("versions", x, y) for x, y in zip(a["versions"], b["versions"])]
        pairs += [("master", a["master"], b["master"])]
        pairs += [(k, a["optimizer"][k], b["optimizer"][k]) for k in a["optimizer"]
                  if isinstance(a["optimizer"][k], torch.Tensor)]
        pairs += [("steps", torch.tensor(a["optimizer"]["steps"]), torch.tensor(b["optimizer"]["steps"]))]
        bad += [f"{(t, d, w, zero)} rank {rank}: {name}" for name, x, y in pairs if not torch.equal(x, y)]
        if not any(float(v.abs().sum()) > 0 for k, v in a["optimizer"].items() if isinstance(v, torch.Tensor)):
            bad.append(f"{(t, d, w, zero)}: optimizer state is zero (nothing loaded?)")
    return bad


def test_resharded_state_equals_offline_reshard(resharded):
    """t=1 d=4 w=2, t=2 d=1 w=4, t=2 d=2 w=2 without and t=1 d=1 w=8 without the distributed optimizer:
    every rank's weights (both versions), fp32 master, Adam moments, step and loss scale as DCP loads
    them at that layout are bitwise those that tools/checkpoint_util.py's offline reshard restores."""
    src, offline = resharded
    bad = [line for rank in run_workers(_state_case, 8, src, offline, timeout=600) for line in rank]
    assert not bad, bad


# --------------------------------------------------------------------------- one process: async saves, corruption
ASYNC = (*DIST, "--async-save")


def _one(args: list[str], metrics: str, env: dict | None = None):
    from e2e import clean_env

    cmd = [PY, os.path.join(REPO, "pretrain_gpt.py"), *args, "--metrics-file", metrics]
    return run(cmd, env=clean_env(**(env or {})), timeout=300)


@pytest.fixture(scope="module")
@once
def async_runs(tmp_path_factory):
    """4 steps with asynchronous saves at 2 and 4, the process killed while the save of 4 is written;
    then the same command again (it resumes from 2)."""
    out = tmp_path_factory.mktemp("async")
    save = str(out / "ckpt")
    args = [*gpt_args(iters=4, extra=ASYNC), "--save", save, "--load", save, "--save-interval", "2"]
    killed = _one(args, str(out / "killed.jsonl"), {SAVE_FAULT_ENV: "kill:4"})
    state = {"tracker": ck.read_tracker(save), "names": sorted(os.listdir(save))}
    again = _one(args, str(out / "again.jsonl"))
    return {"save": save, "killed": killed, "state": state, "again": again,
            "losses": (train_losses(read_metrics(str(out / "killed.jsonl"))),
                       train_losses(read_metrics(str(out / "again.jsonl"))))}


def test_killed_async_save_leaves_the_previous_checkpoint_the_newest(async_runs):
    r = async_runs
    assert r["killed"].returncode != 0 and "killing this process during the save of iteration 4" in r["killed"].stderr
    assert r["state"]["tracker"] == 2, r["state"]  # the save of 4 never published
    assert "iter_0000004" not in r["state"]["names"]
    assert any(n.startswith("iter_0000004.tmp.") for n in r["state"]["names"])
    assert r["again"].returncode == 0, r["again"].describe()
    assert "removed stale temporary folder" in r["again"].stderr, r["again"].stderr
    assert "resumed from iteration 2" in r["again"].stderr, [x for x in r["again"].stderr.splitlines()
                                                             if "resum" in x or "start" in x]
    killed, again = r["losses"]
    assert sorted(killed) == [0, 1, 2, 3] and sorted(again) == [2, 3]
    assert all(again[i] == killed[i] for i in again), (killed, again)  # same layout: bitwise
    assert ck.read_tracker(r["save"]) == 4 and not [n for n in os.listdir(r["save"]) if ".tmp." in n]


def test_failed_async_save_stops_the_run_in_one_line(tmp_path):
    save = str(tmp_path / "ckpt")
    res = _one([*gpt_args(iters=4, extra=ASYNC), "--save", save, "--save-interval", "2"], str(tmp_path / "m.jsonl"),
               {SAVE_FAULT_ENV: "fail:2"})
    assert res.returncode == 2, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "asynchronous checkpoint save of iteration 2 failed" in errors[0], res.stderr
    assert "No space left on device" in errors[0] and "Traceback" not in res.stderr, res.stderr
    assert ck.read_tracker(save) is None and not os.path.exists(ck.iteration_dir(save, 2))


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_corrupted_shard_is_refused_in_one_line(async_runs, tmp_path, victim):
    src = str(tmp_path / "ckpt")
    shutil.copytree(async_runs["save"], src)
    path = os.path.join(ck.iteration_dir(src, 4), victim)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    res = _one([*gpt_args(iters=6, extra=DIST), "--load", src], str(tmp_path / "m.jsonl"))
    assert res.returncode == 2, res.describe()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"checkpoint file {path} is corrupt" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def test_checkpoint_util_converts_torch_to_torch_dist_and_back(one_rank_run, tmp_path):  # noqa: F811
    """torch -> torch_dist -> torch (t=2): every per-parameter tensor and scalar survives both ways."""
    from megatron_2bw.checkpoint.trainer_reshard import read_dist_checkpoint, read_trainer_checkpoint

    dist_dir = str(tmp_path / "dist")
    _util("--load-dir", one_rank_run.save, "--save-dir", dist_dir, "--ckpt-format", "torch_dist")
    assert dc.is_dist_checkpoint(ck.iteration_dir(dist_dir, 4)) and ck.read_tracker(dist_dir) == 4
    back = _offline(dist_dir, str(tmp_path / "back"), 2, 1)
    src, mid, end = (read_trainer_checkpoint(one_rank_run.save), read_dist_checkpoint(dist_dir),
                     read_trainer_checkpoint(back))
    assert sorted(src.families) == sorted(mid.families) == sorted(end.families)
    for fam, full in src.families.items():
        assert all(torch.equal(full[n], mid.families[fam][n]) and torch.equal(full[n], end.families[fam][n])
                   for n in full), fam
    for key in ("step", "scaler"):
        assert src.first["stage"][key] == mid.first["stage"][key] == end.first["stage"][key]
    assert end.first["layout"]["t"] == 2


def test_schedule_change_on_load_equals_offline_conversion(async_runs, tmp_path):
    """A 2BW torch_dist checkpoint resumed by Flush (the newest version kept) trains like the offline
    ``checkpoint_util --target-schedule flush`` conversion resumed (one process each)."""
    flags = ("--pipeline-schedule", "flush", "--override-resumed-settings")
    online = _one([*gpt_args(iters=6, extra=flags), "--load", async_runs["save"]], str(tmp_path / "on.jsonl"))
    assert online.returncode == 0, online.describe()
    offline_dir = _offline(async_runs["save"], str(tmp_path / "flush"), 1, 1, "--target-schedule", "flush")
    offline = _one([*gpt_args(iters=6, extra=flags), "--load", offline_dir], str(tmp_path / "off.jsonl"))
    assert offline.returncode == 0, offline.describe()
    a, b = (train_losses(read_metrics(str(tmp_path / f"{n}.jsonl"))) for n in ("on", "off"))
    assert sorted(a) == sorted(b) == [4, 5] and all(abs(a[i] - b[i]) <= TOL for i in a), (a, b)


@pytest.mark.parametrize("mode", ["ef", "extrapolate"])
def test_ef_compensation_state_resumes_bitwise(tmp_path, mode):
    """``--2bw-compensation ef`` keeps the optimizer's iterate y (the master, fp32 here) apart from the weights x
    the model runs on, ``extrapolate`` the previous gradient: a torch_dist checkpoint holds either (sharded
    as the optimizer state), so a resume at the same layout continues bitwise; without it the first
    resumed update would be corrected wrongly and the losses after it would differ."""
    ef = (*DIST, "--2bw-compensation", mode)
    args = [a for a in _args(t=1, d=1, iters=4, extra=ef) if a != "--bf16"]
    straight = _launch([*args, "--save", str(tmp_path / "ckpt"), "--save-interval", "2"], 1, str(tmp_path / "a.jsonl"))
    src = str(tmp_path / "src")
    shutil.copytree(str(tmp_path / "ckpt"), src)
    ck.write_tracker(src, 2)
    shutil.rmtree(ck.iteration_dir(src, 4))
    _, fams = dc.read_whole(ck.iteration_dir(src, 2))
    if mode == "extrapolate":
        assert dc.EF_PREV in fams and any(v.abs().sum() > 0 for v in fams[dc.EF_PREV].values())
    else:
        assert dc.MASTER in fams and any(not v.equal(fams[dc.MODEL][k].float()) for k, v in fams[dc.MASTER].items())
    resumed = _launch([*args, "--load", src, "--save", str(tmp_path / "again")], 1, str(tmp_path / "b.jsonl"))
    assert sorted(resumed) == [2, 3] and all(resumed[k] == straight[k] for k in resumed), (resumed, straight)
