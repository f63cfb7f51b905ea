"""A randomly initialised Hugging Face GPT2LMHeadModel, read with --loader hf, trains in this trainer."""

import math

import pytest
import torch
from e2e import PY, REPO, corpus, read_metrics, run, train_args, train_losses  # noqa: F401
from transformers import GPT2Config, GPT2LMHeadModel


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> str:
    """A random GPT2LMHeadModel converted once by ``checkpoint_util.py --loader hf`` (both tests read it)."""
    out = tmp_path_factory.mktemp("hf_loader")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=16, n_embd=64, n_layer=4, n_head=4, n_inner=256,
                                    activation_function="gelu_new", layer_norm_epsilon=1e-5))
    hf.save_pretrained(out / "hf")
    conv = run([PY, f"{REPO}/tools/checkpoint_util.py", "--loader", "hf", "--load-dir", str(out / "hf"),
                "--save-dir", str(out / "ck")], timeout=180)
    assert conv.returncode == 0, conv.describe()
    return str(out / "ck")


def test_hf_model_loads_and_trains(corpus, hf_checkpoint, tmp_path):  # noqa: F811
    metrics = str(tmp_path / "m.jsonl")
    args = [*train_args(corpus, preset="gpt-tiny", schedule="flush", iters=12, micro=2, global_batch=4, lr=3e-3),
            "--load", hf_checkpoint, "--finetune", "--log-interval", "1", "--eval-iters", "0",
            "--metrics-file", metrics]
    res = run([PY, f"{REPO}/pretrain_gpt.py", *args], timeout=240)
    assert res.returncode == 0, res.describe()
    assert "--finetune: starting from the weights of" in res.stdout + res.stderr, res.describe()
    losses = train_losses(read_metrics(metrics))
    first, last = losses[min(losses)], losses[max(losses)]
    assert all(math.isfinite(v) for v in losses.values())
    assert abs(first - math.log(512)) < 0.5  # the HF model's random init, not a trained model
    assert last < first - 0.3, losses


def test_weights_only_checkpoint_needs_finetune(corpus, hf_checkpoint):  # noqa: F811
    for extra in ((), ("--no-load-optim",)):
        args = [*train_args(corpus, preset="gpt-tiny", schedule="flush", iters=4, micro=2, global_batch=4),
                "--load", hf_checkpoint, *extra]
        res = run([PY, f"{REPO}/pretrain_gpt.py", *args], timeout=180)
        errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and errors[0].endswith(
            "holds weights only (a Megatron-LM checkpoint): load it with --finetune"), res.describe()
