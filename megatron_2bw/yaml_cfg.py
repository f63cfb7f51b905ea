"""``--yaml-cfg FILE`` (Megatron-LM's YAML config) and one-line hints for unknown flags.

A YAML config is a mapping of flag names without the dashes (``train_iters`` or
``train-iters``) to values. :func:`expand_yaml_cfg` turns it into command-line tokens placed
*before* the real command line, so argparse's last-occurrence rule makes flags on the command
line win, and required flags can come from the file. Booleans of switch flags
(``store_true``) become the bare flag when true and nothing when false; lists become the
values of ``nargs`` flags; ``null`` leaves the flag at its default. A switch set in the file
cannot be switched off on the command line (argparse has no ``--no-`` form here).

:func:`explain_unrecognized` turns argparse's ``unrecognized arguments: ...`` into one line
that names the nearest known flag, or says that a Megatron-LM flag is not supported here.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping

from .errors import ConfigError

YAML_FLAG = "--yaml-cfg"

# Common Megatron-LM flags this project does not implement, with what to use instead.
MEGATRON_UNSUPPORTED = {
    "--transformer-impl": "Transformer Engine; --fused-kernels picks apex or torch kernels",
    "--use-mcore-models": "Megatron-Core models; the models are this project's own",
    "--fp8-format": "FP8 training; use --bf16 or --fp16",
    "--rampup-batch-size": "batch-size ramp-up; the global batch is fixed",
    "--dataloader-type": "data loader types; batches come from the indexed dataset in order",
    # issue 45: flags of ported Megatron-LM scripts whose meaning the models or checkpoints here cannot build
    "--qk-layernorm": "a norm on each head's queries and keys; the attention here has none",
    "--no-save-optim": "checkpoints without the optimizer state; every save holds it, and --no-load-optim or "
                       "--finetune leave it out on load",
    "--no-save-rng": "checkpoints without the RNG states; every save holds them (--no-load-rng leaves them out)",
    "--fp8": "FP8 training; use --bf16 or --fp16",
    "--fp8-recipe": "FP8 training; use --bf16 or --fp16",
    "--tp-comm-overlap": "Transformer Engine's userbuffer overlap of tensor-parallel communication",
    "--use-legacy-models": "Megatron's legacy models; the models are this project's own",
    "--spec": "Megatron-Core layer specs; the models are this project's own",
    "--no-gradient-accumulation-fusion": "a fused weight-gradient kernel; the gradients are accumulated by torch",
    "--apply-query-key-layer-scaling": "fp16 query-key layer scaling; the softmax runs in fp32",
    "--distribute-saved-activations": "--distribute-saved-activations; see --recompute-granularity and "
                                      "--sequence-parallel",
    "--decoupled-lr": "a separate learning rate for the embedding and output layer",
    "--decoupled-min-lr": "a separate learning rate for the embedding and output layer",
    "--manual-gc": "manual garbage collection; Python's collector runs as usual",
    "--tokenizer-prompt-format": "chat-template tokenizers",
    "--multi-latent-attention": "multi-latent attention",
    "--hybrid-override-pattern": "hybrid Mamba models",
    "--use-torch-fsdp2": "FSDP2; use --use-distributed-optimizer (ZeRO-1)",
    "--ckpt-fully-parallel-save": "torch_dist saves are written by every rank already",
    "--ckpt-fully-parallel-load": "torch_dist loads read each rank's part already",
    "--num-dataset-builder-threads": "dataset building threads; the indices are built in the training process",
    "--s3-cache-path": "object-store data; give local indexed datasets",
    "--object-storage-cache-path": "object-store data; give local indexed datasets",
}


def _long_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for s, a in parser._option_string_actions.items() if s.startswith("--")}  # noqa: SLF001


# How alike (difflib's ratio) a known flag must be to be suggested: a close spelling (--micro-batch-szie,
# --trian-iters, --hidden) passes; another flag sharing a word (--async-save vs --save: 0.67) does not.
HINT_CUTOFF = 0.75


def nearest_flag(name: str, parser: argparse.ArgumentParser) -> str | None:
    """The parser's long flag closest to ``name`` (``--foo``, ``foo`` or ``foo_bar``) if its spelling is close, or
    None."""
    flag = "--" + name.lstrip("-").replace("_", "-")
    close = difflib.get_close_matches(flag, list(_long_flags(parser)), n=1, cutoff=HINT_CUTOFF)
    return close[0] if close else None


def _hint(flag: str, parser: argparse.ArgumentParser) -> str:
    if flag in MEGATRON_UNSUPPORTED:
        return f"Megatron flag not supported by megatron_2bw: {flag} ({MEGATRON_UNSUPPORTED[flag]})"
    near = nearest_flag(flag, parser)
    return f"unrecognized argument {flag} ({f'did you mean {near}?' if near else 'see --help'})"


def explain_unrecognized(message: str, parser: argparse.ArgumentParser) -> str:
    """One line for argparse's ``unrecognized arguments: ...`` message; other messages unchanged.

    Values that follow an unknown flag are not flags and are left out of the hints.
    """
    prefix = "unrecognized arguments:"
    if not message.startswith(prefix):
        return message
    tokens = message[len(prefix):].split()
    flags = [t.split("=", 1)[0] for t in tokens if t.startswith("--")]
    if not flags:
        return f"unexpected positional arguments: {' '.join(tokens)} (flags start with --; see --help)"
    return "; ".join(dict.fromkeys(_hint(f, parser) for f in flags))


def add_yaml_cfg_argument(group) -> None:
    """Declare ``--yaml-cfg`` on a parser or argument group, so ``--help`` lists it."""
    group.add_argument(YAML_FLAG, metavar="FILE",
                       help="YAML mapping of flag names (train_iters or train-iters) to values; "
                            "flags on the command line win")


def _find_yaml_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the file of ``--yaml-cfg FILE`` / ``--yaml-cfg=FILE`` or None, argv without it)."""
    path, rest, i = None, [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == YAML_FLAG or tok.startswith(YAML_FLAG + "="):
            if path is not None:
                raise ConfigError(f"{YAML_FLAG} given twice")
            if "=" in tok:
                path = tok.split("=", 1)[1]
            elif i + 1 < len(argv):
                path, i = argv[i + 1], i + 1
            else:
                raise ConfigError(f"{YAML_FLAG} needs a FILE")
        else:
            rest.append(tok)
        i += 1
    return path, rest


def _unique_keys_loader(yaml):
    """PyYAML's SafeLoader refusing a key given twice in one mapping (it would keep the last silently)."""

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
            dup = next((i for i, k in enumerate(keys) if k in keys[:i]), None)
            if dup is not None:
                raise yaml.constructor.ConstructorError(None, None, f"key {keys[dup]!r} given twice",
                                                        node.value[dup][0].start_mark)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def load_yaml_cfg(path: str) -> Mapping:
    """The file's mapping (an empty file is an empty mapping); any other content is a one-line error."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"{YAML_FLAG} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_unique_keys_loader(yaml))  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{YAML_FLAG} {path}:{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{YAML_FLAG} {path}: expected a mapping of flag names to values "
                          f"(train_iters: 1000), got a {type(data).__name__}")
    return data


def _scalar(path: str, key: str, value) -> str:
    if isinstance(value, (Mapping, list, tuple)):
        raise ConfigError(f"{YAML_FLAG} {path}: {key} takes one value, got {value!r}")
    return str(value)


def _tokens(path: str, key, value, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line tokens of one YAML entry."""
    if not isinstance(key, str) or not key.strip("-"):
        raise ConfigError(f"{YAML_FLAG} {path}: keys must be flag names, got {key!r}")
    flag = "--" + key.lstrip("-").replace("_", "-")
    action = _long_flags(parser).get(flag)
    if action is None or flag in (YAML_FLAG, "--help"):
        hint = _hint(flag, parser) if action is None else f"{flag} cannot be set in a YAML config"
        raise ConfigError(f"{YAML_FLAG} {path}: unknown key {key!r}: {hint}")
    if value is None:
        return []
    if action.nargs == 0:  # store_true / store_false switches
        if not isinstance(value, bool):
            raise ConfigError(f"{YAML_FLAG} {path}: {key} is a switch; give true or false, got {value!r}")
        return [flag] if value == bool(action.const) else []
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [flag, *(_scalar(path, key, v) for v in items)]
    if isinstance(value, bool):
        raise ConfigError(f"{YAML_FLAG} {path}: {key} takes a value, not {str(value).lower()}")
    return [f"{flag}={_scalar(path, key, value)}"]


def expand_yaml_cfg(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with the ``--yaml-cfg`` file's flags in front (command-line flags win).

    ``--yaml-cfg FILE`` itself stays in the result when the parser declares it (so the parsed
    namespace records the file) and is dropped otherwise. Without ``--yaml-cfg`` argv is
    returned unchanged.
    """
    path, rest = _find_yaml_flag(list(argv))
    if path is None:
        return list(argv)
    expanded: list[str] = []
    seen: dict[str, object] = {}
    for key, value in load_yaml_cfg(path).items():
        flag = "--" + key.lstrip("-").replace("_", "-") if isinstance(key, str) else None
        if flag in seen:  # Y06: train_iters and train-iters both given; the last would win silently
            raise ConfigError(f"{YAML_FLAG} {path}: {seen[flag]!r} and {key!r} both set {flag}: give it once")
        seen[flag] = key
        expanded += _tokens(path, key, value, parser)
    keep = [f"{YAML_FLAG}={path}"] if YAML_FLAG in _long_flags(parser) else []
    return keep + expanded + rest


__all__ = [
    "MEGATRON_UNSUPPORTED", "YAML_FLAG", "add_yaml_cfg_argument", "expand_yaml_cfg", "explain_unrecognized",
    "load_yaml_cfg", "nearest_flag",
]
