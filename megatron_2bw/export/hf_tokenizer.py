"""The run's tokenizer beside a Hugging Face export, and its end-of-text id in ``config.json``.

A checkpoint names its tokenizer (``--tokenizer-type`` and its files, as given to the trainer). When
those files are still there, the export carries them in the layout transformers reads:

- ``HuggingFaceTokenizer``: the directory, through ``save_pretrained``;
- ``GPT2BPETokenizer``: ``vocab.json`` and ``merges.txt`` and transformers' files naming GPT-2's tokenizer class
  (so a Llama-style model trained with it loads it too);
- ``BertWordPieceLowerCase``/``Case``: ``vocab.txt`` and a ``tokenizer_config.json`` with ``do_lower_case``;
- ``SentencePieceTokenizer``: the ``.model`` file as ``tokenizer.model`` (for ``sentencepiece``) and transformers'
  ``LlamaTokenizer`` converted from it (``tokenizer.json``, ``tokenizer_config.json``), whatever the model: the
  files ``train_tokenizer.py`` writes have Llama's SentencePiece settings (identity normalizer, dummy prefix,
  byte fallback, split digits), so the conversion keeps every space and gives the same ids; no BOS is added
  (the training data has none) and ``<eod>``/``[PAD]`` are its eos/pad tokens.

Every export also records, in :data:`RECORD`, which tokenizer the model was trained with (its
``--tokenizer-type`` and fingerprint, ``data/fingerprint.py``): ``tools/generate.py`` refuses another.

GPT's ``eos_token_id`` and ``bos_token_id`` become the tokenizer's eod (GPT-2's convention: one
``<|endoftext|>`` for both). A missing file is reported, never an error: the weights are the export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from ..data.fingerprint import describe, tokenizer_fingerprint
from ..data.tokenizers import build_tokenizer
from ..data.wordpiece import load_vocab
from ..errors import ConfigError

RECORD = "megatron_2bw_tokenizer.json"
WORDPIECE_MAX_CHARS = 200  # Google's (and Megatron's) longest word before [UNK]; transformers' default is 100


def _copy(src: str, dst_dir: str, name: str) -> None:
    shutil.copyfile(src, os.path.join(dst_dir, name))


def write_tokenizer(path: str, tok: dict) -> tuple[str, int | None]:
    """Copy the tokenizer ``tok`` (a checkpoint's tokenizer flags) into ``path``: (what was done, its eod id)."""
    kind = tok.get("tokenizer_type")
    if not kind:
        return "no tokenizer recorded in the checkpoint: none written", None
    try:
        tokenizer = build_tokenizer(kind, tok.get("tokenizer_model"), tok.get("vocab_file"), tok.get("merge_file"),
                                    tok.get("vocab_size"))
    except ConfigError as e:
        return f"tokenizer not written ({e})", None
    changed = changed_since(tok, tokenizer)
    if changed:
        write_record(path, tok)
        return f"tokenizer not written ({changed})", None
    if kind == "HuggingFaceTokenizer":
        tokenizer.hf.save_pretrained(path)
    elif kind == "GPT2BPETokenizer":  # tokenizer_config.json names GPT-2's class whatever the model type
        tokenizer.hf.save_pretrained(path)
        _copy(tok["vocab_file"], path, "vocab.json")
        _copy(tok["merge_file"], path, "merges.txt")
    elif kind.startswith("BertWordPiece"):
        _write_wordpiece(path, tok["vocab_file"], kind == "BertWordPieceLowerCase")
    elif kind == "SentencePieceTokenizer":
        _write_sentencepiece(path, tok["tokenizer_model"], tokenizer)
    else:
        return f"{kind}: no tokenizer files to write", tokenizer.eod
    write_record(path, {**tok, "fingerprint": tok.get("fingerprint") or tokenizer_fingerprint(tokenizer)})
    return f"with its {kind} tokenizer", tokenizer.eod


def changed_since(recorded: dict, tokenizer) -> str | None:
    """Why ``tokenizer`` is not the one ``recorded`` (a checkpoint's: name and fingerprint), or None."""
    fp = recorded.get("fingerprint")
    try:
        now = tokenizer_fingerprint(tokenizer)
    except NotImplementedError:  # NullTokenizer: no vocabulary to compare
        return None
    if recorded.get("tokenizer_type") and recorded["tokenizer_type"] != now["tokenizer_type"]:
        return f"the model was trained with {recorded['tokenizer_type']}, not {now['tokenizer_type']}"
    if isinstance(fp, dict) and not all(fp.get(k) == now.get(k) for k in ("vocab_size", "vocab_sha256")):
        return f"the model was trained with {describe(fp)}, these files are {describe(now)}"
    return None


def _write_wordpiece(path: str, vocab_file: str, lower: bool) -> None:
    """``vocab.txt`` and transformers' ``BertTokenizer`` of it, with Google's 200-character word limit."""
    from transformers import BertTokenizer  # noqa: PLC0415

    _copy(vocab_file, path, "vocab.txt")
    hf = BertTokenizer(vocab=dict(load_vocab(vocab_file)), do_lower_case=lower)
    hf.save_pretrained(path)
    _edit_json(os.path.join(path, "tokenizer.json"), ("model", "max_input_chars_per_word"), WORDPIECE_MAX_CHARS)
    _edit_json(os.path.join(path, "tokenizer_config.json"), ("do_lower_case",), lower)


def _write_sentencepiece(path: str, model_file: str, tokenizer) -> None:
    """``tokenizer.model`` and transformers' ``LlamaTokenizer`` converted from it (see the module's docstring)."""
    from transformers import LlamaTokenizer  # noqa: PLC0415

    try:  # transformers reads the model's settings through protobuf; without it it tries tiktoken and fails
        import google.protobuf  # noqa: F401, PLC0415
    except ImportError:
        raise ConfigError("the SentencePiece tokenizer's export to transformers needs protobuf, a dependency of "
                          "megatron_2bw: pip install 'protobuf>=3.20' (or pip install -e . again)") from None
    pieces = tokenizer.pieces()
    special = {name: pieces[i] for name, i in (("eos_token", tokenizer.eod), ("pad_token", tokenizer.pad))
               if i is not None}
    with tempfile.TemporaryDirectory() as src:
        _copy(model_file, src, "tokenizer.model")
        hf = LlamaTokenizer.from_pretrained(src, add_bos_token=False, add_eos_token=False, bos_token=None,
                                            local_files_only=True, **special)
    hf.save_pretrained(path)
    _copy(model_file, path, "tokenizer.model")


def _edit_json(path: str, keys: tuple[str, ...], value) -> None:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    node = doc
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)


def write_record(path: str, tok: dict) -> None:
    """Which tokenizer the exported model was trained with (generate.py compares it with the one it is given)."""
    keep = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size", "fingerprint")
    with open(os.path.join(path, RECORD), "w", encoding="utf-8") as f:
        json.dump({k: tok[k] for k in keep if tok.get(k) is not None}, f, indent=1)


def read_record(path: str) -> dict:
    """The tokenizer an export recorded (empty for an export without a record)."""
    try:
        with open(os.path.join(path, RECORD), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
