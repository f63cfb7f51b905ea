"""MoE checkpoints in ``--ckpt-format torch_dist`` through the CLI (issue 42): the expert stacks are saved on the
global expert axis (each rank's experts at their offsets), so a run saved at EP = 2 (two data ranks) resumes at
EP = 1 in one process and at EP = 4 on four, with its Adam or Muon state, and its losses equal the uninterrupted
run's within 1e-6; a resume at the saving layout replays it bitwise. Bad input is one line and exit 2: an MoE
checkpoint loaded into a dense model and the reverse, a changed --num-experts, an expert bias the checkpoint lacks
(``--ckpt-format torch`` at EP > 1: test_moe_checkpoint_torch.py).
"""

from __future__ import annotations

import os

import pytest
from multiproc import run_workers
from test_moe_training import BASE, _cli

ITERS = ["--train-iters", "4"]
SAVE = ["--ckpt-format", "torch_dist", "--save-interval", "2"]
EP2 = ["--expert-model-parallel-size", "2", "--pipeline-schedule", "flush", "--moe-token-dispatcher-type", "alltoall"]
FLUSH = ["--pipeline-schedule", "flush"]
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "0.2", "--moe-aux-loss-coeff", "0"]
# per variant: its flags, and its schedule for the saving run (EP 2) and the resume at EP 1. ``bias-2bw``: the
# aux-loss-free expert bias under 2BW, whose two versions B(step) and B(step - 1) the checkpoint carries (a
# resume that reset them, or kept one, routes differently: the losses part at once at rate 0.2)
OPTIMIZERS = {"adam": [], "muon": ["--optimizer", "muon"], "bias-2bw": BIAS}
SCHEDULE = {"bias-2bw": "2bw"}


def _on(opt: str, flags: list[str]) -> list[str]:
    """``flags`` with the variant's schedule."""
    i = flags.index("--pipeline-schedule")
    return [*flags[:i + 1], SCHEDULE.get(opt, flags[i + 1]), *flags[i + 2:]]


def _args(extra: list[str]) -> list[str]:
    base = list(BASE)
    i = base.index("--train-iters")
    return [*base[:i], *base[i + 2:], *ITERS, *extra]


def _session(runs: list[tuple[str, list[str]]], root: str) -> list[list[float] | None]:
    import torch
    import torch.distributed as dist

    from megatron_2bw.optimizer import muon

    muon.NS_DTYPE = torch.float32  # as test_moe_training: the layouts reorder sums
    rank = dist.get_rank()
    return [_cli(_args(extra), os.path.join(root, f"{name}.{rank}.jsonl")) for name, extra in runs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Per variant: the uninterrupted EP = 2 run (saving at 2 and 4), its resume at EP = 2 from iteration 2."""
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    runs, resumes = [], []
    for opt, flags in OPTIMIZERS.items():
        ck = os.path.join(root, opt)
        runs.append((f"{opt}-full", [*_on(opt, EP2), *flags, *SAVE, "--save", ck]))
        resumes.append((f"{opt}-same", [*_on(opt, EP2), *flags, "--load", os.path.join(root, opt)]))
    (full, _) = run_workers(_session, 2, runs, root, timeout=600)
    for opt in OPTIMIZERS:  # resume from iteration 2: point the tracker back
        with open(os.path.join(root, opt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    (same, _) = run_workers(_session, 2, resumes, root, timeout=600)
    one = [(f"{opt}-ep1", [*_on(opt, FLUSH), *flags, "--load", os.path.join(root, opt)])
           for opt, flags in OPTIMIZERS.items()]
    (ep1,) = run_workers(_session, 1, one, root, timeout=600)
    ep4 = [("adam-ep4", [*EP2[:1], "4", *EP2[2:], "--use-distributed-optimizer", "--load", os.path.join(root, "adam")])]
    ep4_losses = run_workers(_session, 4, ep4, root, timeout=600)[0][0]
    return {"root": root, "full": dict(zip(OPTIMIZERS, full)), "same": dict(zip(OPTIMIZERS, same)),
            "ep1": dict(zip(OPTIMIZERS, ep1)), "ep4": ep4_losses}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_resume_at_another_expert_layout(saved, opt):
    full, same, ep1 = saved["full"][opt], saved["same"][opt], saved["ep1"][opt]
    assert len(full) == 4 and len(same) == 2 and len(ep1) == 2, (full, same, ep1)
    assert same == full[2:], (same, full)  # the saving layout: bitwise
    assert max(abs(a - b) for a, b in zip(ep1, full[2:])) < 1e-6, (ep1, full)


def test_resume_at_four_expert_ranks(saved):
    """Saved at EP = 2 (two data ranks), resumed at EP = 4 (one expert per rank, the Adam state sharded over
    four ranks by the distributed optimizer): the uninterrupted run's losses within 1e-6."""
    full, ep4 = saved["full"]["adam"], saved["ep4"]
    assert ep4 is not None and len(ep4) == 2 and max(abs(a - b) for a, b in zip(ep4, full[2:])) < 1e-6, (ep4, full)


def _dense(argv: list[str]) -> list[str]:
    i = argv.index("--num-experts")
    return argv[:i] + argv[i + 8:]  # the eight MoE words of BASE


@pytest.mark.parametrize("change, line", [
    (_dense, "holds an MoE model (4 experts) but this run builds a dense model"),
    (lambda a: [*a, "--num-experts", "8"], "has num_experts=4 but this run has num_experts=8"),
    (lambda a: [*a, "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"],
     "the checkpoint holds no expert bias"),
], ids=["moe-into-dense", "num-experts", "bias-missing"])
def test_bad_resume_is_one_line(saved, change, line):
    from e2e import PY, REPO, clean_env, run

    argv = change(_args([*FLUSH, "--load", os.path.join(saved["root"], "adam")]))
    res = run([PY, f"{REPO}/pretrain_gpt.py", *argv], env=clean_env(), timeout=180)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.describe()
    assert line in [ln for ln in res.stderr.splitlines() if ln.strip()][-1], res.describe()


def test_the_bias_reaches_generation(saved):
    """A torch_dist checkpoint's expert bias (B of the newest weights) comes with its export: generation routes
    with it (the logits differ from a zero bias's), and a model that needs it is refused without it."""
    import torch

    from megatron_2bw.errors import ConfigError
    from megatron_2bw.export.checkpoints import load_checkpoint
    from megatron_2bw.export.generation import CachedGPT

    ex, _ = load_checkpoint(os.path.join(saved["root"], "bias-2bw"))
    assert sorted(ex.router) == [0, 1] and all(b.abs().max() > 0.1 for b in ex.router.values())
    tokens = torch.arange(1, 17).view(1, 16)
    with_bias = CachedGPT(ex.cfg, ex.weights, router=ex.router).forward(tokens)
    zero = CachedGPT(ex.cfg, ex.weights, router={i: torch.zeros_like(b) for i, b in ex.router.items()}).forward(tokens)
    assert not torch.allclose(with_bias, zero)
    with pytest.raises(ConfigError, match="routes with an expert bias the checkpoint does not hold"):
        CachedGPT(ex.cfg, ex.weights)


def test_dense_checkpoint_into_moe_is_refused():
    """The reverse, on the check itself (a dense checkpoint records no ``moe``)."""
    from megatron_2bw.checkpoint.compat import check_moe
    from megatron_2bw.errors import ConfigError

    with pytest.raises(ConfigError, match="holds a dense model but this run builds an MoE model \\(4 experts\\)"):
        check_moe("ck", None, {"num_experts": 4})
    check_moe("ck", {"num_experts": 4, "moe_layer_freq": [1, 1]}, {"num_experts": 4, "moe_layer_freq": (1, 1)})
