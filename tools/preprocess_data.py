"""Tokenize a JSONL corpus into Megatron's indexed dataset (``PREFIX_text_document.bin/.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/demo \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod

The input is JSONL: one JSON object per line, the document under a "text" key (or the keys named
by --json-keys). Flags follow Megatron-LM's tools/preprocess_data.py. The files are written under
temporary names and renamed at the end, so a failed run leaves an existing dataset as it was. Files
already at the output prefix are replaced only when they are this input's earlier output (their
``.tokenizer.json`` names the input), or with --overwrite.
Bad input is one ``error: ...`` line on stderr and exit status 2; the work itself is
megatron_2bw.data.preprocess.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_2bw.cli import OneLineParser, run_cli
from megatron_2bw.data.fingerprint import SIDECAR_SUFFIX, read_sidecar
from megatron_2bw.data.preprocess import output_prefix_for, preprocess_jsonl
from megatron_2bw.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.outputs import check_files


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help='JSONL file, one JSON object per line: {"text": "..."}')
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default: text)")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", help="SentencePiece .model file or local HuggingFace tokenizer directory")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    p.add_argument("--merge-file", help="GPT-2 merges.txt")
    p.add_argument("--vocab-size", type=int, help="--tokenizer-type NullTokenizer: ids 0..N-1 and eod N (Megatron)")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: no pool)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing files at the output prefix that are not this input's earlier output")
    return p.parse_args(argv)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse to replace a dataset that is not this input's earlier output (its sidecar names the input), unless
    --overwrite."""
    prefixes = [output_prefix_for(args.output_prefix, key) for key in args.json_keys]
    paths = [p + ext for p in prefixes for ext in (".bin", ".idx", SIDECAR_SUFFIX)]
    source = os.path.realpath(args.input)

    def own() -> bool:
        for prefix in prefixes:
            if os.path.exists(prefix + ".bin") or os.path.exists(prefix + ".idx"):
                try:
                    made = read_sidecar(prefix)
                except ConfigError:
                    return False
                if made is None or made.get("input") != source:
                    return False
        return True

    check_files(paths, overwrite=args.overwrite, flag="--output-prefix", is_own=own, tool="preprocess_data.py from "
                f"--input {args.input}")


def run(argv: list[str]) -> str:
    """Preprocess and return the summary (one line per JSON key)."""
    args = parse_args(argv)
    check_outputs(args)
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        raise ConfigError(f"--vocab-size is NullTokenizer's; {args.tokenizer_type} takes its vocabulary from its files")
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                args.vocab_size)
    try:
        result = preprocess_jsonl(args.input, args.output_prefix, tokenizer, args.json_keys, args.append_eod,
                                  args.workers)
    except OSError as e:  # a full disk or an unwritable directory: name the file and the errno text
        raise ConfigError(f"{e.filename or args.output_prefix}: {e.strerror or e}") from None
    return "\n".join(
        f"{key}: {result.documents[key]} documents, {result.tokens[key]} tokens -> {prefix}.bin/.idx"
        for key, prefix in result.prefixes.items()
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
