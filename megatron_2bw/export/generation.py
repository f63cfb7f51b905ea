"""Text generation from a GPT's full state dict, with a key/value cache.

The forward pass here is a functional copy of the model's own (``models/gpt.py``,
``models/transformer.py``: pre-norm, QKV rows interleaved per head or per query group, tanh GELU
or SwiGLU, learned positions or RoPE, tied or separate output layer) that also accepts cached keys
and values of earlier positions, so each new token costs one position's work. A layer with experts runs the
model's own MoE layer (``moe/layer.py``, every expert local) on the new positions: routing is per token, so
it needs no cache. Tests check it against the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..checkpoint.names import OUTPUT, POSITION, WORD, head_index, is_moe_layer
from ..config import ModelConfig
from ..errors import ConfigError
from ..models.norms import norm_functional
from ..models.rope import apply_rotary, rotary_tables
from ..moe import MoELayer


@dataclass
class KVCache:
    """Keys and values ``[b, groups, positions, head_dim]`` of every layer for the positions seen so far."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when ``temperature`` is 0."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


class CachedGPT:
    """A GPT's forward over its full (t = 1) state dict, optionally extending a :class:`KVCache`."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, router: dict[int, torch.Tensor] | None = None) -> None:
        if not cfg.family.causal:
            raise ConfigError(f"generation needs a GPT model, this checkpoint holds a {cfg.kind} model")
        self.cfg = cfg
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.w[WORD] = self.w[WORD][: cfg.vocab_size]
        self.router = router or {}  # layer -> expert bias (Exported.router)
        self.out = self.w[WORD] if cfg.tied_output else self.w[f"{head_index(cfg)}.{OUTPUT}"][: cfg.vocab_size]
        self.experts = {i: self._moe_layer(i) for i in range(cfg.num_layers) if is_moe_layer(cfg, i)}

    def _moe_layer(self, i: int) -> MoELayer:
        """Layer ``i``'s MoE MLP holding its weights (``{i+1}.mlp.moe.*``), all experts local, in eval mode."""
        moe, prefix = replace(self.cfg.moe, expert_model_parallel_size=1), f"{i + 1}.mlp.moe."
        w = next(iter(self.w.values()))
        layer = MoELayer(moe, self.cfg.hidden_size, gated=self.cfg.swiglu, dtype=w.dtype).to(w.device).eval()
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(self.w[prefix + name])
            if layer.router.expert_bias is not None:  # routes with the bias the weights were trained with
                if i not in self.router:
                    raise ConfigError(f"layer {i} routes with an expert bias the checkpoint does not hold (only "
                                      "torch_dist trainer checkpoints save it)")
                layer.router.expert_bias.copy_(self.router[i])
        return layer

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return norm_functional(self.cfg, x, self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    def _lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    def _attention(self, x: torch.Tensor, i: int, cache: KVCache | None, start: int) -> torch.Tensor:
        b, s, h = x.shape
        cfg = self.cfg
        g, hd = cfg.query_groups, cfg.head_dim
        per = cfg.num_attention_heads // g
        qkv = self._lin(x, f"{i + 1}.attn.qkv").view(b, s, g, per + 2, hd)
        q = qkv[:, :, :, :per].reshape(b, s, g * per, hd).transpose(1, 2)
        k, v = qkv[:, :, :, per].transpose(1, 2), qkv[:, :, :, per + 1].transpose(1, 2)
        if cfg.rotary_dim:
            cos, sin = rotary_tables(torch.arange(start, start + s, device=x.device), cfg.rotary_dim, cfg.rotary_base,
                                     x.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        past = 0
        if cache is not None:
            if cache.keys[i] is not None:
                past = cache.keys[i].shape[2]
                k, v = torch.cat([cache.keys[i], k], 2), torch.cat([cache.values[i], v], 2)
            cache.keys[i], cache.values[i] = k, v
        gqa = {"enable_gqa": True} if per > 1 else {}
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        else:  # new position j may see every cached position and new positions up to j
            new_pos = past + torch.arange(s, device=x.device)
            mask = torch.arange(past + s, device=x.device)[None, :] <= new_pos[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        return self._lin(out.transpose(1, 2).reshape(b, s, h), f"{i + 1}.attn.proj")

    def _mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if i in self.experts:  # the MoE layer takes [s, b, h]
            return self.experts[i](x.transpose(0, 1)).transpose(0, 1)
        if self.cfg.swiglu:
            hidden = F.silu(self._lin(x, f"{i + 1}.mlp.gate")) * self._lin(x, f"{i + 1}.mlp.up")
        else:
            hidden = F.gelu(self._lin(x, f"{i + 1}.mlp.fc1"), approximate="tanh")
        return self._lin(hidden, f"{i + 1}.mlp.fc2")

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` of ``tokens`` placed after the cache's positions (the cache is extended)."""
        start = cache.length if cache is not None else 0
        if start + tokens.shape[1] > self.cfg.max_position_embeddings:
            raise ConfigError(
                f"prompt plus new tokens exceed the model's {self.cfg.max_position_embeddings} positions "
                "(shorten the prompt or lower --max-new-tokens)")
        if cache is not None and not cache.keys:
            cache.keys, cache.values = [None] * self.cfg.num_layers, [None] * self.cfg.num_layers
        x = F.embedding(tokens, self.w[WORD])
        if POSITION in self.w:
            x = x + self.w[POSITION][start: start + tokens.shape[1]]
        for i in range(self.cfg.num_layers):
            x = x + self._attention(self._ln(x, f"{i + 1}.ln1"), i, cache, start)
            x = x + self._mlp(self._ln(x, f"{i + 1}.ln2"), i)
        return F.linear(self._ln(x, f"{head_index(self.cfg)}.ln"), self.out)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[b]`` from last-position logits ``[b, vocab]``."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: CachedGPT, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(0.0),
             *, seed: int = 0, stop: int | None = None, use_cache: bool = True,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """New token ids after ``prompt`` (stops early at ``stop``); ``on_token`` sees each as it comes."""
    if not prompt:
        raise ConfigError("a prompt must hold at least one token")
    device = model.w[WORD].device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], device=device)
    cache = KVCache() if use_cache else None
    step_input, out = ids, []
    for _ in range(max_new_tokens):
        logits = model.forward(step_input if use_cache else ids, cache)[:, -1]
        tok = next_token(logits, sampling, gen)
        out.append(int(tok))
        if on_token is not None:
            on_token(out[-1])
        if out[-1] == stop:
            break
        ids = torch.cat([ids, tok[:, None]], 1)
        step_input = tok[:, None]
    return out
