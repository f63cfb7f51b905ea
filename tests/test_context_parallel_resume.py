"""A run checkpointed at c = 2 resumes at c = 1, and one checkpointed at c = 1 resumes at c = 2 (issue 36).

pretrain_gpt.py, gpt-tiny, fp32 on CPU, ``--ckpt-format torch_dist`` (its tensors are global, so the
context-parallel size may change on load): each layout trains 8 steps, saving at 4; each checkpoint of
step 4 is resumed at the other layout, whose steps 5-8 must equal that layout's own uninterrupted run.
At c = 2 the optimizer is distributed over the two context ranks, so each resume also reshards its state.
The c ranks hold the same weights and optimizer state as one rank, and the arithmetic differs only by
the attention's block merge, so the tolerance is rounding (1e-5 on a loss of about 6). SGD with momentum
(its state is checkpointed): Adam would turn the rounding noise of gradients that are zero in exact
arithmetic (the key bias's) into lr-sized steps, and the layouts apart by more than rounding.
"""

from __future__ import annotations

import shutil

from ckpt_runs import _ckpt_data, gpt_args, train  # noqa: F401
from e2e import read_metrics, train_losses

from megatron_2bw.checkpoint import checkpointing as ck

CUT, END = 4, 8


def _run(args: list[str], c: int, metrics: str, *, comm: str = "p2p") -> dict[int, float]:
    """At c = 2 with the distributed optimizer: its shards (over the two context ranks) are resharded on load."""
    cp = ["--context-parallel-size", str(c), "--cp-comm-type", comm, "--use-distributed-optimizer"] if c > 1 else []
    res = train([*args, *cp, "--metrics-file", metrics], nproc=c, timeout=300)
    assert res.returncode == 0, res.describe()
    return train_losses(read_metrics(metrics))


def test_resume_across_context_parallel_sizes(tmp_path):
    args = gpt_args(iters=END, d=1, schedule="flush", extra=("--ckpt-format", "torch_dist", "--weight-decay", "0.01",
                                                                "--optimizer", "sgd", "--sgd-momentum", "0.9"))
    straight, saved = {}, {}
    for c in (1, 2):
        saved[c] = str(tmp_path / f"ckpt{c}")
        straight[c] = _run([*args, "--save", saved[c], "--save-interval", str(CUT)], c, str(tmp_path / f"s{c}.jsonl"))
        assert sorted(straight[c]) == list(range(END)), straight[c]
    assert max(abs(straight[1][k] - straight[2][k]) for k in straight[1]) < 1e-5, straight
    for src, dst in ((2, 1), (1, 2)):
        load = str(tmp_path / f"load{src}to{dst}")
        shutil.copytree(ck.iteration_dir(saved[src], CUT), ck.iteration_dir(load, CUT))
        ck.write_tracker(load, CUT)
        resumed = _run([*args, "--load", load], dst, str(tmp_path / f"r{src}{dst}.jsonl"), comm="all_gather")
        assert sorted(resumed) == list(range(CUT, END)), resumed
        err = max(abs(resumed[k] - straight[dst][k]) for k in resumed)
        assert err < 1e-5, (src, dst, err, resumed, straight[dst])
