"""Generate text from a GPT checkpoint of any format (this trainer's torch or torch_dist, Megatron-LM v2.x,
Megatron-Core, or Hugging Face).

    python tools/generate.py --load ckpt --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --prompt "Once upon a time" --max-new-tokens 50

Greedy when --temperature is 0; otherwise samples with optional --top-k / --top-p filters,
reproducibly for a --seed. A key/value cache makes each new token cost one position. Tokens are
printed as they come; each prompt's continuation ends with a newline. Without tokenizer flags
the ones saved in the checkpoint are used (a Hugging Face export: its own tokenizer files); a tokenizer
other than the one the model was trained with (its name and fingerprint, as the checkpoint recorded
them) is refused in one line.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_2bw.cli import OneLineParser, run_cli
from megatron_2bw.data.fingerprint import tokenizer_fingerprint
from megatron_2bw.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.checkpoints import load_checkpoint
from megatron_2bw.export.generation import CachedGPT, Sampling, generate
from megatron_2bw.export.hf_tokenizer import changed_since


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint root, iteration dir, or Hugging Face model dir")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--prompt", action="append", default=[], help="repeatable")
    p.add_argument("--prompt-file", help="one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None
    if not prompts:
        raise ConfigError("give at least one --prompt or a --prompt-file")
    return prompts


def tokenizer_for(args: argparse.Namespace, saved: dict):
    """The tokenizer the flags name, else the one the checkpoint recorded; either must be the one the model was
    trained with (name and fingerprint, when the checkpoint recorded them)."""
    flags = {k: getattr(args, k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")}
    if not flags["tokenizer_type"] and saved.get("exported_dir"):  # a Hugging Face export: its own tokenizer files
        return build_tokenizer("HuggingFaceTokenizer", saved["exported_dir"])
    chosen = flags if flags["tokenizer_type"] else saved
    if not chosen.get("tokenizer_type"):
        raise ConfigError("the checkpoint records no tokenizer: give --tokenizer-type and its files")
    tok = build_tokenizer(chosen["tokenizer_type"], chosen.get("tokenizer_model"), chosen.get("vocab_file"),
                          chosen.get("merge_file"), chosen.get("vocab_size"))
    why = changed_since(_with_fingerprint(saved), tok)
    if why:
        given = ("the tokenizer given" if flags["tokenizer_type"] else
                 "the tokenizer files at the paths the checkpoint recorded")
        raise ConfigError(f"{given} is not the one {args.load} was trained with: {why}; give the training run's "
                          "tokenizer (or no tokenizer flags to use the one the checkpoint records)")
    return tok


def _with_fingerprint(saved: dict) -> dict:
    """``saved`` with a fingerprint: the recorded one, else (an older checkpoint) that of the recorded files if
    they are still there."""
    if saved.get("fingerprint") or not saved.get("tokenizer_type"):
        return saved
    try:
        tok = build_tokenizer(saved["tokenizer_type"], saved.get("tokenizer_model"), saved.get("vocab_file"),
                              saved.get("merge_file"), saved.get("vocab_size"))
        return {**saved, "fingerprint": tokenizer_fingerprint(tok)}
    except (ConfigError, NotImplementedError):
        return saved


def check_positions(encoded: list[list[int]], max_new_tokens: int, positions: int) -> None:
    """Every prompt plus --max-new-tokens fits the model's positions, checked before anything is printed
    (G05: not after streaming part of the answer; G09: the line names the prompt by number, not by its text)."""
    for i, ids in enumerate(encoded, start=1):
        if len(ids) + max_new_tokens > positions:
            which = f"prompt {i} of {len(encoded)}" if len(encoded) > 1 else "the prompt"
            raise ConfigError(f"{which} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                              f"{len(ids) + max_new_tokens} positions, more than the model's {positions}: shorten "
                              "it or lower --max-new-tokens")


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    prompts = read_prompts(args)
    ex, _ = load_checkpoint(args.load)
    tok = tokenizer_for(args, ex.tokenizer)
    if tok.vocab_size > ex.cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model only {ex.cfg.vocab_size}")
    encoded = [tok.tokenize(p) for p in prompts]
    check_positions(encoded, args.max_new_tokens, ex.cfg.max_position_embeddings)
    model = CachedGPT(ex.cfg, ex.weights, device=args.device, router=ex.router)
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        print(prompt, end="", flush=True)
        done = list(ids)

        def stream(token: int, done: list[int] = done) -> None:  # print the text the new token adds (in context)
            before = tok.detokenize(done)
            done.append(token)
            print(tok.detokenize(done)[len(before):], end="", flush=True)

        generate(model, ids, args.max_new_tokens, sampling, seed=args.seed + i, stop=tok.eod, on_token=stream)
        print(flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
