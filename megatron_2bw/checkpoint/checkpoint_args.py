"""``--use-checkpoint-args``: the model shape flags a run does not give, taken from its ``--load`` checkpoint.

As Megatron's ``load_args_from_checkpoint``: a flag given on the command line wins, a missing one
takes the checkpoint's value (its ``args``: ours, or a Megatron-LM file's). The tokenizer flags come
along when ``--tokenizer-type`` is not given. The layout (t, d) is not taken: a checkpoint of another
layout is refused later with the reshard command, as without this flag.
"""

from __future__ import annotations

import argparse
import os

from ..errors import ConfigError

# Megatron's non-forced shape arguments that this model family has
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
              "max_position_embeddings", "make_vocab_size_divisible_by", "layernorm_epsilon")
TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def checkpoint_args(load: str, save: str | None) -> tuple[dict, str]:
    """(the flat arguments stored in the newest checkpoint of ``load``, its file)."""
    import torch  # noqa: PLC0415

    from . import checkpointing  # noqa: PLC0415

    it = checkpointing.find_checkpoint(load, save)
    if it is None:
        raise ConfigError(f"--use-checkpoint-args: --load {load} holds no checkpoint yet")
    idir = checkpointing.iteration_dir(load, it)
    layout = checkpointing.saved_layout(idir)
    if layout is None:
        raise ConfigError(f"--use-checkpoint-args: {idir} holds no checkpoint file")
    path = checkpointing.checkpoint_path(load, it, 0, 0, layout[1])
    try:  # memory-mapped: only the arguments are read here (the resume verifies and loads its own file)
        try:
            sd = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
            sd = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt file
        raise ConfigError(f"--use-checkpoint-args: cannot read {path} ({str(e).splitlines()[0] if str(e) else e})") \
            from None
    saved = sd.get("args") if isinstance(sd, dict) else None
    saved = vars(saved) if isinstance(saved, argparse.Namespace) else saved
    if not isinstance(saved, dict):
        raise ConfigError(f"--use-checkpoint-args: {path} records no arguments")
    return saved, path


def apply_checkpoint_args(args: argparse.Namespace) -> str | None:
    """Fill ``args``' missing shape (and tokenizer) flags from the ``--load`` checkpoint; the line to log."""
    if not getattr(args, "use_checkpoint_args", False):
        return None
    if not args.load or not os.path.exists(args.load):
        raise ConfigError("--use-checkpoint-args needs --load DIR holding a checkpoint")
    saved, path = checkpoint_args(args.load, args.save)
    names = list(SHAPE_ARGS) + (list(TOKENIZER_ARGS) if getattr(args, "tokenizer_type", None) is None else [])
    if (saved.get("tokenizer_type") != "NullTokenizer"
            or getattr(args, "tokenizer_type", None) not in (None, "NullTokenizer")):
        names = [n for n in names if n != "vocab_size"]  # elsewhere Megatron's vocab_size is the model's, not a flag
    taken = []
    for name in names:
        if hasattr(args, name) and getattr(args, name) is None and saved.get(name) is not None:
            setattr(args, name, saved[name])
            taken.append(f"--{name.replace('_', '-')} {saved[name]}")
    return f"--use-checkpoint-args: from {path}: {' '.join(taken) or 'nothing missing'}"


def with_tokenizer_fingerprint(args: dict, fingerprints: dict | None) -> dict:
    """A run's flat arguments plus ``tokenizer_fingerprint`` (data/fingerprint.py: type, vocabulary size, SHA-256 of
    the pieces), so every format that stores the arguments (torch, torch_dist, what checkpoint_util converts or
    exports them to) records which tokenizer the model was trained with; tools/generate.py compares it."""
    tok = (fingerprints or {}).get("tokenizer")
    return {**args, "tokenizer_fingerprint": dict(tok)} if isinstance(tok, dict) else args
