"""Megatron-Core checkpoints in the ``torch`` format, to and from our full state dicts.

Megatron-Core's GPT/BERT models (``GPTModel``, ``BertModel``) save ``model`` as one flat state dict
(``model.state_dict_for_save_checkpoint()``) in the same ``iter_NNNNNNN/mp_rank_TT[_PPP]/
model_optim_rng.pt`` files as Megatron-LM v2.x, with ``args`` and ``checkpoint_version`` 3.0. The names
are those of Megatron-LM's ``tools/checkpoint/schema_core.py`` (``--saver mcore``/``core``): for
``--saver-transformer-impl transformer_engine`` (Megatron's default) the two norms are fused into the
following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), for ``local``
they are modules of their own (``input_layernorm``, ``pre_mlp_layernorm``). Layer numbers are local to
the pipeline stage, as the torch format saves them.

Tensor layouts need no permutation: Megatron-Core's ``linear_qkv`` rows are [query groups,
heads/groups + 2, head_dim] (each group's queries, then its key and value; [heads, 3, head_dim]
without grouped-query attention), which is our own order, and SwiGLU's ``linear_fc1`` holds each
tensor rank's [gate; up] rows, as our legacy export does. A model's experts (router, one ``SequentialMLP`` per
expert, shared experts) are named in ``mcore_moe.py``.
"""

from __future__ import annotations

import argparse

import torch

from ..checkpoint.megatron_format import (
    CHECKPOINT_VERSION,
    Exported,
    config_from_args,
    find_iteration_dir,
    megatron_args,
    read_rank_files,
    write_rank_files,
)
from ..checkpoint.names import (
    BERT_HEAD,
    OUTPUT,
    POSITION,
    SWIGLU_MODULES,
    TOKENTYPE,
    WORD,
    Split,
    head_index,
    is_moe_layer,
    stage_names,
    swiglu_part,
)
from ..checkpoint.reshard import reshard, unshard
from ..config import ModelConfig
from ..data.fingerprint import recorded_tokenizer
from ..errors import ConfigError
from ..schedule.stages import stage_range
from . import mcore_moe

TRANSFORMER_IMPLS = ("transformer_engine", "local")

_EMBEDDING = {WORD: "embedding.word_embeddings.weight", POSITION: "embedding.position_embeddings.weight",
              TOKENTYPE: "embedding.tokentype_embeddings.weight"}
_LINEARS = {"attn.qkv": "self_attention.linear_qkv", "attn.proj": "self_attention.linear_proj",
            "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}
# where each norm lives: fused into the next linear (Transformer Engine) or a module of its own (local)
_NORMS = {"transformer_engine": {"ln1": "self_attention.linear_qkv.layer_norm_", "ln2": "mlp.linear_fc1.layer_norm_"},
          "local": {"ln1": "input_layernorm.", "ln2": "pre_mlp_layernorm."}}
# Transformer Engine modules that save an ``_extra_state`` entry (fp8 metadata; None without fp8)
_TE_EXTRA = ("self_attention.core_attention", "self_attention.linear_proj", "self_attention.linear_qkv")
# (and the MLP's linears: mcore_moe.te_extra)
_BERT_HEAD = {"lm_dense.weight": "lm_head.dense.weight", "lm_dense.bias": "lm_head.dense.bias",
              "lm_ln.weight": "lm_head.layer_norm.weight", "lm_ln.bias": "lm_head.layer_norm.bias",
              "lm_bias": "output_layer.bias", "pooler.weight": "pooler.dense.weight",
              "pooler.bias": "pooler.dense.bias", "sop.weight": "binary_head.weight", "sop.bias": "binary_head.bias"}
assert set(_BERT_HEAD) == set(BERT_HEAD)


def block_key(cfg: ModelConfig) -> str:
    """Megatron-Core's transformer block: ``decoder`` in GPTModel, ``encoder`` in BertModel."""
    return cfg.family.megatron_stack


def _check_impl(impl: str) -> None:
    if impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"--saver-transformer-impl must be one of {', '.join(TRANSFORMER_IMPLS)}, got {impl!r}")


def mcore_key(cfg: ModelConfig, name: str, d: int = 1, r: int = 0, split: Split = None,
              impl: str = "transformer_engine") -> str:
    """Megatron-Core's state-dict key of global ``name`` on stage ``r`` of ``d`` (local layer numbers)."""
    _check_impl(impl)
    idx_text, rest = name.split(".", 1)
    idx, h = int(idx_text), head_index(cfg)
    start = stage_range(cfg.num_layers, d, r, split)[0]
    if name == WORD and start > 0:
        return "output_layer.weight"  # the last stage's copy of the tied word embedding
    if idx == 0 and name in _EMBEDDING:
        return _EMBEDDING[name]
    if 1 <= idx <= cfg.num_layers:
        module, param = rest.rsplit(".", 1)
        prefix = f"{block_key(cfg)}.layers.{idx - max(start, 1)}."
        if module in ("ln1", "ln2"):  # an MoE layer's pre-MLP norm is a module of its own under either impl
            return prefix + _NORMS["local" if module == "ln2" and is_moe_layer(cfg, idx - 1) else impl][module] + param
        if rest.startswith("mlp.moe."):
            return prefix + mcore_moe.moe_key(rest)
        module = "mlp.fc1" if module in SWIGLU_MODULES else module  # one fused [gate; up] tensor
        return f"{prefix}{_LINEARS[module]}.{param}"
    if idx == h and rest == OUTPUT:
        return "output_layer.weight"
    if idx == h and rest.startswith("ln."):
        return f"{block_key(cfg)}.final_layernorm.{rest[3:]}"
    if idx == h and rest in cfg.family.head.megatron:  # the family's head beyond norm and output layer
        return _BERT_HEAD[rest]
    raise ConfigError(f"no Megatron-Core name for parameter {name!r}")


def mcore_model(cfg: ModelConfig, part: dict[str, torch.Tensor], d: int = 1, r: int = 0, split: Split = None,
                impl: str = "transformer_engine", tp: tuple[int, int] = (0, 1)) -> dict:
    """Stage ``r``'s flat Megatron-Core state dict from its (possibly tensor-sharded) tensors; ``tp``: (its tensor
    rank, t), which cuts the shared experts (whole in ours, split in Megatron-Core's)."""
    model: dict = {}
    for name in stage_names(cfg, d, r, split):
        which = swiglu_part(name)
        if which == 1:
            continue  # written with the gate: this rank's [gate; up] rows in one tensor
        value = part[name] if which is None else torch.cat([part[name], part[name.replace(".gate.", ".up.")]], 0)
        key = mcore_key(cfg, name, d, r, split, impl)
        rest = name.split(".", 1)[1]
        value = mcore_moe.shared_piece(cfg, rest, value, *tp)
        if rest in mcore_moe.STACKS:  # one SequentialMLP per expert
            model.update(mcore_moe.expert_entries(key[: -len(mcore_moe.moe_key(rest))], rest, value))
        else:
            model[key] = value
    if impl == "transformer_engine":
        start, end = stage_range(cfg.num_layers, d, r, split)
        for local, i in enumerate(i for i in range(start, end) if 1 <= i <= cfg.num_layers):
            for mod in _TE_EXTRA + mcore_moe.te_extra(cfg, i - 1):
                model[f"{block_key(cfg)}.layers.{local}.{mod}._extra_state"] = None
    return model


def from_mcore_model(cfg: ModelConfig, model: dict, d: int = 1, r: int = 0,
                     split: Split = None) -> dict[str, torch.Tensor]:
    """Our global names for the tensors of stage ``r`` of ``d`` from its flat Megatron-Core state dict."""
    impl = detect_impl(model)
    out = {}
    for name in stage_names(cfg, d, r, split):
        key = mcore_key(cfg, name, d, r, split, impl)
        rest = name.split(".", 1)[1]
        if rest in mcore_moe.STACKS:
            out[name] = mcore_moe.read_stack(model, key[: -len(mcore_moe.moe_key(rest))], rest, cfg.moe.num_experts)
            continue
        value = model.get(key)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"Megatron-Core checkpoint lacks {key} (stage {r} of {d}, {impl} names)")
        if (which := swiglu_part(name)) is not None:
            value = value.chunk(2, 0)[which]
        out[name] = value
    return out


def detect_impl(model: dict) -> str:
    """Which layer names a Megatron-Core state dict uses: norms fused into the linears (Transformer Engine)
    or modules of their own (local; an MoE layer's pre-MLP norm is one under either). A stage without layers reads
    the same either way."""
    return "local" if any(k.endswith("input_layernorm.weight") for k in model) else "transformer_engine"


def is_mcore_file(sd) -> bool:
    """A Megatron-Core torch-format file: a flat ``model`` with Megatron-Core's embedding/block names."""
    model = sd.get("model") if isinstance(sd, dict) else None
    return isinstance(model, dict) and "language_model" not in model and any(
        isinstance(k, str) and k.startswith(("embedding.", "decoder.", "encoder.", "output_layer.")) for k in model)


def mcore_args(ex: Exported, t: int, d: int, impl: str, split: Split = None) -> argparse.Namespace:
    """Megatron's arguments for a Megatron-Core model saved in the torch format at ``t x d``."""
    args = megatron_args(ex, t, d, None, split)
    args.use_mcore_models, args.use_legacy_models = True, False
    args.transformer_impl, args.ckpt_format = impl, "torch"
    vars(args).update(mcore_moe.moe_args(ex.cfg))
    return args


def write_mcore_dir(root: str, ex: Exported, t: int = 1, d: int = 1, split: Split = None,
                    impl: str = "transformer_engine") -> str:
    """Write ``ex`` under ``root`` as Megatron-Core's torch format (pointer file last); returns the iteration dir."""
    _check_impl(impl)
    mcore_moe.check_writable(ex.cfg)
    files = ((key, {"model": mcore_model(ex.cfg, part, d, key[1], split, impl, (key[0], t)),
                    "args": mcore_args(ex, t, d, impl, split), "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": ex.iteration})
             for key, part in reshard(ex.cfg, ex.weights, t, d, split).items())
    return write_rank_files(root, ex.iteration, d, files)


def read_mcore_files(files: dict[tuple[int, int], dict], root: str) -> Exported:
    """A whole model from every rank's Megatron-Core file contents (any t x d)."""
    first = files[min(files)]
    if "args" not in first or not is_mcore_file(first):
        raise ConfigError(f"{root} is not a Megatron-Core torch-format checkpoint (no args, or no "
                          "embedding./decoder./output_layer. names in model)")
    model = first["model"]
    # config_from_args reads token types and the BERT heads from a legacy nested dict
    legacy = {"language_model": {"embedding": {"tokentype_embeddings": {"weight": model.get(_EMBEDDING[TOKENTYPE])}}}}
    if any(k.startswith(("encoder.", "binary_head.", "lm_head.")) for k in model):
        legacy["lm_head"] = {}
    cfg = mcore_moe.with_moe(config_from_args(first["args"], legacy), first["args"])
    a = vars(first["args"])
    d = 1 + max(pp for _, pp in files)
    split = a.get("pipeline_split")
    parts = {k: from_mcore_model(cfg, f["model"], d, k[1], split) for k, f in files.items()}
    mcore_moe.join_shared(cfg, parts)  # split over the tensor group in Megatron-Core, whole in ours
    tok = recorded_tokenizer(a)
    dtype = "fp16" if a.get("fp16") else "bf16" if a.get("bf16") else "fp32"
    weights = {n: v.float() for n, v in unshard(cfg, parts).items()}
    return Exported(cfg, weights, int(first.get("iteration", 0)), tok, dtype)


def read_mcore_dir(root: str) -> Exported:
    """A Megatron-Core torch-format checkpoint (any t x d) as a whole model."""
    return read_mcore_files(read_rank_files(find_iteration_dir(root)), root)
