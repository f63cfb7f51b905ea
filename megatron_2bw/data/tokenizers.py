"""Tokenizers under Megatron's ``--tokenizer-type`` names, loaded from local files only.

One small interface (``vocab_size``, ``tokenize``, ``detokenize`` and the special ids) hides
SentencePiece, WordPiece and the transformers tokenizers from the data pipeline. Nothing is
ever downloaded: every file is checked to exist first (a missing one is a ConfigError naming
the flag), and transformers is always called with ``local_files_only=True``.

For the same vocabulary files, ids equal Megatron-LM's: GPT-2 BPE and BERT WordPiece read a
literal ``<|endoftext|>`` or ``[SEP]`` in a document as text (Megatron's tokenizers know no
special tokens inside text), and BERT follows Google's original rules (wordpiece.py).
SentencePiece and a Hugging Face directory keep their libraries' own handling of special
pieces written in the text, as Megatron's wrappers of them do (unlike Megatron's Hugging Face
wrapper, no BOS/EOS is added to each document here: ``--append-eod`` adds the eod).

A Tokenizer pickles as its constructor arguments, so a multiprocessing pool can rebuild it.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Sequence

from ..errors import ConfigError
from .wordpiece import WordPiece, load_vocab

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)

# Pieces the SentencePiece trainer (tools/train_tokenizer.py) reserves for BERT-style use.
SP_EOD, SP_PAD, SP_CLS, SP_SEP, SP_MASK = "<eod>", "[PAD]", "[CLS]", "[SEP]", "[MASK]"


class Tokenizer:
    """Text <-> token ids, plus special ids (None where the vocabulary has no such token)."""

    vocab_size: int
    eod: int | None = None
    pad: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None

    def __init__(self, build_args: tuple) -> None:
        self._build_args = build_args

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def pieces(self) -> list[str]:
        """The vocabulary in id order (what ``data/fingerprint.py`` hashes)."""
        raise NotImplementedError

    def __reduce__(self):
        return (build_tokenizer, self._build_args)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def _need_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path} does not exist")
    return path


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class SentencePieceTokenizer(Tokenizer):
    """A ``.model`` file. eod is the model's eos (tools/train_tokenizer.py names it ``<eod>``)."""

    def __init__(self, model_file: str, build_args: tuple) -> None:
        super().__init__(build_args)
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"--tokenizer-model {model_file} is not a SentencePiece model: "
                              f"{_first_line(e)}") from None
        sp = self._sp
        self.vocab_size = int(sp.get_piece_size())
        self.eod = self._special(sp.eos_id(), SP_EOD, "</s>")
        self.pad = self._special(sp.pad_id(), SP_PAD, "<pad>")
        self.cls = self._special(-1, SP_CLS, "<cls>")
        self.sep = self._special(-1, SP_SEP, "<sep>")
        self.mask = self._special(-1, SP_MASK, "<mask>")

    def _special(self, builtin: int, *pieces: str) -> int | None:
        """The model's built-in id if enabled, else the first of ``pieces`` present in the vocabulary."""
        if builtin >= 0:
            return int(builtin)
        for piece in pieces:
            i = self._sp.piece_to_id(piece)
            if self._sp.id_to_piece(i) == piece:
                return int(i)
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]


class HFTokenizer(Tokenizer):
    """A transformers tokenizer; ``tokenize`` adds no [CLS]/[SEP]/BOS (the datasets place those).

    With ``literal_specials`` a special token written in the text is tokenized as text (a copy
    of the backend with ``encode_special_tokens`` set, so ``hf`` itself is left unchanged).
    """

    def __init__(self, hf, build_args: tuple, eod: int | None, literal_specials: bool = False) -> None:
        super().__init__(build_args)
        hf.model_max_length = 1 << 60  # documents are never truncated here: silence length warnings
        self._hf = hf
        self._backend = None
        if literal_specials:
            from tokenizers import Tokenizer as RustTokenizer

            self._backend = RustTokenizer.from_str(hf.backend_tokenizer.to_str())
            self._backend.encode_special_tokens = True
        self.vocab_size = len(hf)
        self.eod = eod
        self.pad = hf.pad_token_id
        self.cls = hf.cls_token_id
        self.sep = hf.sep_token_id
        self.mask = hf.mask_token_id

    @property
    def hf(self):
        """The wrapped transformers tokenizer (e.g. to ``save_pretrained`` it)."""
        return self._hf

    def tokenize(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._hf.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        return [piece for piece, _ in sorted(self._hf.get_vocab().items(), key=lambda kv: kv[1])]


class BertWordPieceTokenizer(Tokenizer):
    """Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``; [SEP] doubles as eod."""

    def __init__(self, vocab_file: str, lower_case: bool, build_args: tuple) -> None:
        super().__init__(build_args)
        try:
            vocab = load_vocab(vocab_file)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--vocab-file {vocab_file}: cannot read a WordPiece vocabulary: "
                              f"{_first_line(e)}") from None
        for token in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"):
            if token not in vocab:
                raise ConfigError(f"--vocab-file {vocab_file} has no {token} token")
        self._wp = WordPiece(vocab, lower_case)
        self._vocab = vocab
        self.vocab_size = len(vocab)
        self.pad, self.cls, self.sep, self.mask = (vocab[t] for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]"))
        self.eod = self.sep

    def tokenize(self, text: str) -> list[int]:
        return self._wp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._wp.decode(ids)

    def pieces(self) -> list[str]:
        return [piece for piece, _ in sorted(self._vocab.items(), key=lambda kv: kv[1])]


def _takes_files(cls) -> bool:
    """transformers 4 tokenizers take ``vocab_file``; 5 takes ``vocab`` (and would silently
    build a placeholder vocabulary from an unknown ``vocab_file`` keyword)."""
    return "vocab_file" in inspect.signature(cls.__init__).parameters


def _load_gpt2(vocab_file: str, merge_file: str):
    """GPT-2 BPE from vocab.json + merges.txt. As Megatron (and the original GPT-2 code), the
    merges file's first line is its version header and its last is empty: both are skipped."""
    from transformers import GPT2TokenizerFast

    if _takes_files(GPT2TokenizerFast):  # transformers 4 reads the merges the same way
        return GPT2TokenizerFast(vocab_file=vocab_file, merges_file=merge_file)
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
    return GPT2TokenizerFast(vocab=vocab, merges=[m for m in merges if len(m) == 2])


class NullTokenizer(Tokenizer):
    """Megatron's ``NullTokenizer`` (``--vocab-size N``): text is space-separated ids, eod is ``N``,
    so the vocabulary has ``N + 1`` entries. No file: for ``--mock-data`` and pre-tokenized data."""

    def __init__(self, vocab_size: int | None, build_args: tuple) -> None:
        super().__init__(build_args)
        if vocab_size is None or vocab_size < 1:
            raise ConfigError(f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1, got {vocab_size}")
        self.vocab_size, self.eod = vocab_size + 1, vocab_size

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(x)) for x in ids)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
) -> Tokenizer:
    """The tokenizer Megatron's ``--tokenizer-type`` names, from local files (``vocab_size``: NullTokenizer's)."""
    args = (tokenizer_type, tokenizer_model, vocab_file, merge_file, vocab_size)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size, args)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_need_file(tokenizer_model, "--tokenizer-model", tokenizer_type), args)
    if tokenizer_type == "GPT2BPETokenizer":
        vocab = _need_file(vocab_file, "--vocab-file", tokenizer_type)
        merges = _need_file(merge_file, "--merge-file", tokenizer_type)
        try:
            hf = _load_gpt2(vocab, merges)
        except Exception as e:  # noqa: BLE001 - any load failure is bad input
            raise ConfigError(f"--vocab-file {vocab} / --merge-file {merges}: cannot load GPT-2 BPE: "
                              f"{_first_line(e)}") from None
        eod = hf.get_vocab().get("<|endoftext|>")
        return HFTokenizer(hf, args, eod, literal_specials=True)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab = _need_file(vocab_file, "--vocab-file", tokenizer_type)
        return BertWordPieceTokenizer(vocab, tokenizer_type == "BertWordPieceLowerCase", args)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                              "(a local tokenizer directory)")
        if not os.path.exists(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} does not exist (only local tokenizers are loaded)")
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any load failure is bad input
            raise ConfigError(f"--tokenizer-model {tokenizer_model}: cannot load a tokenizer: "
                              f"{_first_line(e)}") from None
        eod = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
        return HFTokenizer(hf, args, eod)
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
