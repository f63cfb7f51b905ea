"""Train a SentencePiece BPE tokenizer on a JSONL corpus: writes PREFIX.model and PREFIX.vocab.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8000 --model-prefix data/tok

The model reserves what the GPT and BERT pipelines need: ``<eod>`` is the model's eos (the
end-of-document id), ``[PAD]`` its pad, and ``[CLS] [SEP] [MASK]`` are user-defined
symbols. Byte fallback makes every string encodable and every round trip exact, and the
identity normalizer keeps text as written. Each paragraph (line of a document) is one
training sentence; at most ``--input-sentence-size`` of them are sampled, which keeps
training on a few MB to seconds. The files are written under temporary names and renamed; an existing
PREFIX.model is replaced only when this tool wrote it (its reserved pieces), or with --overwrite.
"""

from __future__ import annotations

import os
import sys
from typing import Iterator, Sequence

from megatron_2bw.cli import OneLineParser, run_cli
from megatron_2bw.data.preprocess import read_jsonl
from megatron_2bw.data.tokenizers import SP_CLS, SP_EOD, SP_MASK, SP_PAD, SP_SEP
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.outputs import check_files

MIN_VOCAB = 300  # 256 byte pieces + reserved symbols + some characters


def sentences(path: str, json_keys: Sequence[str]) -> Iterator[str]:
    """Non-empty paragraphs of every document, in file order."""
    for _, _, texts in read_jsonl(path, json_keys):
        for text in texts.values():
            for para in text.split("\n"):
                if para.strip():
                    yield para


def train(
    input_path: str, vocab_size: int, model_prefix: str, json_keys: Sequence[str] = ("text",),
    input_sentence_size: int = 300_000, num_threads: int = 1,
) -> str:
    """Train and return the path of the ``.model`` file."""
    import sentencepiece as spm

    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size} is too small: byte fallback alone needs 256 pieces "
                          f"(use >= {MIN_VOCAB})")
    # Read (and validate) the whole input before training starts, so a bad line is a clean error.
    corpus = list(sentences(input_path, json_keys))
    if not corpus:
        raise ConfigError(f"--input {input_path} has no text under --json-keys {' '.join(json_keys)}")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    tmp = f"{model_prefix}.tmp.{os.getpid()}"  # trained under a temporary name, renamed when both files exist
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus),
            model_prefix=tmp,
            model_type="bpe",
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            unk_id=0,
            eos_id=1,
            eos_piece=SP_EOD,
            pad_id=2,
            pad_piece=SP_PAD,
            bos_id=-1,
            user_defined_symbols=[SP_CLS, SP_SEP, SP_MASK],
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentence_length=1 << 16,
            num_threads=num_threads,
            minloglevel=2,
        )
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
        raise ConfigError(f"SentencePiece training failed: {first}") from None
    os.replace(tmp + ".vocab", model_prefix + ".vocab")
    os.replace(tmp + ".model", model_prefix + ".model")
    return model_prefix + ".model"


def is_own_model(model_prefix: str) -> bool:
    """Whether ``PREFIX.model`` is an earlier output of this tool (its reserved pieces at their ids)."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=model_prefix + ".model")
    except (OSError, RuntimeError):
        return False
    reserved = [SP_EOD, SP_PAD, SP_CLS, SP_SEP, SP_MASK]
    return sp.get_piece_size() > 5 and [sp.id_to_piece(i) for i in range(1, 6)] == reserved


def run(argv: list[str]) -> str:
    """Train from the command line; return the line naming the files written."""
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help='JSONL corpus, one JSON object per line: {"text": "..."}')
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--input-sentence-size", type=int, default=300_000, help="sample at most this many paragraphs")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--overwrite", action="store_true", help="replace PREFIX.model/.vocab not written by this tool")
    args = p.parse_args(argv)
    check_files([args.model_prefix + ".model", args.model_prefix + ".vocab"], overwrite=args.overwrite,
                flag="--model-prefix", is_own=lambda: is_own_model(args.model_prefix), tool="train_tokenizer.py")
    model = train(args.input, args.vocab_size, args.model_prefix, args.json_keys, args.input_sentence_size,
                  args.num_threads)
    return f"wrote {model} and {args.model_prefix}.vocab ({pieces_note(model, args.vocab_size)})"


def pieces_note(model: str, asked: int) -> str:
    """How many pieces the model has, and why when fewer than ``--vocab-size`` (K01: SentencePiece stops when
    the corpus has no more merges, hard_vocab_limit off, and said nothing)."""
    import sentencepiece as spm

    n = spm.SentencePieceProcessor(model_file=model).get_piece_size()
    if n >= asked:
        return f"{n} pieces"
    return (f"{n} pieces, fewer than --vocab-size {asked}: the corpus has no more merges to learn; "
            f"preprocess and train with this tokenizer (the model's vocabulary is {n}), or give more text")


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
