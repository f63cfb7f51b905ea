"""A pre-LayerNorm transformer layer (causal or bidirectional) built from tensor-parallel layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fused import Kernels, layer_norm
from ..tensor_parallel.group import TPGroup
from ..tensor_parallel.init import normal_full
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..pipeline.recompute import checkpointed
from ..pipeline.recompute_policy import RecomputePolicy
from ..tensor_parallel.random import RNGTracker


def interleaved_qkv(cfg: ModelConfig, seed: int, name: str) -> torch.Tensor:
    """Full QKV weight with rows grouped per head (q, k, v of head 0, then head 1, ...).

    Splitting its rows into t contiguous blocks gives each tensor rank whole heads, so the
    dense model (t = 1) and every sharded one use the same numbers.
    """
    h, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    return normal_full((nh * 3 * hd, h), cfg.init_method_std, seed, name)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, prefix: str, causal: bool, rng: RNGTracker | None):
        super().__init__()
        cfg.check_tensor_parallel(tp.size)
        self.causal, self.rng, self.dropout = causal, rng, cfg.attention_dropout
        self.selective = False  # re-run core() in backward (RecomputePolicy selective)
        self.heads = cfg.num_attention_heads // tp.size
        self.head_dim = cfg.head_dim
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, 3 * cfg.hidden_size, tp, seed=seed, name=f"{prefix}.qkv", std=cfg.init_method_std,
            full_weight=interleaved_qkv(cfg, seed, f"{prefix}.qkv"),
        )
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, tp, seed=seed, name=f"{prefix}.proj", std=out_std)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(QK^T) with dropout, times V: what selective recomputation re-runs.

        A given ``mask`` is complete (GPT's --reset-attention-mask is already causal)."""
        p = self.dropout if self.training else 0.0
        causal = self.causal and mask is None
        if p > 0 and self.rng is not None:
            with self.rng.fork():  # this rank's heads draw their own dropout masks
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.selective:
            out = checkpointed(self.core, q, k, v, mask, tracker=self.rng)
        else:
            out = self.core(q, k, v, mask)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, prefix: str):
        super().__init__()
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, tp, seed=seed, name=f"{prefix}.fc1", std=cfg.init_method_std)
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, tp, seed=seed, name=f"{prefix}.fc2", std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    """x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))). Pipeline signature: forward(x, batch)."""

    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, seed: int, index: int, *, causal: bool,
        rng: RNGTracker | None = None, kernels: Kernels | None = None,
    ):
        super().__init__()
        prefix = f"layers.{index}"
        self.ln1 = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, kernels)
        self.attn = ParallelAttention(cfg, tp, seed, f"{prefix}.attn", causal, rng)
        self.ln2 = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, kernels)
        self.mlp = ParallelMLP(cfg, tp, seed, f"{prefix}.mlp")
        self.hidden_dropout = cfg.hidden_dropout
        self.rng = rng
        # Full recomputation: a chunk's first layer runs the chunk's later layers itself, under one
        # checkpoint; those then pass their input through (the pipeline calls layers one by one).
        self.chunk: tuple[TransformerLayer, ...] = ()
        self.absorbed = False

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        if self.absorbed:
            return x
        if not self.chunk:
            return self.body(x, batch)
        return checkpointed(lambda h: self._run_chunk(h, batch), x, tracker=self.rng)

    def _run_chunk(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        for layer in self.chunk:
            x = layer.body(x, batch)
        return x

    def body(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        mask = batch.get("attention_mask")
        x = x + F.dropout(self.attn(self.ln1(x), mask), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.hidden_dropout, self.training)


def apply_recompute(layers: list[nn.Module], policy: RecomputePolicy | None) -> None:
    """Mark a stage's transformer layers (consecutive in ``layers``) for ``policy``."""
    blocks = [m for m in layers if isinstance(m, TransformerLayer)]
    if policy is None or not policy.active:
        return
    for layer in blocks:
        layer.attn.selective = policy.granularity == "selective"
    for first, count, recomputed in policy.segments(len(blocks)):
        if recomputed:
            group = blocks[first:first + count]
            group[0].chunk = tuple(group)
            for layer in group[1:]:
                layer.absorbed = True
