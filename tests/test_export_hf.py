"""tools/checkpoint_util.py: Hugging Face export/import and resharding of Megatron-layout checkpoints."""

from __future__ import annotations

import importlib.util
import os

import torch
from export_helpers import bert_batch, bert_outputs, gpt_logits, max_err, tiny

from megatron_2bw.checkpoint.megatron_format import read_megatron_dir, read_rank_files, write_megatron_dir
from megatron_2bw.export.model_io import build_full_model, load_full
from megatron_2bw.models.spec import run_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("checkpoint_util", os.path.join(ROOT, "tools", "checkpoint_util.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def util(*args: str) -> int:
    return _tool().main(list(args))


def test_saver_hf_gpt_from_resharded_checkpoint(tmp_path):
    from transformers import GPT2LMHeadModel

    ex, model = tiny("gpt")
    write_megatron_dir(str(tmp_path / "ckpt"), ex, t=2, d=2)
    assert util("--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"), "--saver", "hf") == 0
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, ex.cfg.vocab_size, (3, ex.cfg.seq_length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert theirs.shape[-1] == ex.cfg.vocab_size
    assert max_err(theirs, gpt_logits(model, tokens, ex.cfg.vocab_size)) < 1e-5


def test_saver_hf_bert(tmp_path):
    from transformers import MegatronBertForPreTraining

    ex, model = tiny("bert")
    write_megatron_dir(str(tmp_path / "ckpt"), ex, t=2, d=1)
    assert util("--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"), "--saver", "hf") == 0
    hf = MegatronBertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    batch = bert_batch(ex.cfg)
    with torch.no_grad():
        o = hf(input_ids=batch["tokens"], token_type_ids=batch["token_types"], attention_mask=batch["pad"].long())
    lm, sop = bert_outputs(model, batch, ex.cfg.vocab_size)
    assert max_err(o.prediction_logits[batch["pad"]], lm[batch["pad"]]) < 1e-5
    assert max_err(o.seq_relationship_logits, sop) < 1e-5


def _random_hf_gpt2(path: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=200, n_positions=24, n_embd=48, n_layer=3, n_head=4, activation_function="gelu_new",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorms
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


def test_loader_hf_gives_equal_logits_and_trains(tmp_path):
    hf = _random_hf_gpt2(str(tmp_path / "hf"))
    assert util("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ckpt"),
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "3") == 0
    assert sorted(os.listdir(tmp_path / "ckpt" / "iter_0000000")) == [
        f"mp_rank_{a:02d}_{b:03d}" for a in range(2) for b in range(3)]
    ex = read_megatron_dir(str(tmp_path / "ckpt"))
    assert (ex.cfg.num_layers, ex.cfg.hidden_size, ex.cfg.vocab_size) == (3, 48, 200)
    model = load_full(build_full_model(ex.cfg), ex.cfg, ex.weights).eval()
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert max_err(gpt_logits(model, tokens, 200), theirs) < 1e-5
    # the imported model trains: ten Adam steps on one batch lower its loss
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(10):
        logits = run_layers(list(model), {"tokens": tokens[:, :-1]})[..., :200]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 200), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_resharding_round_trip_and_schedule(tmp_path):
    ex, _ = tiny("gpt")
    write_megatron_dir(str(tmp_path / "a"), ex, t=4, d=2)
    assert util("--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "b"),
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "4",
                "--target-schedule", "flush") == 0
    files = read_rank_files(str(tmp_path / "b" / "iter_0000011"))
    assert sorted(files) == [(a, b) for a in range(2) for b in range(4)]
    assert files[(0, 0)]["args"].pipeline_schedule == "flush"
    back = read_megatron_dir(str(tmp_path / "b"))
    assert all(torch.equal(back.weights[n], v) for n, v in ex.weights.items())


def test_bad_requests_are_one_line_errors(tmp_path, capsys):
    ex, _ = tiny("gpt")
    write_megatron_dir(str(tmp_path / "a"), ex)
    assert util("--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "h"), "--saver", "hf",
                "--target-tensor-parallel-size", "2") == 2
    assert util("--load-dir", str(tmp_path / "missing"), "--save-dir", str(tmp_path / "b")) == 2
    assert util("--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "b"),
                "--target-tensor-parallel-size", "3") == 2  # 4 heads do not split 3 ways
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "--saver hf" in err[0] and "does not exist" in err[1] and "not divisible" in err[2]


def test_loader_hf_bert_round_trip(tmp_path):
    from transformers import MegatronBertForPreTraining

    from megatron_2bw.export.hf_io import load_hf_dir, save_hf_dir

    ex, model = tiny("bert")
    save_hf_dir(str(tmp_path / "hf"), ex)
    hf = MegatronBertForPreTraining.from_pretrained(str(tmp_path / "hf"))
    back = load_hf_dir(str(tmp_path / "hf"))
    assert back.cfg == ex.cfg
    assert all(torch.equal(back.weights[n], v) for n, v in ex.weights.items())
    # and the HF weights are laid out as its own q/k/v (checked through its output, not our names)
    batch = bert_batch(ex.cfg)
    with torch.no_grad():
        o = hf.eval()(input_ids=batch["tokens"], token_type_ids=batch["token_types"],
                      attention_mask=batch["pad"].long())
    lm, _ = bert_outputs(load_full(build_full_model(back.cfg), back.cfg, back.weights).eval(), batch, ex.cfg.vocab_size)
    assert max_err(o.prediction_logits[batch["pad"]], lm[batch["pad"]]) < 1e-5
