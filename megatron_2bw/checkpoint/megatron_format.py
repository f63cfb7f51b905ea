"""Megatron-LM v2.x checkpoint contents and directories, to and from our full state dicts.

A Megatron file (``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt``) holds ``model`` (nested
``language_model.{embedding,encoder[,pooler]}`` plus BERT's ``lm_head`` and ``binary_head``),
``args`` (an ``argparse.Namespace``), ``checkpoint_version`` and ``iteration``. An interleaved run's
file (``--virtual-pipeline-model-parallel-size`` v) holds ``model0`` .. ``model{v-1}`` instead, one per
model chunk, each laid out as the virtual stage ``c * d + r`` of ``d * v`` it is (as Megatron saves
them); the global layer order is the same, so converting to and from it is a reshard. We write
checkpoint_version 3.0, whose QKV rows are ordered [heads, 3, head_dim]: our own order, so no
permutation is needed; older versions are permuted on reading.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..data.fingerprint import recorded_tokenizer
from ..errors import ConfigError
from .layout import FILENAME, RANK_DIR_RE, TRACKER, iteration_name
from .layout import rank_dir_name as rank_dir
from .manifest import atomic_file
from .names import Split, megatron_path, rank_stages, stage_names, swiglu_part
from .reshard import reshard, unshard

CHECKPOINT_VERSION = 3.0


@dataclass
class Exported:
    """A whole model in canonical form: config, full t = 1 state dict in global names, and metadata."""

    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    iteration: int = 0
    tokenizer: dict = field(default_factory=dict)  # tokenizer_type, tokenizer_model, vocab_file, merge_file
    dtype: str = "fp32"
    # an MoE router's state beside the weights: transformer layer -> expert bias of the newest weights (a
    # torch_dist trainer checkpoint's router_state; empty elsewhere)
    router: dict[int, torch.Tensor] = field(default_factory=dict)


def megatron_args(ex: Exported, t: int, d: int, schedule: str | None = None, split: Split = None,
                  chunks: int = 1) -> argparse.Namespace:
    """Megatron's training arguments for ``ex`` saved at layout ``t x d`` (fields its loaders read)."""
    cfg = ex.cfg
    tok = ex.tokenizer
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.seq_length,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, padded_vocab_size=cfg.padded_vocab_size(t),
        tensor_model_parallel_size=t, pipeline_model_parallel_size=d, model_parallel_size=t,
        # our GELU is the tanh approximation: Megatron's openai_gelu, unfused
        bias_gelu_fusion=False, openai_gelu=True, onnx_safe=None,
        apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False, fp32_residual_connection=False,
        layernorm_epsilon=cfg.layernorm_epsilon, init_method_std=cfg.init_method_std,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        fp16=ex.dtype == "fp16", bf16=ex.dtype == "bf16", params_dtype=torch.float32,
        bert_binary_head=cfg.kind == "bert", num_tokentypes=cfg.num_tokentypes,
        tokenizer_type=tok.get("tokenizer_type"), tokenizer_model=tok.get("tokenizer_model"),
        vocab_file=tok.get("vocab_file"), merge_file=tok.get("merge_file"),
        tokenizer_fingerprint=tok.get("fingerprint"),  # data/fingerprint.py: which tokenizer the model was trained with
        iteration=ex.iteration,
        # Llama-family layers (Megatron-LM's argument names)
        position_embedding_type=cfg.position_embedding_type, rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent, swiglu=cfg.swiglu, normalization=cfg.normalization,
        group_query_attention=cfg.group_query_attention, num_query_groups=cfg.num_query_groups,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        add_bias_linear=cfg.add_bias_linear,
        # fields of our own (Megatron ignores unknown fields)
        vocab_size=cfg.vocab_size, model_kind=cfg.kind, pipeline_schedule=schedule,
        pipeline_split=list(split) if split is not None else None,
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
    )


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def megatron_model(cfg: ModelConfig, part: dict[str, torch.Tensor], d: int = 1, r: int = 0,
                   split: Split = None) -> dict:
    """The nested ``model`` dict of stage ``r`` of ``d`` from that stage's (possibly sharded) tensors."""
    model: dict = {}
    for name in stage_names(cfg, d, r, split):  # embedding, layers in order, then final LayerNorm and heads
        which = swiglu_part(name)
        if which == 1:
            continue  # written with the gate: this rank's [gate; up] rows in one tensor
        value = part[name] if which is None else torch.cat([part[name], part[name.replace(".gate.", ".up.")]], 0)
        _put(model, megatron_path(cfg, name, d, r, split), value)
    return model


def from_megatron_model(cfg: ModelConfig, model: dict, d: int = 1, r: int = 0, version: float = CHECKPOINT_VERSION,
                        t: int = 1, split: Split = None) -> dict[str, torch.Tensor]:
    """Our global names for the tensors of stage ``r`` of ``d`` (QKV rows put in version-3.0 order)."""
    out = {}
    for name in stage_names(cfg, d, r, split):
        path = megatron_path(cfg, name, d, r, split)
        value = _get(model, path)
        if value is None:
            raise ConfigError(f"Megatron checkpoint lacks {'.'.join(path)} (stage {r} of {d})")
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")) and cfg.query_groups == cfg.num_attention_heads:
            value = qkv_from_version(value, version, cfg.num_attention_heads // t)
        if (which := swiglu_part(name)) is not None:
            value = value.chunk(2, 0)[which]
        out[name] = value
    return out


def qkv_from_version(value: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """QKV rows of a Megatron ``checkpoint_version`` as [heads, 3, head_dim] (ours and version 2.0+)."""
    if version >= 2.0:
        return value
    rest = value.shape[1:]
    hd = value.shape[0] // (3 * heads)
    if version == 1.0:  # [heads, head_dim, 3]
        return value.view(heads, hd, 3, *rest).transpose(1, 2).reshape(value.shape).contiguous()
    return value.view(3, heads, hd, *rest).transpose(0, 1).reshape(value.shape).contiguous()  # [3, heads, hd]


def model_keys(chunks: int) -> list[str]:
    """The file's model keys: ``model``, or Megatron's ``model0`` .. ``model{v-1}`` for an interleaved run."""
    return ["model"] if chunks == 1 else [f"model{c}" for c in range(chunks)]


def chunks_of(contents: dict) -> int:
    """How many model chunks a rank's file holds (``model0``, ``model1``, ...: interleaved; ``model``: one)."""
    n = 0
    while f"model{n}" in contents:
        n += 1
    return max(n, 1)


def rank_contents(meta: Exported, part: dict[str, torch.Tensor], *, t: int, d: int, pp: int,
                  schedule: str | None = None, split: Split = None, chunks: int = 1) -> dict:
    """One rank's Megatron file contents from its global-name shard ``part`` (``meta.weights`` unused).

    The trainer can put these keys in its own files (and its engine state beside them under
    keys of its own) so that Megatron's loaders and transformers' converters read them.
    """
    models = {key: megatron_model(meta.cfg, part, n, s, split)
              for key, (n, s) in zip(model_keys(chunks), rank_stages(d, pp, chunks))}
    return {
        **models,
        "args": megatron_args(meta, t, d, schedule, split, chunks),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": meta.iteration,
    }


def rank_weights(contents: dict, cfg: ModelConfig, *, t: int, d: int, pp: int,
                 split: Split = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`rank_contents`: a rank's global-name shard from its Megatron file contents (all of its
    model chunks: an interleaved file's ``model0``, ``model1``, ... say how many)."""
    version = float(contents.get("checkpoint_version", 0.0))
    chunks = chunks_of(contents)
    out: dict[str, torch.Tensor] = {}
    for key, (n, s) in zip(model_keys(chunks), rank_stages(d, pp, chunks)):
        out.update(from_megatron_model(cfg, contents[key], n, s, version, t, split))
    return out


def megatron_files(ex: Exported, t: int, d: int, schedule: str | None = None,
                   split: Split = None, chunks: int = 1) -> dict[tuple[int, int], dict]:
    """Every (tensor rank, pipeline rank) file's contents for layout ``t x d`` (``chunks`` per rank)."""
    return {key: rank_contents(ex, part, t=t, d=d, pp=key[1], schedule=schedule, split=split, chunks=chunks)
            for key, part in reshard(ex.cfg, ex.weights, t, d, split, chunks).items()}


def write_megatron_dir(root: str, ex: Exported, t: int = 1, d: int = 1, schedule: str | None = None,
                       split: Split = None, chunks: int = 1) -> str:
    """Write ``ex`` under ``root`` in Megatron's layout (pointer file last); returns the iteration dir."""
    return write_rank_files(root, ex.iteration, d, megatron_files(ex, t, d, schedule, split, chunks).items())


def write_rank_files(root: str, iteration: int, d: int, files) -> str:
    """Each (tp, pp) rank's contents to its ``mp_rank_*`` file of ``iter_NNNNNNN``, atomically, then the
    pointer file (so a reader never sees the pointer before the files); returns the iteration dir."""
    idir = os.path.join(root, iteration_name(iteration))
    for (tp, pp), contents in files:
        path = os.path.join(idir, rank_dir(tp, pp, d), FILENAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_file(path, "wb") as f:
            torch.save(contents, f)
    with atomic_file(os.path.join(root, TRACKER), "w") as f:
        f.write(f"{iteration}\n")
    return idir


def find_iteration_dir(root: str) -> str:
    """The directory the pointer file names (``iter_NNNNNNN`` or ``release``), or ``root`` itself if it is one."""
    if any(RANK_DIR_RE.fullmatch(n) for n in os.listdir(root)):
        return root
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        raise ConfigError(f"{root} holds no Megatron checkpoint (no {TRACKER} and no mp_rank_* directories)")
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(root, "release")
    if not re.fullmatch(r"\d+", text):
        raise ConfigError(f"{path} does not hold an iteration number (got {text[:40]!r})")
    return os.path.join(root, iteration_name(int(text)))


def read_rank_files(idir: str) -> dict[tuple[int, int], dict]:
    """Every ``mp_rank_*`` file of an iteration directory, keyed by (tensor rank, pipeline rank)."""
    files = {}
    for name in sorted(os.listdir(idir)) if os.path.isdir(idir) else ():
        m = RANK_DIR_RE.fullmatch(name)
        path = os.path.join(idir, name, FILENAME)
        if m and os.path.isfile(path):
            try:
                key = (int(m.group(1)), int(m.group(2) or 0))
                files[key] = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt file
                raise ConfigError(f"cannot read {path}: {type(e).__name__}") from None
    if not files:
        raise ConfigError(f"{idir} holds no mp_rank_*/{FILENAME} files")
    _refuse_missing_shards(idir, files)
    return files


def _saved_layout(sd) -> tuple[int, int] | None:
    """(t, d) a file says its checkpoint was written with: the trainer's ``layout``, else Megatron's ``args``."""
    if not isinstance(sd, dict):
        return None
    lay = sd.get("layout")
    if isinstance(lay, dict) and "t" in lay and "d" in lay:
        return int(lay["t"]), int(lay["d"])
    args = sd.get("args")
    a = vars(args) if isinstance(args, argparse.Namespace) else args if isinstance(args, dict) else {}
    if "tensor_model_parallel_size" in a:
        return int(a["tensor_model_parallel_size"]), int(a.get("pipeline_model_parallel_size", 1))
    return None


def _refuse_missing_shards(idir: str, files: dict) -> None:
    """One line naming the first missing rank's file, instead of a KeyError when the model is assembled."""
    layout = _saved_layout(files[min(files)])
    if layout is None:
        return
    t, d = layout
    missing = [rank_dir(a, b, d) for a in range(t) for b in range(d) if (a, b) not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"checkpoint {idir} was written with t={t} d={d} but "
                          f"{os.path.join(idir, missing[0], FILENAME)} is missing{more}: "
                          "copy it back or use a complete checkpoint")


def config_from_args(args, model: dict) -> ModelConfig:
    """Our ModelConfig from a Megatron ``args`` namespace and a first stage's ``model`` dict."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    kind = a.get("model_kind") or ("bert" if "lm_head" in model or "binary_head" in model else "gpt")
    tokentype = _get(model, ("language_model", "embedding", "tokentype_embeddings", "weight"))
    if a.get("bias_gelu_fusion") is False and not a.get("openai_gelu") and not a.get("swiglu"):  # SwiGLU: no GELU
        raise ConfigError("checkpoint uses the exact (erf) GELU; this model implements only the tanh approximation")
    return ModelConfig(
        kind=kind, num_layers=a["num_layers"], hidden_size=a["hidden_size"],
        num_attention_heads=a["num_attention_heads"], seq_length=a.get("seq_length") or a["max_position_embeddings"],
        max_position_embeddings=a["max_position_embeddings"],
        vocab_size=a.get("vocab_size") or a["padded_vocab_size"], ffn_hidden_size=a.get("ffn_hidden_size"),
        hidden_dropout=a.get("hidden_dropout", 0.0), attention_dropout=a.get("attention_dropout", 0.0),
        layernorm_epsilon=a.get("layernorm_epsilon", 1e-5), init_method_std=a.get("init_method_std", 0.02),
        num_tokentypes=0 if tokentype is None else tokentype.shape[0],
        position_embedding_type=a.get("position_embedding_type") or "learned_absolute",
        rotary_base=a.get("rotary_base") or 10000, rotary_percent=a.get("rotary_percent") or 1.0,
        swiglu=bool(a.get("swiglu")), normalization=a.get("normalization") or "LayerNorm",
        group_query_attention=bool(a.get("group_query_attention")),
        num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else None,
        untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights")),
        add_bias_linear=a.get("add_bias_linear", True) is not False,
        make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by") or 128,
    )


def read_megatron_dir(root: str) -> Exported:
    """A Megatron-layout checkpoint (any t x d) as a whole model."""
    files = read_rank_files(find_iteration_dir(root))
    first = files[min(files)]
    model = first.get("model", first.get("model0"))  # model0: an interleaved run's first chunk
    if "args" not in first or not isinstance(model, dict) or "language_model" not in model:
        raise ConfigError(f"{root} is not a Megatron-LM checkpoint (no args/model.language_model)")
    cfg = config_from_args(first["args"], model)
    d = 1 + max(pp for _, pp in files)
    t = 1 + max(tp for tp, _ in files)
    a = vars(first["args"])
    split = a.get("pipeline_split")
    parts = {k: rank_weights(f, cfg, t=t, d=d, pp=k[1], split=split) for k, f in files.items()}
    tok = recorded_tokenizer(a)
    dtype = "fp16" if a.get("fp16") else "bf16" if a.get("bf16") else "fp32"
    weights = {n: v.float() for n, v in unshard(cfg, parts).items()}
    return Exported(cfg, weights, int(first.get("iteration", 0)), tok, dtype)

