"""tools/generate.py reads every format the trainer writes and refuses a tokenizer other than the one the
checkpoint recorded (issue 37): with the small 400-piece tokenizer, a model trained on the 512-piece one
printed garbage with exit 0 (only a larger vocabulary was refused); on a torch_dist checkpoint it said it
"holds no mp_rank_* files"."""

from __future__ import annotations

from ckpt_runs import gpt_args, train
from e2e import shared_corpus
from test_export_tokenizer import TEXT
from test_offline_tools import one_error, tool

from megatron_2bw.data.fingerprint import describe, tokenizer_fingerprint
from megatron_2bw.data.tokenizers import build_tokenizer
from megatron_2bw.export.checkpoints import load_checkpoint
from megatron_2bw.export.generation import CachedGPT, Sampling, generate

PROMPT = "The module"


def _greedy(ex, tok, n: int = 6) -> str:
    """The continuation the model itself gives (its full state dict through CachedGPT), as generate.py prints it."""
    ids = tok.tokenize(PROMPT)
    new = generate(CachedGPT(ex.cfg, ex.weights), ids, n, Sampling(0.0), stop=tok.eod)
    return PROMPT + tok.detokenize(ids + new)[len(tok.detokenize(ids)):]


def _generate(capsys, load: str, *flags: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = tool("generate").main(["--load", load, "--prompt", PROMPT, "--max-new-tokens", "6", "--temperature", "0",
                                  "--device", "cpu", *flags])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_torch_dist_checkpoint_generates_exports_and_refuses_another_tokenizer(tmp_path, tmp_path_factory, capsys):
    corpus = shared_corpus(tmp_path_factory)
    save = str(tmp_path / "dist")
    res = train(gpt_args(iters=2, extra=(*corpus.data_args(), "--save", save, "--save-interval", "2",
                                         "--ckpt-format", "torch_dist")))
    assert res.returncode == 0, res.describe()
    # the start-up line names the choices that change the math (training/log_format.math_choices)
    choices = ("| model learned positions, GELU, LayerNorm | sequence parallel off | optimizer Adam (betas 0.9/0.999), "
               "clip 1 | schedule 2bw, 2BW compensation none | precision fp32 | kernels")
    assert choices in res.stdout + res.stderr, res.describe()
    tok = build_tokenizer("SentencePieceTokenizer", corpus.model)
    ex, _ = load_checkpoint(save)
    assert ex.tokenizer == {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": corpus.model,
                            "fingerprint": tokenizer_fingerprint(tok)}  # recorded by the trainer's torch_dist save
    # the poor case: generate.py reads it (no tokenizer flags: the recorded one)
    code, out, _ = _generate(capsys, save)
    assert code == 0 and out.splitlines() == [_greedy(ex, tok)]
    # the bad case: another tokenizer, whose vocabulary fits in the model's
    small = build_tokenizer("SentencePieceTokenizer", corpus.small_model)
    code = tool("generate").main(["--load", save, "--prompt", PROMPT, "--tokenizer-type", "SentencePieceTokenizer",
                                  "--tokenizer-model", corpus.small_model, "--device", "cpu"])
    one_error(capsys, code, f"error: the tokenizer given is not the one {save} was trained with: the model was "
                            f"trained with {describe(tokenizer_fingerprint(tok))}, these files are "
                            f"{describe(tokenizer_fingerprint(small))}")
    # the export carries the tokenizer: AutoTokenizer gives the training ids, generate.py on it the same text
    from transformers import AutoTokenizer

    hf_dir = str(tmp_path / "hf")
    assert tool("checkpoint_util").main(["--load-dir", save, "--save-dir", hf_dir, "--saver", "hf"]) == 0
    assert AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)(TEXT).input_ids == tok.tokenize(TEXT)
    code, out_hf, _ = _generate(capsys, hf_dir)
    assert code == 0 and out_hf == out
    code, _, err = _generate(capsys, hf_dir, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                             corpus.small_model)
    assert code == 2 and err.startswith(f"error: the tokenizer given is not the one {hf_dir} was trained with"), err


def test_megatron_and_mcore_checkpoints_refuse_another_tokenizer(tmp_path, tmp_path_factory, capsys):
    """The Megatron-LM and Megatron-Core formats record the fingerprint in their args too; a tokenizer of
    another type (GPT-2 BPE here) is refused by name."""
    from export_helpers import tiny

    from megatron_2bw.checkpoint.megatron_format import write_megatron_dir
    from megatron_2bw.export.mcore_format import write_mcore_dir

    corpus = shared_corpus(tmp_path_factory)
    tok = build_tokenizer("SentencePieceTokenizer", corpus.model)
    ex, _ = tiny("gpt", vocab_size=tok.vocab_size)
    ex.tokenizer = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": corpus.model,
                    "fingerprint": tokenizer_fingerprint(tok)}
    write_megatron_dir(str(tmp_path / "meg"), ex, t=2, d=2)
    write_mcore_dir(str(tmp_path / "mc"), ex, t=1, d=2)
    for root in (str(tmp_path / "meg"), str(tmp_path / "mc")):
        assert load_checkpoint(root)[0].tokenizer == ex.tokenizer
        code, out, _ = _generate(capsys, root)
        assert code == 0 and out.splitlines() == [_greedy(ex, tok)]
        code, _, err = _generate(capsys, root, "--tokenizer-model", corpus.small_model, "--tokenizer-type",
                                 "SentencePieceTokenizer")
        assert code == 2 and len(err.splitlines()) == 1 and "is not the one" in err, err
    vocab = tmp_path / "vocab.json"
    merges = tmp_path / "merges.txt"
    vocab.write_text('{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}')
    merges.write_text("#version: 0.2\na b\n")
    code = tool("generate").main(["--load", str(tmp_path / "meg"), "--prompt", "ab", "--tokenizer-type",
                                  "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)])
    one_error(capsys, code, f"error: the tokenizer given is not the one {tmp_path / 'meg'} was trained with: the model "
                            "was trained with SentencePieceTokenizer, not GPT2BPETokenizer")
