"""Which tokenizer made a dataset, and which data and tokenizer a checkpoint was trained on.

A tokenizer with a larger vocabulary than the data's trains without a word (every id fits, the
meanings do not), and data or a tokenizer replaced at the same paths between a save and a resume
drifts the losses silently. So:

* ``tools/preprocess_data.py`` writes ``PREFIX.tokenizer.json`` beside ``PREFIX.bin/.idx``: the
  tokenizer type, its vocabulary size and the SHA-256 of its vocabulary (the pieces in id order);
  the trainer compares it with its own tokenizer at start-up (one line naming both). Data made
  before sidecars existed is not checked.
* a checkpoint records both fingerprints (:func:`run_fingerprints`: the tokenizer's, and per
  dataset the ``.bin`` size and a SHA-256 of the ``.idx``); a resume refuses a change unless
  ``--override-resumed-settings``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from ..errors import ConfigError

SIDECAR_SUFFIX = ".tokenizer.json"
SIDECAR_FORMAT = "megatron_2bw-tokenizer-v1"
_IDX_WHOLE = 256 << 20  # an .idx up to this size is hashed whole; a larger one by its first and last 64 MiB
_IDX_PART = 64 << 20


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """{tokenizer_type, vocab_size, vocab_sha256} of a ``data.tokenizers.Tokenizer``."""
    pieces = tokenizer.pieces()
    digest = hashlib.sha256(json.dumps(pieces, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
    build = getattr(tokenizer, "_build_args", (type(tokenizer).__name__,))
    return {"tokenizer_type": build[0], "vocab_size": int(tokenizer.vocab_size), "vocab_sha256": digest}


def describe(fp: dict[str, Any]) -> str:
    return f"{fp.get('tokenizer_type')}, vocabulary {fp.get('vocab_size')}, sha256 {str(fp.get('vocab_sha256'))[:12]}"


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR_SUFFIX


def write_sidecar(prefix: str, fp: dict[str, Any]) -> str:
    """Write ``PREFIX.tokenizer.json`` atomically (temporary name, rename)."""
    path = sidecar_path(prefix)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": SIDECAR_FORMAT, **fp}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_sidecar(prefix: str) -> dict[str, Any] | None:
    """The sidecar of ``prefix``; None for data made before sidecars existed."""
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({type(e).__name__}: {e}); re-run tools/preprocess_data.py") from None
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT:
        raise ConfigError(f"{path} is not a {SIDECAR_FORMAT} file; re-run tools/preprocess_data.py")
    return doc


def _same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("tokenizer_type", "vocab_size", "vocab_sha256"))


def check_data_tokenizer(prefixes: Sequence[str], fp: dict[str, Any]) -> None:
    """Refuse data whose sidecar names another tokenizer than this run's."""
    for prefix in prefixes:
        made = read_sidecar(prefix)
        if made is not None and not _same_tokenizer(made, fp):
            raise ConfigError(
                f"data {prefix} was made with {describe(made)} but this run's tokenizer is {describe(fp)}: give "
                "the tokenizer the data was made with, or preprocess it again with this one (tools/preprocess_data.py)")


def data_fingerprint(prefix: str) -> dict[str, Any]:
    """{prefix, bin_bytes, idx_sha256} of an indexed dataset (reads at most 128 MiB)."""
    idx, binf = prefix + ".idx", prefix + ".bin"
    h = hashlib.sha256()
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        if size <= _IDX_WHOLE:
            h.update(f.read())
        else:
            h.update(f.read(_IDX_PART))
            f.seek(size - _IDX_PART)
            h.update(f.read(_IDX_PART))
            h.update(str(size).encode())
    return {"prefix": prefix, "bin_bytes": os.path.getsize(binf), "idx_sha256": h.hexdigest()}


def check_data_unchanged(fingerprints: Sequence[dict[str, Any]]) -> None:
    """Refuse data whose ``.idx`` or ``.bin`` changed since ``preprocess_data.py`` wrote it (its sidecar records
    both since issue 45): a bit flip that keeps the index consistent (a document boundary moved within range)
    would otherwise train on silently. ``fingerprints``: :func:`data_fingerprint` of each prefix."""
    for fp in fingerprints:
        made = read_sidecar(fp["prefix"])
        if made is None or "idx_sha256" not in made:
            continue
        if (made.get("bin_bytes"), made["idx_sha256"]) != (fp["bin_bytes"], fp["idx_sha256"]):
            raise ConfigError(
                f"data {fp['prefix']} changed since tools/preprocess_data.py wrote it (.bin {made.get('bin_bytes')} -> "
                f"{fp['bin_bytes']} bytes, .idx sha256 {str(made['idx_sha256'])[:12]} -> {fp['idx_sha256'][:12]}): "
                "a damaged or replaced file; preprocess it again")


def run_fingerprints(prefixes: Sequence[str], tokenizer) -> dict[str, Any]:
    """What a checkpoint records of its data and tokenizer."""
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "data": [data_fingerprint(p) for p in prefixes]}


def changed_fingerprints(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's fingerprints and this run's (nothing when it recorded none)."""
    if not isinstance(saved, dict):
        return []
    out = []
    if isinstance(saved.get("tokenizer"), dict) and not _same_tokenizer(saved["tokenizer"], now["tokenizer"]):
        out.append(f"tokenizer {describe(saved['tokenizer'])} -> {describe(now['tokenizer'])}")
    old = saved.get("data")
    if isinstance(old, list):
        if len(old) != len(now["data"]):
            out.append(f"{len(old)} datasets -> {len(now['data'])}")
        else:
            for a, b in zip(old, now["data"]):
                if (a.get("bin_bytes"), a.get("idx_sha256")) != (b["bin_bytes"], b["idx_sha256"]):
                    out.append(f"data {b['prefix']} changed since the checkpoint (.bin {a.get('bin_bytes')} -> "
                               f"{b['bin_bytes']} bytes, .idx sha256 {str(a.get('idx_sha256'))[:12]} -> "
                               f"{b['idx_sha256'][:12]})")
    return out


TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def recorded_tokenizer(args, fingerprints: dict | None = None) -> dict[str, Any]:
    """The tokenizer a checkpoint recorded: its flags from the stored arguments (a dict or Megatron's
    Namespace), and as ``fingerprint`` the tokenizer fingerprint of ``fingerprints`` (the trainer's torch
    files) or of the arguments' ``tokenizer_fingerprint`` (every format since it was added)."""
    a = args if isinstance(args, dict) else vars(args) if args is not None else {}
    tok: dict[str, Any] = {k: a[k] for k in TOKENIZER_FLAGS if a.get(k)}
    if tok.get("tokenizer_type") == "NullTokenizer" and a.get("vocab_size"):
        tok["vocab_size"] = a["vocab_size"]
    fp = fingerprints.get("tokenizer") if isinstance(fingerprints, dict) else None
    fp = fp if isinstance(fp, dict) else a.get("tokenizer_fingerprint")
    if isinstance(fp, dict):
        tok["fingerprint"] = dict(fp)
    return tok
