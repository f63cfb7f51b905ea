"""A checkpoint the trainer wrote (2BW, d = 2) leaves through tools/checkpoint_util.py and tools/generate.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from e2e import REPO, shared_corpus, torchrun
from export_helpers import max_err

from megatron_2bw.checkpoint.megatron_format import read_rank_files
from megatron_2bw.checkpoint.trainer_format import newest_weights
from megatron_2bw.export.checkpoints import trainer_model_config
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec, run_layers
from megatron_2bw.schedule.stages import stage_range


@pytest.fixture(scope="module")
def corpus_data(tmp_path_factory):
    return shared_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def trainer_ckpt(tmp_path_factory, corpus_data) -> str:
    save = str(tmp_path_factory.mktemp("trainer") / "ckpt")
    res = torchrun("pretrain_gpt.py", [
        "--model-preset", "gpt-tiny", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
        *corpus_data.data_args("98,1,1"),
        "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2",
        "--eval-iters", "0", "--device", "cpu", "--save", save], nproc=2)
    assert res.returncode == 0, res.describe()
    return save


def _stage_logits(ckpt: str, tokens: torch.Tensor) -> torch.Tensor:
    """Reference: each stage's modules as the engine builds them, loaded from that stage's file, run in turn."""
    files = read_rank_files(os.path.join(ckpt, "iter_0000003"))
    cfg = trainer_model_config(files[(0, 0)]["config"])
    x = None
    for r in range(2):
        layers = torch.nn.ModuleList(ModelSpec(cfg, ModelGroups(), 0).build_stage(2, r))
        start = stage_range(cfg.num_layers, 2, r)[0]
        saved = newest_weights(files[(0, r)], cfg)  # Megatron's nested ``model`` by global name
        with torch.no_grad():
            for local, p in layers.named_parameters():
                idx, rest = local.split(".", 1)
                p.copy_(saved["0.word.weight" if rest == "word_weight" else f"{start + int(idx)}.{rest}"])
        with torch.no_grad():
            x = run_layers(list(layers.eval()), {"tokens": tokens}, x)
    return x[..., : cfg.vocab_size]


def _tool(name: str):
    """``tools/<name>.py`` loaded into this process: its ``main`` runs the command line's code without an
    interpreter start that imports torch and transformers again."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _main(capsys, name: str, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = _tool(name).main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_trainer_checkpoint_to_hf_and_generate(trainer_ckpt, tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    # the optimizer state is dropped and said so (an HF model never holds it; issue 19), not refused
    code, out, err = _main(capsys, "checkpoint_util", "--load-dir", trainer_ckpt, "--save-dir", str(tmp_path / "x"),
                           "--saver", "hf")
    assert code == 0 and "the optimizer state was left out" in out, (code, out, err)
    code, out, err = _main(capsys, "checkpoint_util", "--load-dir", trainer_ckpt, "--save-dir", str(tmp_path / "hf"),
                           "--saver", "hf", "--no-optimizer")
    assert code == 0, (out, err)
    assert "with its SentencePieceTokenizer tokenizer" in out, (out, err)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "hf" / "tokenizer.model"))
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["eos_token_id"] == conf["bos_token_id"] == sp.piece_to_id("<eod>") >= 0
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))  # the 512-piece tokenizer
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert max_err(theirs, _stage_logits(trainer_ckpt, tokens)) < 1e-5
    code, out, err = _main(capsys, "generate", "--load", trainer_ckpt, "--prompt", "The story", "--max-new-tokens", "5",
                           "--temperature", "0", "--device", "cpu")
    assert code == 0, (out, err)
    assert out.startswith("The story") and len(out.strip()) > len("The story")


def test_trainer_files_with_megatron_contents_load(tmp_path):
    """A trainer file whose ``model`` is Megatron's nested contents (engine state beside it) reads whole."""
    from dataclasses import asdict

    from export_helpers import tiny

    from megatron_2bw.checkpoint.megatron_format import FILENAME, megatron_files, rank_dir
    from megatron_2bw.export.checkpoints import load_checkpoint

    ex, _ = tiny("gpt")
    idir = tmp_path / "ckpt" / "iter_0000011"
    for (tp, pp), contents in megatron_files(ex, 2, 2).items():
        contents.update(stage={"optimizer": {}}, config={"model": asdict(ex.cfg)},
                        layout={"t": 2, "d": 2, "tp_rank": tp, "pp_rank": pp, "schedule": "2bw"})
        (idir / rank_dir(tp, pp, 2)).mkdir(parents=True)
        torch.save(contents, idir / rank_dir(tp, pp, 2) / FILENAME)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("11\n")
    back, has_optimizer = load_checkpoint(str(tmp_path / "ckpt"))
    assert has_optimizer and back.cfg == ex.cfg and back.iteration == 11
    assert all(torch.equal(back.weights[n], v) for n, v in ex.weights.items())
