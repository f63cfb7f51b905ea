"""Global parameter names of our model and their Megatron-LM v2.x module names.

A global name is ``{list index}.{module path}`` in the model's ordered layer list
[embedding, layer 0 .. layer L-1, head] (``spec.ModelSpec.build(0, L + 2)``): ``0.word.weight``,
``0.position``, ``3.attn.qkv.weight`` (transformer layer 2), ``{L+1}.ln.weight``. The head's
copy of the tied word embedding is not a name of its own: it is ``0.word.weight``.

Megatron paths are tuples of keys into the nested ``model`` dict of a Megatron checkpoint,
e.g. ``("language_model", "encoder", "layers.0.input_layernorm.weight")``; layer numbers are
local to the pipeline stage that holds them, as Megatron saves them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import ModelConfig
from ..config.blocks import DENSE_MLP, layer_params
from ..config.families import FAMILIES
from ..config.moe_arith import MOE_MLP
from ..errors import ConfigError
from ..schedule.stages import stage_range

WORD = "0.word.weight"
POSITION = "0.position"
TOKENTYPE = "0.tokentype"

# SwiGLU's column-parallel pair; Megatron keeps both in ``dense_h_to_4h`` ([gate; up] rows per tensor rank)
SWIGLU_MODULES = tuple(f"mlp.{m}" for m in DENSE_MLP.fused_pair)
OUTPUT = "output_layer.weight"  # the head's untied output layer (``{L+1}.output_layer.weight``)
# An MoE layer's parameters (``mlp.moe.router.weight``, ``mlp.moe.experts.linear_fc1`` ...) sit in Megatron's
# encoder as ``layers.N.mlp.router.weight``, ``layers.N.mlp.experts.linear_fc1`` (the whole [E, out, in] stack: a
# global expert axis), ``layers.N.mlp.shared_experts.*``: names of this project (Megatron-LM v2.x has no experts)
MOE_PREFIX = "mlp.moe."
EXPERT_STACKS = ("mlp.moe.experts.linear_fc1", "mlp.moe.experts.linear_fc2")


def layer_suffixes(cfg: ModelConfig, layer: int | None = None) -> list[str]:
    """A transformer layer's parameter names (module path . weight/bias) for ``cfg``'s options: its blocks'
    parameter lists (``config/blocks.py``; no biases with --disable-bias-linear, RMSNorm without one,
    SwiGLU's gate and up for fc1). ``layer`` (0-based) of an MoE model: where ``--moe-layer-freq`` puts experts,
    the MoE block's (``config/moe_arith.py``: ``mlp.moe.router.weight``, ``mlp.moe.experts.linear_fc1``, ...)
    replace the dense MLP's."""
    names = [p.name for p in layer_params(cfg)]
    if layer is None or not is_moe_layer(cfg, layer):
        return names
    return [n for n in names if not n.startswith("mlp.")] + [f"mlp.{p.name}" for p in MOE_MLP.params(cfg)]


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether transformer layer ``layer`` (0-based) holds experts."""
    return cfg.moe is not None and cfg.moe.moe_layers(cfg.num_layers)[layer]


def is_expert_stack(name: str) -> bool:
    """Whether global ``name`` is an expert stack ``[E, out, in]`` (its first axis the experts)."""
    return name.split(".", 1)[-1] in EXPERT_STACKS


def _layer_megatron(cfg: ModelConfig) -> dict[str, str]:
    """Our per-layer parameter name -> Megatron's (ParallelTransformerLayer in v2.x), from the blocks."""
    return {p.name: f"{p.megatron}.{p.name.rsplit('.', 1)[1]}" for p in layer_params(cfg)}


def head_norm_names(cfg: ModelConfig) -> list[str]:
    h = head_index(cfg)
    return [f"{h}.ln.weight"] + ([f"{h}.ln.bias"] if cfg.normalization == "LayerNorm" else [])

# BERT head: our module path -> Megatron path (its family's head, ``config/families.py``)
BERT_HEAD = FAMILIES["bert"].head.megatron

EMBEDDING_PATHS = {
    WORD: ("language_model", "embedding", "word_embeddings", "weight"),
    POSITION: ("language_model", "embedding", "position_embeddings", "weight"),
    TOKENTYPE: ("language_model", "embedding", "tokentype_embeddings", "weight"),
}
# A last stage that is not also the first keeps its own copy of the tied word embedding here.
HEAD_WORD_PATH = ("word_embeddings_for_head", "weight")
# The untied output layer (Megatron-LM's TransformerLanguageModel.output_layer, on the last stage).
OUTPUT_PATH = ("language_model", "output_layer", "weight")


def swiglu_part(name: str) -> int | None:
    """0 for SwiGLU's gate, 1 for its up projection (the halves of Megatron's fused ``dense_h_to_4h``
    rows on each tensor rank: ``torch.chunk(fc1(x), 2, -1)`` gives gate, up); None otherwise."""
    rest = name.split(".", 1)[1] if "." in name else name
    for i, m in enumerate(SWIGLU_MODULES):
        if rest.startswith(m + "."):
            return i
    return None


def head_index(cfg: ModelConfig) -> int:
    return cfg.num_layers + 1


def full_names(cfg: ModelConfig) -> list[str]:
    """Every global name of the full model, in layer-list order (tied word embedding once)."""
    names = [WORD] + ([POSITION] if cfg.position_embedding_type == "learned_absolute" else [])
    names += [TOKENTYPE] if cfg.num_tokentypes else []
    for i in range(1, cfg.num_layers + 1):
        names += [f"{i}.{s}" for s in layer_suffixes(cfg, i - 1)]
    h = head_index(cfg)
    names += head_norm_names(cfg)
    if not cfg.tied_output:
        names.append(f"{h}.{OUTPUT}")
    names += [f"{h}.{s}" for s in cfg.family.head.megatron]  # the family's head beyond norm and output layer
    return names


Split = Sequence[int] | None  # transformer layers per stage; None: the balanced split


def stage_names(cfg: ModelConfig, d: int, r: int, split: Split = None) -> list[str]:
    """Global names stage ``r`` of ``d`` holds (the last stage also holds the word embedding)."""
    start, end = stage_range(cfg.num_layers, d, r, split)
    names = [n for n in full_names(cfg) if start <= int(n.split(".", 1)[0]) < end]
    if r == d - 1 and start > 0 and cfg.tied_output:
        names.insert(0, WORD)
    return names


def rank_stages(d: int, r: int, chunks: int = 1) -> list[tuple[int, int]]:
    """(stage count, stage) of each model chunk pipeline rank ``r`` holds: ``[(d, r)]`` with one chunk; with
    ``chunks`` > 1 (interleaved) virtual stage ``c * d + r`` of ``d * chunks`` for each chunk c, which is how
    Megatron saves them (``model0``, ``model1``, ..., each with chunk-local layer numbers)."""
    return [(d, r)] if chunks == 1 else [(d * chunks, c * d + r) for c in range(chunks)]


def rank_names(cfg: ModelConfig, d: int, r: int, split: Split = None, chunks: int = 1) -> list[str]:
    """Global names pipeline rank ``r`` of ``d`` holds over all its chunks (:func:`rank_stages`)."""
    if chunks == 1:
        return stage_names(cfg, d, r, split)
    out: list[str] = []
    for n, s in rank_stages(d, r, chunks):
        out += [x for x in stage_names(cfg, n, s) if x not in out]
    return out


def megatron_path(cfg: ModelConfig, name: str, d: int = 1, r: int = 0, split: Split = None) -> tuple[str, ...]:
    """Where global ``name`` lives in the ``model`` dict of stage ``r`` of ``d`` (local layer numbers)."""
    idx_text, rest = name.split(".", 1)
    idx, h = int(idx_text), head_index(cfg)
    start = stage_range(cfg.num_layers, d, r, split)[0]
    if name == WORD and start > 0:
        return HEAD_WORD_PATH
    if idx == 0 and name in EMBEDDING_PATHS:
        return EMBEDDING_PATHS[name]
    if 1 <= idx <= cfg.num_layers and rest.startswith(MOE_PREFIX) and is_moe_layer(cfg, idx - 1):
        return ("language_model", "encoder", f"layers.{idx - max(start, 1)}.mlp.{rest[len(MOE_PREFIX):]}")
    if 1 <= idx <= cfg.num_layers and rest in (layer := _layer_megatron(cfg)):
        local = idx - max(start, 1)  # SwiGLU's gate and up: one fused tensor (fused_swiglu_parts)
        return ("language_model", "encoder", f"layers.{local}.{layer[rest]}")
    if idx == h and rest == OUTPUT:
        return OUTPUT_PATH
    if idx == h and rest.startswith("ln."):
        return ("language_model", "encoder", f"final_layernorm.{rest[3:]}")
    if idx == h and rest in cfg.family.head.megatron:
        return cfg.family.head.megatron[rest]
    raise ConfigError(f"no Megatron name for parameter {name!r}")


def names_by_path(cfg: ModelConfig, d: int = 1, r: int = 0, split: Split = None) -> dict[tuple[str, ...], str]:
    """Inverse of :func:`megatron_path` over the names stage ``r`` of ``d`` holds (for SwiGLU's fused
    ``dense_h_to_4h`` the up projection's name; see :func:`swiglu_part`)."""
    return {megatron_path(cfg, n, d, r, split): n for n in stage_names(cfg, d, r, split)}
