"""Megatron flags of ported launch scripts (issue 19): each accepted, and where it changes training,
equal to an independent reference (a hand-built batch, Megatron's own loop, separate documents)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from megatron_2bw.cli import build_config, lr_config, parse_args
from megatron_2bw.config import LRConfig, ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.models.gpt import DocumentMasks, ltor_masks_and_position_ids, make_batch
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec, run_layers
from megatron_2bw.training.lr_schedule import lr_at

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
        "--train-iters 100 --lr 1e-3 --data-path x --tokenizer-type GPT2BPETokenizer").split()


def _cfg(*extra: str, kind: str = "gpt"):
    return build_config(parse_args([*BASE, *extra], kind), kind, 1, cuda_available=False)


# --------------------------------------------------------------------------- --eod-mask-loss, --reset-*
def megatron_ltor(data: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                  eod_mask_loss: bool):
    """Megatron-LM's get_ltor_masks_and_position_ids (megatron/training/utils.py), its loops as written."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= (i + 1 - prev_index)
                    prev_index = i + 1
    attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


def test_document_masks_on_a_hand_built_batch():
    eod = 0
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9],
                           [0, 3, 4, 0, 0, 6]])
    out = ltor_masks_and_position_ids(tokens, DocumentMasks(eod, True, True, True))
    assert out["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 0, 0]]
    # row 0: documents [5 0] [7 8 0] [9]; a query sees its own document's keys up to itself
    expect0 = [[1, 0, 0, 0, 0, 0],
               [1, 1, 0, 0, 0, 0],
               [0, 0, 1, 0, 0, 0],
               [0, 0, 1, 1, 0, 0],
               [0, 0, 1, 1, 1, 0],
               [0, 0, 0, 0, 0, 1]]
    assert out["attention_mask"].shape == (2, 1, 6, 6)
    assert out["attention_mask"][0, 0].int().tolist() == expect0
    # row 1: [0] [3 4 0] [0] [6]
    assert out["attention_mask"][1, 0, 4].int().tolist() == [0, 0, 0, 0, 1, 0]
    assert out["attention_mask"][1, 0, 3].int().tolist() == [0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("flags", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1), (0, 1, 1)])
def test_document_masks_equal_megatrons_loops(flags):
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 6, (4, 33), generator=gen)  # eod 0: about one token in six
    data[1, -1] = 0  # an eod in the last place
    mask_loss, reset_pos, reset_att = map(bool, flags)
    att, loss, pos = megatron_ltor(data, 0, reset_pos, reset_att, mask_loss)
    ours = ltor_masks_and_position_ids(data, DocumentMasks(0, mask_loss, reset_pos, reset_att))
    assert torch.equal(ours["loss_mask"], loss)
    assert torch.equal(ours.get("position_ids", torch.arange(33).expand(4, 33)), pos)
    if reset_att:
        assert torch.equal(ours["attention_mask"], ~att)  # torch: True = attend; Megatron: True = masked
    else:
        assert "attention_mask" not in ours


def test_packed_documents_equal_separate_documents():
    """With --reset-position-ids and --reset-attention-mask, a window packing two documents gives each
    token the logits it gets when its document is run alone (the model's own causal path)."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12, vocab_size=50)
    spec = ModelSpec(cfg, ModelGroups(), 7,
                     masks=DocumentMasks(eod=1, reset_position_ids=True, reset_attention_mask=True))
    layers = torch.nn.ModuleList(spec.build(0, cfg.num_layers + 2)).eval()
    doc_a = [5, 9, 13, 2, 1]  # ends with eod 1
    doc_b = [7, 3, 30, 11, 4, 8, 21]
    packed = torch.tensor([doc_a + doc_b + [0]])  # [1, s+1]
    with torch.no_grad():
        logits = run_layers(layers, spec.make_batch(packed))
        plain = ModelSpec(cfg, ModelGroups(), 7)
        alone_a = run_layers(layers, plain.make_batch(torch.tensor([doc_a + [0]])))
        alone_b = run_layers(layers, plain.make_batch(torch.tensor([doc_b + [0]])))
        unmasked = run_layers(layers, plain.make_batch(packed))
    n = len(doc_a)
    torch.testing.assert_close(logits[0, :n], alone_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0, n:], alone_b[0], rtol=1e-5, atol=1e-5)
    assert (unmasked[0, n:] - alone_b[0]).abs().max() > 1e-2  # without the flags document b sees document a


def test_eod_mask_loss_drops_the_prediction_after_an_eod():
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=40)
    tokens = torch.tensor([[4, 6, 1, 9, 12, 1, 3, 5, 7]])
    spec = ModelSpec(cfg, ModelGroups(), 3, masks=DocumentMasks(eod=1, eod_mask_loss=True))
    layers = torch.nn.ModuleList(spec.build(0, cfg.num_layers + 2)).eval()
    batch = spec.make_batch(tokens)
    with torch.no_grad():
        loss = spec.loss_fn()(run_layers(layers, batch), batch)
        logits = run_layers(layers, batch)
    per_token = torch.nn.functional.cross_entropy(logits[0, :, :40], tokens[0, 1:], reduction="none")
    keep = tokens[0, :-1] != 1
    torch.testing.assert_close(loss, per_token[keep].mean(), rtol=1e-5, atol=1e-6)


def test_document_flags_reach_the_config_and_need_gpt():
    cfg = _cfg("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask")
    assert (cfg.data.eod_mask_loss, cfg.data.reset_position_ids, cfg.data.reset_attention_mask) == (True,) * 3
    assert DocumentMasks.from_config(cfg.data, 50256) == DocumentMasks(50256, True, True, True)
    assert DocumentMasks.from_config(_cfg().data, 50256) is None
    assert make_batch(torch.zeros(2, 5, dtype=torch.long)).keys() == {"tokens", "labels", "loss_mask"}
    with pytest.raises(ConfigError, match="--eod-mask-loss"):
        parse_args([*BASE, "--eod-mask-loss"], "bert")


# --------------------------------------------------------------------------- --make-vocab-size-divisible-by
def test_padded_vocabulary_as_megatron():
    """Megatron's _vocab_size_with_padding: the next multiple of divisible_by * t."""
    def megatron(orig: int, div: int, t: int) -> int:
        after, multiple = orig, div * t
        while after % multiple != 0:
            after += 1
        return after

    for div in (1, 8, 128):
        for t in (1, 2, 4):
            m = ModelConfig(vocab_size=50257, make_vocab_size_divisible_by=div)
            assert m.padded_vocab_size(t) == megatron(50257, div, t)
    cfg = _cfg("--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size", "1")
    assert cfg.model.make_vocab_size_divisible_by == 64
    assert _cfg().model.padded_vocab_size(2) == megatron(cfg.model.vocab_size, 128, 2)  # the default is 128
    with pytest.raises(ConfigError, match="--make-vocab-size-divisible-by must be >= 1"):
        _cfg("--make-vocab-size-divisible-by", "0")


def test_padding_does_not_change_the_loss():
    """Padded rows never win the softmax: divisible-by 1 and 128 give the same loss."""
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for div in (1, 128):
        cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50,
                          make_vocab_size_divisible_by=div)
        spec = ModelSpec(cfg, ModelGroups(), 3)
        layers = torch.nn.ModuleList(spec.build(0, 3)).eval()
        batch = spec.make_batch(tokens)
        with torch.no_grad():
            out = run_layers(layers, batch)
        assert out.shape[-1] == cfg.padded_vocab_size(1)
        losses.append(spec.loss_fn()(out, batch))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- WSD, inverse-square-root
def megatron_lr(num_steps: int, *, max_lr: float, min_lr: float, warmup: int, decay: int, style: str,
                wsd_steps: int | None = None, wsd_style: str = "exponential") -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py), in
    samples: num_steps, warmup, decay and wsd_steps are sample counts."""
    if warmup > 0 and num_steps <= warmup:
        return max_lr * float(num_steps) / float(warmup)
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == "inverse-square-root":
        warmup_steps = max(warmup, 1)
        n = max(num_steps, 1)
        return max(min_lr, max_lr * warmup_steps ** 0.5 / (n ** 0.5))
    decay_ratio = float(num_steps - warmup) / float(decay - warmup)
    delta_lr = max_lr - min_lr
    if style == "WSD":
        anneal_start = decay - wsd_steps
        if num_steps <= anneal_start:
            coeff = 1.0
        else:
            r = float(num_steps - anneal_start) / float(wsd_steps)
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * math.pow(0.5, r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    else:
        coeff = 1.0 - decay_ratio if style == "linear" else 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    return min_lr + coeff * delta_lr


@pytest.mark.parametrize("wsd_style", ["exponential", "linear", "cosine", "minus_sqrt"])
def test_wsd_equals_megatron(wsd_style):
    B = 8
    cfg = lr_config(parse_args([*BASE, "--lr", "3e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10",
                                "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30", "--lr-wsd-decay-style",
                                wsd_style, "--global-batch-size", str(B)], "gpt"), B)
    assert (cfg.decay_style, cfg.wsd_decay_style, cfg.wsd_decay_iters) == ("WSD", wsd_style, 30)
    for t in range(110):
        want = megatron_lr((t + 1) * B, max_lr=3e-3, min_lr=1e-4, warmup=10 * B, decay=100 * B, style="WSD",
                           wsd_steps=30 * B, wsd_style=wsd_style)
        assert lr_at(cfg, t) == pytest.approx(want, rel=1e-12, abs=1e-15), t
    assert lr_at(cfg, 69) == pytest.approx(3e-3)  # stable until the anneal starts at 70
    assert lr_at(cfg, 99) == pytest.approx(1e-4)  # the anneal ends at min_lr


@pytest.mark.parametrize("warmup", [0, 5])
def test_inverse_square_root_equals_megatron(warmup):
    B = 4
    cfg = lr_config(parse_args([*BASE, "--lr", "1e-3", "--min-lr", "2e-5", "--lr-warmup-iters", str(warmup),
                                "--lr-decay-style", "inverse-square-root", "--global-batch-size", str(B)], "gpt"), B)
    for t in range(105):
        want = megatron_lr((t + 1) * B, max_lr=1e-3, min_lr=2e-5, warmup=warmup * B, decay=100 * B,
                           style="inverse-square-root")
        assert lr_at(cfg, t) == pytest.approx(want, rel=1e-12), t


def test_sample_based_wsd_equals_megatron():
    B = 4
    args = parse_args([a for a in BASE if a not in ("--train-iters", "100")] + [
        "--train-samples", "400", "--lr-warmup-samples", "40", "--lr-decay-style", "WSD",
        "--lr-wsd-decay-samples", "120", "--lr-wsd-decay-style", "linear", "--global-batch-size", str(B)], "gpt")
    cfg = lr_config(args, B)
    for t in range(100):
        want = megatron_lr((t + 1) * B, max_lr=1e-3, min_lr=0.0, warmup=40, decay=400, style="WSD", wsd_steps=120,
                           wsd_style="linear")
        assert lr_at(cfg, t) == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("extra, message", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "101"], "--lr-wsd-decay-iters 101 must be in"),
    (["--lr-wsd-decay-samples", "10"], "--lr-wsd-decay-samples needs --train-samples"),
])
def test_bad_wsd(extra, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*extra)


def test_lr_config_defaults_unchanged():
    assert LRConfig(lr=1.0, decay_iters=10).wsd_decay_style == "exponential"
    assert lr_at(LRConfig(lr=1.0, decay_iters=10, decay_style="linear"), 4) == pytest.approx(0.5)


# --------------------------------------------------------------------------- through the CLI
MOCK_RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--global-batch-size 8 --train-iters 6 --lr 1e-3 --lr-decay-style WSD --lr-wsd-decay-iters 2 "
            "--lr-wsd-decay-style cosine --log-interval 3 --eval-interval 1000 --eval-iters 0 --device cpu "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 100 --make-vocab-size-divisible-by 8 "
            "--eod-mask-loss --reset-position-ids --reset-attention-mask --log-params-norm "
            "--log-num-zeros-in-grad --log-throughput --timing-log-level 2 --log-timers-to-tensorboard "
            "--tensorboard-log-interval 2 --attention-softmax-in-fp32 --no-masked-softmax-fusion "
            "--no-bias-gelu-fusion --empty-unused-memory-level 1 --profile --use-cpu-initialization "
            "--no-bias-dropout-fusion --timing-log-option minmax --overlap-grad-reduce --overlap-param-gather "
            "--use-flash-attn --num-workers 2").split()


def test_a_ported_megatron_script_trains_on_mock_data(tmp_path):
    """Every flag above accepted in one 2-stage, 2-replica run with no data file; the printed params norm equals
    the norm of the weights it saved (replicas and the tied embedding counted once; checked by hand at t = 2 too),
    and the lr follows Megatron's WSD."""
    from e2e import read_metrics, torchrun

    from megatron_2bw.export.checkpoints import load_checkpoint

    save, metrics, cache = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "cache"
    res = torchrun("pretrain_gpt.py", [*MOCK_RUN, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                       "--save", str(save), "--metrics-file", str(metrics), "--data-cache-path",
                                       str(cache)], nproc=4)  # d = 2, w = 2: replicas and the tied copy count once
    assert res.returncode == 0, res.describe()
    lines = [ln for ln in res.output.splitlines() if " iteration " in ln and "consumed samples" in ln]
    assert len(lines) == 2 and all("params norm: " in ln for ln in lines), res.describe()
    assert os.listdir(cache), "no index cached under --data-cache-path"
    train = [r for r in read_metrics(str(metrics)) if r["type"] == "train"]
    norms = {r["iteration"]: r["params_norm"] for r in train if "params_norm" in r}
    assert sorted(norms) == [2, 5]
    ex, _ = load_checkpoint(str(save))
    assert ex.cfg.padded_vocab_size(1) == 104 and ex.cfg.vocab_size == 101  # NullTokenizer: 100 ids + eod
    full = math.sqrt(sum(float(w.double().pow(2).sum()) for w in ex.weights.values()))
    assert norms[5] == pytest.approx(full, rel=1e-6)
    assert f"params norm: {norms[5]:.3f} |" in lines[-1]
    for r in train:  # lr of the update made by step t: Megatron's WSD at (t + 1) * B samples
        want = megatron_lr((r["iteration"] + 1) * 8, max_lr=1e-3, min_lr=0.0, warmup=0, decay=48, style="WSD",
                           wsd_steps=16, wsd_style="cosine")
        assert r["lr"] == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert all(math.isfinite(r["loss"]) for r in train)


def test_unknown_flag_hints_only_close_spellings():
    from megatron_2bw.cli import build_parser
    from megatron_2bw.yaml_cfg import explain_unrecognized

    p = build_parser("gpt")
    hint = lambda flag: explain_unrecognized(f"unrecognized arguments: {flag}", p)  # noqa: E731
    # Megatron flags this trainer lacks: no misleading hint (--async-save once pointed at --save)
    assert hint("--ckpt-fully-parallel-load").startswith(  # a known Megatron flag: the documented line (issue 45)
        "Megatron flag not supported by megatron_2bw: --ckpt-fully-parallel-load (")
    assert hint("--use-dist-ckpt") == "unrecognized argument --use-dist-ckpt (see --help)"
    assert hint("--trian-iters") == "unrecognized argument --trian-iters (did you mean --train-iters?)"
    assert hint("--hidden") == "unrecognized argument --hidden (did you mean --hidden-size?)"
    assert hint("--micro-batch") == "unrecognized argument --micro-batch (did you mean --micro-batch-size?)"
    for flag in ("--log-throughput", "--profile", "--use-checkpoint-args", "--mock-data", "--data-cache-path",
                 "--async-save", "--ckpt-format"):
        assert flag in p._option_string_actions  # noqa: SLF001 - accepted now


def test_use_checkpoint_args_takes_the_shape_from_the_checkpoint(tmp_path):
    from e2e import PY, REPO, clean_env, run

    gpt = os.path.join(REPO, "pretrain_gpt.py")
    save = str(tmp_path / "ckpt")
    shape = "--num-layers 2 --hidden-size 48 --num-attention-heads 4 --seq-length 16 --make-vocab-size-divisible-by 16"
    rest = ("--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --eval-iters 0 --device cpu "
            "--mock-data").split()
    first = run([PY, gpt, *shape.split(), *rest, "--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
                 "--save", save], env=clean_env(), timeout=180)
    assert first.returncode == 0, first.describe()
    again = run([PY, gpt, *rest, "--train-iters", "4", "--override-resumed-settings", "--load", save, "--save", save,
                 "--use-checkpoint-args", "--validate-only"], env=clean_env(), timeout=120)
    assert again.returncode == 0, again.describe()
    assert ("--num-layers 2 --hidden-size 48 --ffn-hidden-size 192 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --make-vocab-size-divisible-by 16") in again.output, again.describe()
    assert "--tokenizer-type NullTokenizer" in again.output and "--vocab-size 60" in again.output
    want = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=4, seq_length=16, vocab_size=61)
    assert f"GPT {want.num_parameters() / 1e6:.2f}M parameters" in again.stdout and "resuming from iteration 2" in \
        again.stdout, again.describe()
    given = run([PY, gpt, *rest, "--hidden-size", "64", "--load", save, "--save", save, "--use-checkpoint-args",
                 "--validate-only"], env=clean_env(), timeout=120)  # a given flag wins, and the shape check refuses it
    assert given.returncode == 2 and "has hidden_size=48 but this run has hidden_size=64" in given.stderr, \
        given.describe()
    bare = run([PY, gpt, *rest, "--use-checkpoint-args", "--tokenizer-type", "NullTokenizer", "--vocab-size", "6"],
               env=clean_env(), timeout=60)
    assert bare.returncode == 2 and bare.stderr.strip() == \
        "error: --use-checkpoint-args needs --load DIR holding a checkpoint", bare.describe()


def test_a_typo_under_plain_torchrun_is_one_line():
    """Not one line per rank plus torchrun's ChildFailedError traceback and failure table."""
    from e2e import torchrun

    res = torchrun("pretrain_gpt.py", ["--micro-batch-szie", "2", "--lr", "1e-3"], nproc=4, real=True)
    lines = [ln for ln in res.output.splitlines() if ln.strip() and "OMP_NUM_THREADS" not in ln and set(ln) != {"*"}]
    assert res.returncode != 0 and lines == [
        "error: unrecognized argument --micro-batch-szie (did you mean --micro-batch-size?)"], res.describe()


@pytest.mark.parametrize("rank, validate_only, env, shown", [
    (0, False, None, True), (1, False, None, False), (3, True, None, False), (0, True, None, True),
    (0, True, "1", False),  # scripts/run_local.sh's validation pass: the run's rank 0 prints them
])
def test_startup_warnings_print_once(rank, validate_only, env, shown, monkeypatch, capsys):
    import logging

    from megatron_2bw.training import launch
    from megatron_2bw.training.metrics import setup_logging

    if env is None:
        monkeypatch.delenv(launch.QUIET_ENV, raising=False)
    else:
        monkeypatch.setenv(launch.QUIET_ENV, env)
    setup_logging(rank)
    level = logging.getLogger().level
    with launch.startup_warnings(rank, validate_only):
        logging.getLogger("megatron_2bw.data.build").warning("the test split holds 67 tokens")
        logging.getLogger("megatron_2bw").error("a real error")
    assert logging.getLogger().level == level
    err = capsys.readouterr().err
    assert ("the test split holds 67 tokens" in err) == shown and "a real error" in err
    assert 'MEGATRON_2BW_VALIDATE_QUIET=1' in open(os.path.join(os.path.dirname(__file__), "..", "scripts",
                                                                "run_local.sh")).read()


def test_hf_export_writes_the_tokenizer_files(tmp_path):
    """Issue 19 papercut: the HF export carries the run's tokenizer where transformers looks for it."""
    import json as _json

    from megatron_2bw.export.hf_tokenizer import write_tokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s"]
    (tmp_path / "v.txt").write_text("\n".join(vocab) + "\n")
    out = tmp_path / "bert"
    out.mkdir()
    note, eod = write_tokenizer(str(out), {"tokenizer_type": "BertWordPieceLowerCase",
                                           "vocab_file": str(tmp_path / "v.txt")})
    assert note == "with its BertWordPieceLowerCase tokenizer" and eod == 3  # [SEP] is BERT's eod
    assert (out / "vocab.txt").read_text().split() == vocab
    assert _json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is True
    note, eod = write_tokenizer(str(out), {"tokenizer_type": "GPT2BPETokenizer",
                                           "vocab_file": str(tmp_path / "no.json"),
                                           "merge_file": str(tmp_path / "no.txt")})
    assert note.startswith("tokenizer not written (--vocab-file") and eod is None
    assert write_tokenizer(str(out), {})[1] is None


def test_data_cache_path_reuses_the_sample_index(tmp_path, monkeypatch):
    """--data-cache-path: the first build writes the index, the next loads it (no rebuild) and yields the same
    samples; another seed is another cache entry. Mock documents are Megatron's (counting up, eod last)."""
    from megatron_2bw.data.gpt_dataset import GPTDataset
    from megatron_2bw.data.mock import MockDocuments

    docs = MockDocuments(vocab_size=50, eod=49, documents=200, max_length=40)
    d0 = docs.get(0).tolist()
    assert d0 == list(range(1, len(d0))) + [49]  # 1, 2, ..., eod
    assert docs.get(0, 1, 2).tolist() == d0[1:3]
    assert max(int(docs.get(i).max()) for i in range(200)) <= 49
    cache = tmp_path / "cache"
    first = GPTDataset(docs, np.arange(150), 16, 300, seed=7, cache_dir=str(cache))
    names = sorted(os.listdir(cache))
    assert len(names) == 2 and names[0].endswith("-GPTDataset-description.json") and names[1].endswith("-index.npz")
    monkeypatch.setattr(GPTDataset, "_build", staticmethod(lambda *a: pytest.fail("rebuilt despite the cache")))
    again = GPTDataset(docs, np.arange(150), 16, 300, seed=7, cache_dir=str(cache))
    assert again.cache_file == first.cache_file
    assert all(np.array_equal(first[i]["tokens"], again[i]["tokens"]) for i in range(0, 300, 7))
    monkeypatch.undo()
    plain = GPTDataset(docs, np.arange(150), 16, 300, seed=7)  # no cache: the same index built in memory
    assert all(np.array_equal(first[i]["tokens"], plain[i]["tokens"]) for i in range(0, 300, 7))
    GPTDataset(docs, np.arange(150), 16, 300, seed=8, cache_dir=str(cache))
    assert len(os.listdir(cache)) == 4


def test_tensorboard_log_interval_and_timers():
    from megatron_2bw.training.metrics import Metrics

    class Writer:
        def __init__(self):
            self.calls = []

        def scalars(self, prefix, values, step):
            self.calls.append((step, sorted(values)))

        def close(self):
            pass

    m = Metrics(path=None, tensorboard_dir=None, train_iters=6, start_iter=0, progress=False,
                tensorboard_log_interval=2, log_timers=True)
    w = Writer()
    m.writers = [w]
    for it in range(6):
        m.train_step({"iteration": it, "loss": 1.0, "lr": 1e-3, "step_time_s": 0.5, "params_norm": 3.0})
    assert [c[0] for c in w.calls] == [2, 4, 6]  # the 1-based iteration, every 2nd
    assert w.calls[0][1] == ["loss", "lr", "params_norm", "step_time_s"]
