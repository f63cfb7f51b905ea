"""Our full state dicts <-> Hugging Face ``GPT2LMHeadModel`` / ``MegatronBertForPreTraining`` /
``LlamaForCausalLM`` (a GPT with RoPE, SwiGLU and RMSNorm).

Both HF models are pre-LayerNorm like ours. QKV: our rows are [heads, 3, head_dim]; HF keeps
q, k, v of all heads one after another ([3, heads, head_dim]), GPT-2 as a transposed Conv1D.
HF vocabularies are the real (unpadded) size. Our GELU is the tanh approximation, which is HF's
``gelu_new`` (``gelu_fast`` and ``gelu_pytorch_tanh`` compute the same function).
"""

from __future__ import annotations

import torch

from ..checkpoint.names import OUTPUT, POSITION, TOKENTYPE, WORD, head_index, is_moe_layer
from ..checkpoint.reshard import pad_vocab
from ..config import ModelConfig
from ..errors import ConfigError

TANH_GELUS = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")
_GPT_LAYER = {"ln1": "ln_1", "ln2": "ln_2", "attn.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_BERT_LAYER = {"ln1": "attention.ln", "ln2": "ln", "attn.proj": "attention.output.dense",
               "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
_BERT_HEAD = {"ln": "bert.encoder.ln", "lm_dense": "cls.predictions.transform.dense",
              "lm_ln": "cls.predictions.transform.LayerNorm", "pooler": "bert.pooler.dense",
              "sop": "cls.seq_relationship"}


def qkv_to_hf(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [heads, 3, head_dim] -> [3, heads, head_dim]."""
    return x.reshape(heads, 3, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def qkv_from_hf(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [3, heads, head_dim] -> [heads, 3, head_dim]."""
    return x.reshape(3, heads, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


# --------------------------------------------------------------------------- GPT-2
def gpt2_config(cfg: ModelConfig):
    from transformers import GPT2Config  # noqa: PLC0415 - optional at import time

    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
        activation_function="gelu_new", resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )


def to_hf_gpt2(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict (Conv1D weights are [in, out]: our Linear weights transposed)."""
    nh = cfg.num_attention_heads
    word = full[WORD][: cfg.vocab_size]
    out = {"transformer.wte.weight": word, "transformer.wpe.weight": full[POSITION], "lm_head.weight": word}
    for i in range(cfg.num_layers):
        g, h = f"{i + 1}.", f"transformer.h.{i}."
        out[h + "attn.c_attn.weight"] = qkv_to_hf(full[g + "attn.qkv.weight"], nh).t()
        out[h + "attn.c_attn.bias"] = qkv_to_hf(full[g + "attn.qkv.bias"], nh)
        for ours, theirs in _GPT_LAYER.items():
            w = full[f"{g}{ours}.weight"]
            out[f"{h}{theirs}.weight"] = w if ours.startswith("ln") else w.t()
            out[f"{h}{theirs}.bias"] = full[f"{g}{ours}.bias"]
    hd = head_index(cfg)
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = full[f"{hd}.ln.weight"], full[f"{hd}.ln.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def config_from_gpt2(c) -> ModelConfig:
    if c.activation_function not in TANH_GELUS:
        raise ConfigError(f"GPT-2 activation {c.activation_function!r} is not the tanh GELU this model implements")
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or not getattr(c, "scale_attn_weights", True):
        raise ConfigError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    return ModelConfig(
        kind="gpt", num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
        seq_length=c.n_positions, max_position_embeddings=c.n_positions, vocab_size=c.vocab_size,
        ffn_hidden_size=c.n_inner or 4 * c.n_embd, hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop,
        layernorm_epsilon=c.layer_norm_epsilon, init_method_std=c.initializer_range,
    )


def from_hf_gpt2(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_gpt2` (word embedding padded to the t = 1 model's rows)."""
    nh = cfg.num_attention_heads
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    full = {WORD: pad_vocab(sd["wte.weight"], cfg.padded_vocab_size(1)), POSITION: sd["wpe.weight"]}
    for i in range(cfg.num_layers):
        g, h = f"{i + 1}.", f"h.{i}."
        full[g + "attn.qkv.weight"] = qkv_from_hf(sd[h + "attn.c_attn.weight"].t(), nh)
        full[g + "attn.qkv.bias"] = qkv_from_hf(sd[h + "attn.c_attn.bias"], nh)
        for ours, theirs in _GPT_LAYER.items():
            w = sd[f"{h}{theirs}.weight"]
            full[f"{g}{ours}.weight"] = w if ours.startswith("ln") else w.t()
            full[f"{g}{ours}.bias"] = sd[f"{h}{theirs}.bias"]
    hd = head_index(cfg)
    full[f"{hd}.ln.weight"], full[f"{hd}.ln.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    return {k: v.detach().float().contiguous() for k, v in full.items()}


# --------------------------------------------------------------------------- Megatron-BERT
def megatron_bert_config(cfg: ModelConfig):
    from transformers import MegatronBertConfig  # noqa: PLC0415

    return MegatronBertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, intermediate_size=cfg.ffn_hidden_size, hidden_act="gelu_new",
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=cfg.num_tokentypes,
        layer_norm_eps=cfg.layernorm_epsilon, initializer_range=cfg.init_method_std,
        architectures=["MegatronBertForPreTraining"],
    )


def _bert_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) for every BERT tensor except QKV and the vocabulary-sized ones."""
    pairs = [(POSITION, "bert.embeddings.position_embeddings.weight"),
             (TOKENTYPE, "bert.embeddings.token_type_embeddings.weight")]
    for i in range(cfg.num_layers):
        for ours, theirs in _BERT_LAYER.items():
            pairs += [(f"{i + 1}.{ours}.{p}", f"bert.encoder.layer.{i}.{theirs}.{p}") for p in ("weight", "bias")]
    hd = head_index(cfg)
    for ours, theirs in _BERT_HEAD.items():
        pairs += [(f"{hd}.{ours}.{p}", f"{theirs}.{p}") for p in ("weight", "bias")]
    return pairs


def to_hf_megatron_bert(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MegatronBertForPreTraining's state dict (decoder tied to the word embedding)."""
    nh, h = cfg.num_attention_heads, cfg.hidden_size
    word = full[WORD][: cfg.vocab_size]
    bias = full[f"{head_index(cfg)}.lm_bias"][: cfg.vocab_size]
    out = {"bert.embeddings.word_embeddings.weight": word, "cls.predictions.decoder.weight": word,
           "cls.predictions.bias": bias, "cls.predictions.decoder.bias": bias}
    out.update({theirs: full[ours] for ours, theirs in _bert_pairs(cfg)})
    for i in range(cfg.num_layers):
        for p in ("weight", "bias"):
            q, k, v = qkv_to_hf(full[f"{i + 1}.attn.qkv.{p}"], nh).split(h, 0)
            for part, x in (("query", q), ("key", k), ("value", v)):
                out[f"bert.encoder.layer.{i}.attention.self.{part}.{p}"] = x
    return {k: v.contiguous() for k, v in out.items()}


def config_from_megatron_bert(c) -> ModelConfig:
    if c.hidden_act not in TANH_GELUS:
        raise ConfigError(f"Megatron-BERT activation {c.hidden_act!r} is not the tanh GELU this model implements")
    return ModelConfig(
        kind="bert", num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, seq_length=c.max_position_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size, ffn_hidden_size=c.intermediate_size, hidden_dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob, layernorm_epsilon=c.layer_norm_eps,
        init_method_std=c.initializer_range, num_tokentypes=c.type_vocab_size,
    )


def from_hf_megatron_bert(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_megatron_bert`."""
    rows = cfg.padded_vocab_size(1)
    full = {WORD: pad_vocab(sd["bert.embeddings.word_embeddings.weight"], rows),
            f"{head_index(cfg)}.lm_bias": pad_vocab(sd["cls.predictions.bias"], rows)}
    full.update({ours: sd[theirs] for ours, theirs in _bert_pairs(cfg)})
    for i in range(cfg.num_layers):
        for p in ("weight", "bias"):
            a = f"bert.encoder.layer.{i}.attention.self."
            qkv = torch.cat([sd[f"{a}{part}.{p}"] for part in ("query", "key", "value")], 0)
            full[f"{i + 1}.attn.qkv.{p}"] = qkv_from_hf(qkv, cfg.num_attention_heads)
    return {k: v.detach().float().contiguous() for k, v in full.items()}


# --------------------------------------------------------------------------- Llama
_LLAMA_LAYER = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj"}
LLAMA_MLP = {"mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"}


def _layer_pairs(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Layer ``i``'s modules beside the attention's q/k/v, ours -> HF's: the norms, the projection and, unless
    the layer holds experts (export/hf_moe.py maps those), the dense SwiGLU MLP."""
    return _LLAMA_LAYER if is_moe_layer(cfg, i) else {**_LLAMA_LAYER, **LLAMA_MLP}


def is_llama(cfg: ModelConfig) -> bool:
    """The options ``LlamaForCausalLM`` implements (everything else is a GPT-2-style model or refused)."""
    return (cfg.family.gpt_options and cfg.position_embedding_type == "rope" and cfg.swiglu
            and cfg.normalization == "RMSNorm")


def _check_llama(cfg: ModelConfig) -> None:
    if not is_llama(cfg):
        raise ConfigError("a Hugging Face export needs a GPT-2-style model or a Llama-style one "
                          "(--position-embedding-type rope --swiglu --normalization RMSNorm); this model mixes them")
    if cfg.rotary_percent != 1.0:
        raise ConfigError(f"LlamaForCausalLM rotates whole heads; --rotary-percent {cfg.rotary_percent} "
                          "cannot be exported")


def llama_common(cfg: ModelConfig) -> dict:
    """The config fields Llama and its mixture-of-experts kin (Mixtral, Qwen2-MoE) share, from ``cfg``."""
    _check_llama(cfg)
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.layernorm_epsilon,
        initializer_range=cfg.init_method_std, tie_word_embeddings=cfg.tied_output,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
        attention_dropout=cfg.attention_dropout, bos_token_id=None, eos_token_id=None)


def llama_config(cfg: ModelConfig):
    from transformers import LlamaConfig  # noqa: PLC0415

    return LlamaConfig(**llama_common(cfg), intermediate_size=cfg.ffn_hidden_size, head_dim=cfg.head_dim,
                       attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
                       architectures=["LlamaForCausalLM"])


def _qkv_split(cfg: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our rows [groups, heads/groups + 2, head_dim] -> HF's q [heads], k [groups], v [groups] rows.

    Both sides use the rotate-half RoPE convention, so no per-head permutation of q/k is needed
    (HF's conversion permutes only Meta's original interleaved-pair checkpoints).
    """
    g, per = cfg.query_groups, cfg.num_attention_heads // cfg.query_groups
    x = x.reshape(g, per + 2, cfg.head_dim, *x.shape[1:])
    rest = x.shape[3:]
    return x[:, :per].reshape(-1, *rest), x[:, per].reshape(-1, *rest), x[:, per + 1].reshape(-1, *rest)


def _qkv_join(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_qkv_split`."""
    g, per, hd = cfg.query_groups, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, per, hd, *rest), k.reshape(g, 1, hd, *rest), v.reshape(g, 1, hd, *rest)]
    return torch.cat(parts, 1).reshape(-1, *rest)


def _llama_linears(cfg: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.add_bias_linear else ("weight",)


def to_hf_llama(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict (``lm_head`` the word embedding when tied); an MoE model's layers without
    their experts."""
    _check_llama(cfg)
    hd = head_index(cfg)
    word = full[WORD][: cfg.vocab_size]
    out = {"model.embed_tokens.weight": word, "model.norm.weight": full[f"{hd}.ln.weight"],
           "lm_head.weight": word if cfg.tied_output else full[f"{hd}.{OUTPUT}"][: cfg.vocab_size]}
    for i in range(cfg.num_layers):
        g, h = f"{i + 1}.", f"model.layers.{i}."
        for p in _llama_linears(cfg):
            for part, x in zip("qkv", _qkv_split(cfg, full[f"{g}attn.qkv.{p}"])):
                out[f"{h}self_attn.{part}_proj.{p}"] = x
        for ours, theirs in _layer_pairs(cfg, i).items():
            for p in ("weight",) if ours.startswith("ln") else _llama_linears(cfg):
                out[f"{h}{theirs}.{p}"] = full[f"{g}{ours}.{p}"]
    return {k: v.contiguous() for k, v in out.items()}


def config_from_llama(c) -> ModelConfig:
    if bool(c.attention_bias) != bool(c.mlp_bias):
        raise ConfigError("attention_bias and mlp_bias differ; --disable-bias-linear covers both")
    return ModelConfig(**llama_fields(c), ffn_hidden_size=c.intermediate_size, add_bias_linear=bool(c.attention_bias))


def llama_fields(c) -> dict:
    """Our ModelConfig fields from what an HF Llama-kin config shares (:func:`llama_common`); refused where this
    model cannot hold it."""
    if c.hidden_act != "silu":
        raise ConfigError(f"Llama activation {c.hidden_act!r} is not the SiLU this model's SwiGLU implements")
    rope = c.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"RoPE scaling {rope.get('rope_type')!r} is not implemented "
                          "(only the default rotary embedding)")
    head_dim = getattr(c, "head_dim", None)
    if head_dim not in (None, c.hidden_size // c.num_attention_heads):
        raise ConfigError(f"head_dim {head_dim} is not hidden_size / num_attention_heads")
    groups = c.num_key_value_heads or c.num_attention_heads
    theta = float(rope.get("rope_theta", 10000.0))
    return dict(
        kind="gpt", num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, seq_length=c.max_position_embeddings,
        max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size, hidden_dropout=0.0,
        attention_dropout=float(c.attention_dropout or 0.0), layernorm_epsilon=c.rms_norm_eps,
        init_method_std=c.initializer_range, position_embedding_type="rope",
        rotary_base=int(theta) if theta.is_integer() else theta, swiglu=True, normalization="RMSNorm",
        group_query_attention=groups != c.num_attention_heads,
        num_query_groups=groups if groups != c.num_attention_heads else None,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings)


def from_hf_llama(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_llama` (vocabulary tensors padded to the t = 1 model's rows)."""
    rows, hd = cfg.padded_vocab_size(1), head_index(cfg)
    full = {WORD: pad_vocab(sd["model.embed_tokens.weight"], rows), f"{hd}.ln.weight": sd["model.norm.weight"]}
    if not cfg.tied_output:
        full[f"{hd}.{OUTPUT}"] = pad_vocab(sd["lm_head.weight"], rows)
    for i in range(cfg.num_layers):
        g, h = f"{i + 1}.", f"model.layers.{i}."
        for p in _llama_linears(cfg):
            full[f"{g}attn.qkv.{p}"] = _qkv_join(cfg, *(sd[f"{h}self_attn.{x}_proj.{p}"] for x in "qkv"))
        for ours, theirs in _layer_pairs(cfg, i).items():
            for p in ("weight",) if ours.startswith("ln") else _llama_linears(cfg):
                full[f"{g}{ours}.{p}"] = sd[f"{h}{theirs}.{p}"]
    return {k: v.detach().float().contiguous() for k, v in full.items()}
