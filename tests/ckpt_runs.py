"""Tiny trainer runs shared by the checkpoint tests (one launch each per session).

GPT-tiny on the tests' own small corpus (512-piece SentencePiece, built once a session), fp32 on CPU, no dropout.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from e2e import PY, REPO, Result, once, read_metrics, run, shared_corpus, torchrun, train_losses  # noqa: F401

DATA: list[str] = []  # filled by the autouse fixture below before any test builds its flags


@pytest.fixture(scope="session", autouse=True)
def _ckpt_data(tmp_path_factory) -> None:
    if not DATA:
        DATA.extend(shared_corpus(tmp_path_factory).data_args())


def gpt_args(*, iters: int, t: int = 1, d: int = 1, schedule: str = "2bw", extra: tuple[str, ...] = ()) -> list[str]:
    return ["--model-preset", "gpt-tiny", "--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
            str(d), "--pipeline-schedule", schedule, "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-2", "--lr-decay-style", "constant", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "2", "--device", "cpu", *DATA, *extra]


def train(args: list[str], *, nproc: int = 1, timeout: float = 300) -> Result:
    """One trainer launch: a plain process for one rank, torchrun otherwise."""
    if nproc == 1:
        return run([PY, os.path.join(REPO, "pretrain_gpt.py"), *args], timeout=timeout)
    return torchrun("pretrain_gpt.py", args, nproc=nproc, timeout=timeout)


@dataclasses.dataclass
class Saved:
    save: str
    args: list[str]
    metrics: list[dict]
    result: Result


def _saved_run(tmp_path_factory, name: str, args: list[str], nproc: int, save_interval: int) -> Saved:
    out = tmp_path_factory.mktemp(name)
    save, metrics = str(out / "ckpt"), str(out / "metrics.jsonl")
    res = train([*args, "--save", save, "--save-interval", str(save_interval), "--metrics-file", metrics], nproc=nproc)
    assert res.returncode == 0, res.describe()
    return Saved(save, args, read_metrics(metrics), res)


@pytest.fixture(scope="session")
@once
def one_rank_run(tmp_path_factory) -> Saved:
    """t = 1, d = 1: 4 steps, checkpoints at 2 and 4."""
    return _saved_run(tmp_path_factory, "one_rank", gpt_args(iters=4), 1, 2)


@pytest.fixture(scope="session")
@once
def tp2_pp2_run(tmp_path_factory) -> Saved:
    """t = 2, d = 2, PipeDream-2BW, 4 processes: 10 steps, checkpoints at 5 and 10."""
    return _saved_run(tmp_path_factory, "tp2_pp2", gpt_args(iters=10, t=2, d=2), 4, 5)
