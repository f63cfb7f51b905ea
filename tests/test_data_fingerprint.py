"""The data records its tokenizer, and a checkpoint its data and tokenizer (issue 19, items 2 and 6).

- data made with a 400-piece tokenizer and trained with a 512-piece one (every id fits): one ``error:``
  line naming both, exit 2, before anything trains (the newcomer's silent case);
- data replaced at the same path between a save and a resume: refused unless ``--override-resumed-settings``;
- a tokenizer replaced at the same path (data without a sidecar): refused at the resume the same way.
"""

from __future__ import annotations

import os
import shutil

from e2e import PY, REPO, corpus, run, tool, train_args  # noqa: F401

from megatron_2bw.data.fingerprint import read_sidecar, sidecar_path, tokenizer_fingerprint
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizers import build_tokenizer

GPT = os.path.join(REPO, "pretrain_gpt.py")


def _preprocess(jsonl: str, prefix: str, model: str) -> str:
    """What tools/preprocess_data.py does (its library call, in-process: no interpreter start-up)."""
    tok = build_tokenizer("SentencePieceTokenizer", model)
    return preprocess_jsonl(jsonl, prefix, tok, append_eod=True, progress=False).prefixes["text"]


def _args(corpus, data: str, model: str, *extra: str) -> list[str]:  # noqa: F811
    args = train_args(corpus, preset="gpt-tiny", schedule="flush", iters=4, micro=2, global_batch=4, extra=extra)
    at = args.index("--data-path")
    args[at + 1] = data
    args[args.index("--tokenizer-model") + 1] = model
    return args


def _errors(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


def test_sidecar_records_the_tokenizer(corpus, tmp_path):  # noqa: F811
    data = _preprocess(os.path.join(corpus.dir, "corpus.jsonl"), str(tmp_path / "small"), corpus.small_model)
    made = read_sidecar(data)
    small = tokenizer_fingerprint(build_tokenizer("SentencePieceTokenizer", corpus.small_model))
    assert made["vocab_size"] == small["vocab_size"] == 400 and made["vocab_sha256"] == small["vocab_sha256"]
    assert made["tokenizer_type"] == "SentencePieceTokenizer"
    big = tokenizer_fingerprint(build_tokenizer("SentencePieceTokenizer", corpus.model))
    assert big["vocab_sha256"] != small["vocab_sha256"] and big["vocab_size"] == 512


def test_larger_vocabulary_tokenizer_is_refused(corpus, tmp_path):  # noqa: F811
    data = _preprocess(os.path.join(corpus.dir, "corpus.jsonl"), str(tmp_path / "small"), corpus.small_model)
    res = run([PY, GPT, *_args(corpus, data, corpus.model)], timeout=180)
    assert res.returncode == 2, res.describe()
    (line,) = _errors(res)
    assert line.startswith(f"error: data {data} was made with SentencePieceTokenizer, vocabulary 400, sha256 ") and \
        "but this run's tokenizer is SentencePieceTokenizer, vocabulary 512, sha256 " in line, line
    assert "Traceback" not in res.output


def test_data_or_tokenizer_replaced_between_save_and_resume(corpus, tmp_path):  # noqa: F811
    src = os.path.join(corpus.dir, "corpus.jsonl")
    half = str(tmp_path / "half.jsonl")
    with open(src, encoding="utf-8") as f, open(half, "w", encoding="utf-8") as g:
        lines = f.readlines()
        g.writelines(lines[: len(lines) // 2])
    model = str(tmp_path / "tok.model")
    shutil.copy(corpus.model, model)
    data = _preprocess(src, str(tmp_path / "d"), model)
    save = str(tmp_path / "ckpt")
    ckpt = ("--save", save, "--load", save)
    first = run([PY, GPT, *_args(corpus, data, model, *ckpt)], timeout=180)
    assert first.returncode == 0, first.describe()

    _preprocess(half, str(tmp_path / "d"), model)  # other documents at the same path, same tokenizer
    again = run([PY, GPT, *_args(corpus, data, model, *ckpt, "--validate-only")], timeout=180)
    assert again.returncode == 2, again.describe()
    (line,) = _errors(again)
    assert f"error: resuming {save} at iteration 4: data {data} changed since the checkpoint (.bin " in line, line
    assert line.endswith("give the data and tokenizer of the checkpoint, or --override-resumed-settings to resume "
                         "anyway"), line
    forced = run([PY, GPT, *_args(corpus, data, model, *ckpt, "--validate-only", "--override-resumed-settings")],
                 timeout=180)
    assert forced.returncode == 0 and "--override-resumed-settings: resuming with data" in forced.stderr, \
        forced.describe()

    _preprocess(src, str(tmp_path / "d"), model)  # the original data back (the same bytes)
    os.remove(sidecar_path(data))  # as data made before sidecars existed
    # another tokenizer of the same size at the same path: the model's shape fits, the pieces do not
    tool("train_tokenizer.py", "--input", half, "--vocab-size", "512", "--model-prefix", str(tmp_path / "other"))
    shutil.copy(str(tmp_path / "other.model"), model)
    swapped = run([PY, GPT, *_args(corpus, data, model, *ckpt, "--validate-only")], timeout=180)
    assert swapped.returncode == 2, swapped.describe()
    (line,) = _errors(swapped)
    assert f"error: resuming {save} at iteration 4: tokenizer SentencePieceTokenizer, vocabulary 512, sha256 " in line \
        and "-> SentencePieceTokenizer, vocabulary 512, sha256 " in line, line
