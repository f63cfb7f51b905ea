"""JSONL text -> Megatron ``PREFIX_{key}_document.bin/.idx``, as Megatron's preprocess_data.py.

Each JSON line is one document; every ``--json-keys`` field is tokenized into one item (and
one document) of its own indexed dataset, with the end-of-document id appended under
``--append-eod``. Empty documents are skipped, as Megatron does. JSON is parsed and checked
in the calling process (so a bad line is reported by its number); only tokenization goes
to the worker pool, whose order-preserving ``imap`` keeps documents in input order, fed a
bounded window of batches at a time so memory stays flat on big inputs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterator, Sequence

import numpy as np

from ..errors import ConfigError
from .fingerprint import data_fingerprint, sidecar_path, tokenizer_fingerprint, write_sidecar
from .indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype, data_file_path, index_file_path
from .tokenizers import Tokenizer

BATCH_DOCS = 64
READ_AHEAD_BATCHES = 16  # per worker


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``PREFIX_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def _sidecar(made_with: dict, input_path: str, prefix: str) -> dict:
    """The sidecar's record: the tokenizer, the input, and the files as written (D04: the trainer compares)."""
    data = data_fingerprint(prefix)
    return {**made_with, "input": os.path.realpath(input_path), "bin_bytes": data["bin_bytes"],
            "idx_sha256": data["idx_sha256"]}


def check_input_file(path: str) -> None:
    """``--input`` is a JSONL file (P19: a directory is named as one, not as missing)."""
    if os.path.isdir(path):
        raise ConfigError(f"--input {path} is a directory: give one JSONL file (concatenate several with cat)")
    if not os.path.isfile(path):
        raise ConfigError(f"--input {path} does not exist")


def read_jsonl(path: str, json_keys: Sequence[str]) -> Iterator[tuple[int, int, dict[str, str]]]:
    """Yield (line number, bytes read, {key: text}) per non-blank line; bad input is a ConfigError."""
    check_input_file(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark, as some editors write
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(_json_error(path, lineno, line, e, json_keys)) from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            texts = {}
            for key in json_keys:
                if key not in obj:
                    raise ConfigError(f"{path}:{lineno}: no key {key!r} (from --json-keys); keys are {sorted(obj)}")
                if not isinstance(obj[key], str):
                    raise ConfigError(f"{path}:{lineno}: key {key!r} is a {type(obj[key]).__name__}, not a string")
                _refuse_lone_surrogates(obj[key], f"{path}:{lineno}: key {key!r}")
                texts[key] = obj[key]
            yield lineno, len(raw), texts


def _refuse_lone_surrogates(text: str, where: str) -> None:
    """JSON's ``\\ud800`` escapes can spell half a UTF-16 pair, which is no character: the tokenizers fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where} holds a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start} (half "
                          "of a UTF-16 pair, not a character): fix the text or drop the line") from None


def _json_error(path: str, lineno: int, line: str, e: json.JSONDecodeError, json_keys: Sequence[str]) -> str:
    """A line that does not even start like JSON is most likely plain text: say what the format is."""
    if line.lstrip()[:1] in ("{", "[", '"'):
        return f"{path}:{lineno}: invalid JSON: {e.msg} at column {e.colno}"
    example = json.dumps({json_keys[0] if json_keys else "text": "first document ..."})
    return (
        f"{path}:{lineno}: not JSON (the line starts {line.strip()[:20]!r}): the input must be JSONL, one JSON object "
        f"per line with the document under a key, e.g. {example}; choose the keys with --json-keys"
    )


def encode_document(tokenizer: Tokenizer, texts: dict[str, str], append_eod: bool) -> dict[str, list[int]]:
    """Token ids per key; an empty text stays empty (and gets no eod), as in Megatron."""
    out = {}
    for key, text in texts.items():
        ids = tokenizer.tokenize(text) if text else []
        if ids and append_eod:
            ids = list(ids) + [tokenizer.eod]
        out[key] = ids
    return out


# A batch: documents ({key: text}) and the number of input bytes they came from (for the bar).
Batch = tuple[list[dict[str, str]], int]
Encoded = tuple[list[dict[str, list[int]]], int]

# Worker-process state: set once per pool worker by its initializer, never in the parent.
_WORKER: dict = {}


def _init_worker(tokenizer: Tokenizer, append_eod: bool) -> None:
    _WORKER["tokenizer"], _WORKER["append_eod"] = tokenizer, append_eod


def _encode_batch(batch: Batch) -> Encoded:
    docs, nbytes = batch
    return [encode_document(_WORKER["tokenizer"], texts, _WORKER["append_eod"]) for texts in docs], nbytes


def _batches(records: Iterator[tuple[int, int, dict[str, str]]]) -> Iterator[Batch]:
    docs: list[dict[str, str]] = []
    nbytes = 0
    for _, size, texts in records:
        docs.append(texts)
        nbytes += size
        if len(docs) == BATCH_DOCS:
            yield docs, nbytes
            docs, nbytes = [], 0
    if docs:
        yield docs, nbytes


def _windows(batches: Iterator[Batch], n: int) -> Iterator[list[Batch]]:
    """Groups of ``n`` batches: bounds read-ahead, since ``Pool.imap`` would queue the whole input."""
    while window := list(islice(batches, n)):
        yield window


@dataclass
class PreprocessResult:
    """What was written: one dataset prefix per JSON key, and counts for the log line."""

    prefixes: dict[str, str]
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    texts: dict[str, int] = field(default_factory=dict)  # non-empty input texts (a tokenizer may encode one to nothing)


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer: Tokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenize ``input_path`` into one indexed dataset per key; ``workers == 1`` uses no pool.

    Files are written under temporary names and renamed into place at the end, so an error
    (or an empty corpus, refused) leaves any existing dataset at ``output_prefix`` unchanged, and
    a job reading the old files keeps its memory-mapped inodes.
    """
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if not json_keys:
        raise ConfigError("--json-keys needs at least one key")
    if append_eod and tokenizer.eod is None:
        raise ConfigError(f"--append-eod: tokenizer {tokenizer!r} has no end-of-document token")
    check_input_file(input_path)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    from tqdm import tqdm

    dtype = best_fitting_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    result = PreprocessResult(prefixes, {k: 0 for k in json_keys}, {k: 0 for k in json_keys}, {k: 0 for k in json_keys})
    builders: dict[str, IndexedDatasetBuilder] = {}
    bar = tqdm(
        total=os.path.getsize(input_path), unit="B", unit_scale=True, desc="preprocess",
        disable=not (progress and sys.stderr.isatty()),
    )
    try:
        for key, p in prefixes.items():
            builders[key] = IndexedDatasetBuilder(data_file_path(p), dtype)
        batches = _batches(_count_texts(read_jsonl(input_path, json_keys), result))
        if workers == 1:
            encoded = (([encode_document(tokenizer, t, append_eod) for t in docs], n) for docs, n in batches)
            _write(encoded, builders, result, bar)
        else:
            with mp.Pool(workers, initializer=_init_worker, initargs=(tokenizer, append_eod)) as pool:
                for window in _windows(batches, READ_AHEAD_BATCHES * workers):
                    _write(pool.imap(_encode_batch, window), builders, result, bar)
        _refuse_empty(input_path, result, tokenizer)
        made_with = _fingerprint(tokenizer)
        for key, builder in builders.items():
            if os.path.exists(sidecar_path(prefixes[key])):
                os.remove(sidecar_path(prefixes[key]))  # never an old tokenizer's record beside the new data
            builder.finalize(index_file_path(prefixes[key]))
            if made_with is not None:  # with the input it was made from (preprocess_data.py's own earlier output)
                write_sidecar(prefixes[key], _sidecar(made_with, input_path, prefixes[key]))
    finally:
        for builder in builders.values():
            builder.close()  # removes the temporary files of a failed run; existing datasets stay
        bar.close()
    return result


def _fingerprint(tokenizer: Tokenizer) -> dict | None:
    """The tokenizer's record for the data's sidecar (None for a tokenizer that cannot list its vocabulary)."""
    try:
        return tokenizer_fingerprint(tokenizer)
    except (NotImplementedError, AttributeError):
        return None


def _count_texts(records: Iterator[tuple[int, int, dict[str, str]]], result: PreprocessResult
                 ) -> Iterator[tuple[int, int, dict[str, str]]]:
    """``records`` unchanged, counting the non-empty texts of each key on the way."""
    for rec in records:
        for key, text in rec[2].items():
            if text:
                result.texts[key] = result.texts.get(key, 0) + 1
        yield rec


def _refuse_empty(input_path: str, result: PreprocessResult, tokenizer: Tokenizer | None = None) -> None:
    """An empty dataset would only fail later, blamed on --split: refuse it here, blaming the tokenizer when
    the text was there but encoded to no ids."""
    for key, count in result.documents.items():
        texts = result.texts.get(key, 0)
        if count == 0 and texts:
            raise ConfigError(
                f"the tokenizer {tokenizer!r} encoded all {texts} non-empty texts under key {key!r} of --input "
                f"{input_path} to no token ids: the tokenizer is broken or empty (check its files), not the corpus"
            )
        if count == 0:
            raise ConfigError(
                f"--input {input_path} has no non-empty text under key {key!r}: nothing to preprocess "
                f"(each line must be a JSON object like {{\"{key}\": \"document text\"}})"
            )


def _write(encoded: Iterator[Encoded], builders: dict[str, IndexedDatasetBuilder], result: PreprocessResult,
           bar) -> None:
    for docs, nbytes in encoded:
        bar.update(nbytes)
        for doc in docs:
            for key, ids in doc.items():
                if not ids:
                    continue
                builders[key].add_item(np.asarray(ids, dtype=np.int64))
                builders[key].end_document()
                result.documents[key] += 1
                result.tokens[key] += len(ids)
