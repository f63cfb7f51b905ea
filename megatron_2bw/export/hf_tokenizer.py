"""The run's tokenizer beside a Hugging Face export, and its end-of-text id in ``config.json``.

A checkpoint names its tokenizer (``--tokenizer-type`` and its files, as given to the trainer). When
those files are still there, the export carries them in the layout transformers reads:

- ``HuggingFaceTokenizer``: the directory, through ``save_pretrained``;
- ``GPT2BPETokenizer``: ``vocab.json`` and ``merges.txt`` (``AutoTokenizer`` loads GPT-2's files by these names);
- ``BertWordPieceLowerCase``/``Case``: ``vocab.txt`` and a ``tokenizer_config.json`` with ``do_lower_case``;
- ``SentencePieceTokenizer``: the ``.model`` file as ``tokenizer.model`` (for ``sentencepiece``; transformers
  has no GPT-2 tokenizer class that reads it).

GPT's ``eos_token_id`` and ``bos_token_id`` become the tokenizer's eod (GPT-2's convention: one
``<|endoftext|>`` for both). A missing file is reported, never an error: the weights are the export.
"""

from __future__ import annotations

import json
import os
import shutil

from ..data.tokenizers import build_tokenizer
from ..errors import ConfigError


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
    if kind == "HuggingFaceTokenizer":
        tokenizer.hf.save_pretrained(path)
    elif kind == "GPT2BPETokenizer":
        _copy(tok["vocab_file"], path, "vocab.json")
        _copy(tok["merge_file"], path, "merges.txt")
    elif kind.startswith("BertWordPiece"):
        _copy(tok["vocab_file"], path, "vocab.txt")
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": kind == "BertWordPieceLowerCase"}, f,
                      indent=1)
    elif kind == "SentencePieceTokenizer":
        _copy(tok["tokenizer_model"], path, "tokenizer.model")
    else:
        return f"{kind}: no tokenizer files to write", tokenizer.eod
    return f"with its {kind} tokenizer", tokenizer.eod
