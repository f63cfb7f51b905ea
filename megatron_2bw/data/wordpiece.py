"""BERT WordPiece tokenization with the semantics of Megatron-LM's ``BertWordPiece*`` tokenizers.

Megatron tokenizes BERT text with Google's original ``FullTokenizer``; the fast Hugging Face
tokenizer differs from it in ways that change the data: it matches ``[SEP]`` and the other
special tokens written inside a document (a false document boundary), it gives ``[UNK]`` to
words of 101-200 characters (Megatron's limit is 200), and its lower-casing is per character
(a final capital sigma becomes σ, where Python's ``str.lower`` gives ς). This module follows
the original rules step by step:

1. drop NUL, U+FFFD and control characters; every whitespace character becomes a space;
2. put spaces around CJK ideographs; split on whitespace;
3. per word, when lower-casing: ``str.lower()`` then NFD with combining marks (Mn) removed;
4. split every punctuation character (Unicode P*, plus all non-alphanumeric ASCII) off;
5. greedy longest-match-first WordPiece per word (``##`` continuations), ``[UNK]`` for a word
   of more than 200 characters or one the vocabulary cannot cover.

No text is ever matched against special tokens: a ``[SEP]`` in a document is ``[``, ``sep``, ``]``.
"""

from __future__ import annotations

import functools
import unicodedata
from typing import Sequence

MAX_INPUT_CHARS_PER_WORD = 200  # Megatron's (Google BERT's) limit; Hugging Face's default is 100
UNK = "[UNK]"
_CACHE_LIMIT = 1 << 20  # words; the cache is cleared when it grows past this

# Kinds of input characters for step 1-2.
_KEEP, _DROP, _SPACE, _CJK = 0, 1, 2, 3
_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


@functools.lru_cache(maxsize=1 << 16)
def _kind(ch: str) -> int:
    if ch in " \t\n\r":
        return _SPACE
    cp = ord(ch)
    cat = unicodedata.category(ch)
    if cp == 0 or cp == 0xFFFD or cat in ("Cc", "Cf"):
        return _DROP
    if cat == "Zs":
        return _SPACE
    if any(lo <= cp <= hi for lo, hi in _CJK_RANGES):
        return _CJK
    return _KEEP


@functools.lru_cache(maxsize=1 << 16)
def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _clean(text: str) -> str:
    """Steps 1-2 up to the whitespace split."""
    out = []
    for ch in text:
        kind = _kind(ch)
        if kind == _KEEP:
            out.append(ch)
        elif kind == _SPACE:
            out.append(" ")
        elif kind == _CJK:
            out.append(f" {ch} ")
    return "".join(out)


def _strip_accents(word: str) -> str:
    if word.isascii():
        return word
    return "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")


def _split_punctuation(word: str) -> list[str]:
    pieces: list[str] = []
    current: list[str] = []
    for ch in word:
        if _is_punctuation(ch):
            if current:
                pieces.append("".join(current))
                current = []
            pieces.append(ch)
        else:
            current.append(ch)
    if current:
        pieces.append("".join(current))
    return pieces


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """Steps 1-4: words and punctuation marks, before WordPiece."""
    pieces: list[str] = []
    for word in _clean(text).split():
        if lower_case:
            word = _strip_accents(word.lower())
        pieces.extend(_split_punctuation(word))
    return " ".join(pieces).split()


def wordpiece(word: str, vocab: dict[str, int], max_chars: int = MAX_INPUT_CHARS_PER_WORD) -> list[str]:
    """Step 5 for one word: longest vocabulary prefix first, then ``##`` continuations."""
    if len(word) > max_chars:
        return [UNK]
    pieces = []
    start, n = 0, len(word)
    while start < n:
        end = n
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        else:
            return [UNK]
        pieces.append(piece)
        start = end
    return pieces


def load_vocab(path: str) -> dict[str, int]:
    """Token -> line number, each line stripped of surrounding whitespace (a repeated token keeps
    its last line, and the vocabulary size is the number of distinct tokens, as in Megatron)."""
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index
    return vocab


class WordPiece:
    """Text -> ids and back for one vocabulary file and casing."""

    def __init__(self, vocab: dict[str, int], lower_case: bool) -> None:
        self.vocab = vocab
        self.lower_case = lower_case
        self.inv_vocab = {i: t for t, i in vocab.items()}
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for word in basic_tokenize(text, self.lower_case):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                word_ids = cache[word] = [self.vocab[p] for p in wordpiece(word, self.vocab)]
            ids.extend(word_ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Tokens joined by spaces, ``##`` continuations glued, BERT's punctuation clean-up."""
        text = " ".join(self.inv_vocab[int(i)] for i in ids).replace(" ##", "").strip()
        for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                              (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
            text = text.replace(before, after)
        return text
