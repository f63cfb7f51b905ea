"""The trainer's command line resumes every optimizer from either checkpoint format exactly (issue 33).

For adam, sgd and muon x ``--ckpt-format torch`` and ``torch_dist``: pretrain_gpt.py, gpt-tiny, PipeDream-2BW
at d = 2 (two processes, fp32 on CPU) trains 8 steps, saving at 4 and 8; the same command resumed from the
checkpoint of step 4 trains steps 5-8 (iterations 4-7), whose losses must equal the uninterrupted run's
within 1e-6 (the same layout and arithmetic: in practice bitwise). The engine-level matrix of every other
combination is tests/test_resume_matrix.py.
"""

from __future__ import annotations

import shutil

import pytest
from ckpt_runs import _ckpt_data, gpt_args, train  # noqa: F401
from e2e import read_metrics, train_losses

from megatron_2bw.checkpoint import checkpointing as ck

CUT, END = 4, 8


def _run(args: list[str], metrics: str) -> dict[int, float]:
    res = train([*args, "--metrics-file", metrics], nproc=2, timeout=300)
    assert res.returncode == 0, res.describe()
    return train_losses(read_metrics(metrics))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd", "muon"])
def test_resume_at_step_4_continues_the_uninterrupted_run(tmp_path, optimizer, fmt):
    extra = ("--optimizer", optimizer, "--ckpt-format", fmt, "--weight-decay", "0.01",
             *(("--sgd-momentum", "0.9") if optimizer == "sgd" else ()))
    args = gpt_args(iters=END, d=2, extra=extra)
    save = str(tmp_path / "ckpt")
    straight = _run([*args, "--save", save, "--save-interval", str(CUT)], str(tmp_path / "straight.jsonl"))
    load = str(tmp_path / "load")
    shutil.copytree(ck.iteration_dir(save, CUT), ck.iteration_dir(load, CUT))
    ck.write_tracker(load, CUT)
    resumed = _run([*args, "--load", load], str(tmp_path / "resumed.jsonl"))
    assert sorted(straight) == list(range(END)) and sorted(resumed) == list(range(CUT, END)), (straight, resumed)
    assert all(abs(resumed[k] - straight[k]) <= 1e-6 for k in resumed), (straight, resumed)
