"""Tokenize a JSONL corpus into Megatron's indexed dataset (``PREFIX_text_document.bin/.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/demo \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod

Flags follow Megatron-LM's tools/preprocess_data.py. Bad input is one ``error: ...`` line on
stderr and exit status 2; the work itself is megatron_2bw.data.preprocess.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

from megatron_2bw.data.preprocess import preprocess_jsonl  # noqa: E402
from megatron_2bw.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron_2bw.errors import ConfigError  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes are bad input too: one line, exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default: text)")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", help="SentencePiece .model file or local HuggingFace tokenizer directory")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    p.add_argument("--merge-file", help="GPT-2 merges.txt")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: no pool)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
        result = preprocess_jsonl(
            args.input, args.output_prefix, tokenizer, args.json_keys, args.append_eod, args.workers,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    for key, prefix in result.prefixes.items():
        print(f"{key}: {result.documents[key]} documents, {result.tokens[key]} tokens -> {prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
