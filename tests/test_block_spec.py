"""The block spec: a transformer layer is built from the family table's blocks, and each block's torch-free
arithmetic (config/blocks.py: parameter names, full shapes, split dimension) is what its builder makes, for
GPT, Llama and BERT at t = 1 and 2; the checkpoint names, parameter counts and the BERT head's extra parameters
follow from the same statements; and one more MLP builder (registered here as a mixture-of-experts MLP would
be) flows into the layer, the counts, the FLOPs and the names without touching them."""

from __future__ import annotations

import math

import pytest
import torch.nn.functional as F
from torch import nn

from megatron_2bw.checkpoint import names
from megatron_2bw.config import ModelConfig, arith, blocks
from megatron_2bw.config.families import FAMILIES
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models import families as model_families
from megatron_2bw.models import transformer
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.planner import layer_costs
from megatron_2bw.tensor_parallel.group import TPGroup
from megatron_2bw.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

KINDS = ["gpt-tiny", "llama-tiny", "bert-tiny"]


def _built(module: nn.Module) -> list[tuple[str, tuple[int, ...], int | None, tuple[int, ...]]]:
    """(name, full shape, split dimension, this rank's shape) of each parameter, read off its ``Init``."""
    out = []
    for n, p in module.named_parameters():
        init = getattr(p, "init", None)
        full = tuple(init.full_shape) if init is not None else tuple(p.shape)
        out.append((n, full, init.dim if init is not None else None, tuple(p.shape)))
    return out


def _local(shape: tuple[int, ...], split: int | None, t: int) -> tuple[int, ...]:
    return tuple(d // t if i == split else d for i, d in enumerate(shape))


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_each_block_states_what_its_builder_makes(kind, t):
    cfg = get_preset(kind)
    layer = transformer.TransformerLayer(cfg, ModelGroups(TPGroup(None, 1 % t, t)), 3, 0, causal=True)
    stated = blocks.layer_params(cfg)
    assert [(p.name, p.shape, p.split, _local(p.shape, p.split, t)) for p in stated] == _built(layer)
    assert names.layer_suffixes(cfg) == [n for n, _ in layer.named_parameters()]
    assert arith.layer_params(cfg, t) == sum(p.numel() for p in layer.parameters())
    for slot, block in transformer.layer_spec(cfg).slots().items():  # each block against its own submodule
        own = [(p.name, p.shape, p.split, _local(p.shape, p.split, t)) for p in block.arith.params(cfg)]
        assert own == _built(getattr(layer, slot)), slot
    assert blocks.layer_macs(cfg) == sum(math.prod(p.shape) for p in stated if len(p.shape) == 2)


def test_the_tables_agree():
    """The models' blocks point at the config's arithmetic; the slots are the config's order."""
    assert set(transformer.MLPS) == set(blocks.MLP_BLOCKS)
    assert all(transformer.MLPS[k].arith is blocks.MLP_BLOCKS[k] for k in blocks.MLP_BLOCKS)
    assert transformer.SELF_ATTENTION.arith is blocks.SELF_ATTENTION and transformer.NORM.arith is blocks.NORM
    assert list(transformer.LayerSpec().slots()) == [s for s, _, _ in blocks.LAYER_SLOTS]
    assert set(model_families.FAMILIES) == set(FAMILIES)
    assert all(model_families.FAMILIES[k].causal == FAMILIES[k].causal for k in FAMILIES)


@pytest.mark.parametrize("t", [1, 2])
def test_the_heads_extra_parameters_are_the_familys(t):
    """BERT's head beyond its norm and the tied logits: names, shapes and split as the family states them
    (with the Megatron names), and GPT's head has none; the head's count is the built one."""
    for kind in ("bert-tiny", "gpt-tiny"):
        cfg = get_preset(kind)
        spec = ModelSpec(cfg, ModelGroups(TPGroup(None, 0, t)), 5)
        head = spec.build(cfg.num_layers + 1, cfg.num_layers + 2)[0]
        extra = [x for x in _built(head) if not x[0].startswith("ln.") and x[0] != "word_weight"]
        stated = cfg.family.head.params(cfg, cfg.padded_vocab_size(t))
        assert sorted(extra) == sorted((p.name, p.shape, p.split, _local(p.shape, p.split, t)) for p in stated)
        assert arith.head_params(cfg, t) == sum(p.numel() for p in head.parameters())
    assert names.BERT_HEAD["pooler.weight"] == ("language_model", "pooler", "dense.weight")


class _PlainMLP(nn.Module):
    """A bias-free ReLU MLP: what a new MLP block looks like to the layer."""

    def __init__(self, cfg: ModelConfig, ctx, prefix: str) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.w_in = ColumnParallelLinear(h, f, ctx.tp, seed=ctx.seed, name=f"{prefix}.w_in", std=0.02, bias=False,
                                         recipe=ctx.recipe)
        self.w_out = RowParallelLinear(f, h, ctx.tp, seed=ctx.seed, name=f"{prefix}.w_out", std=0.02, bias=False,
                                       recipe=ctx.recipe)

    def forward(self, x):
        return self.w_out(F.relu(self.w_in(x)))


class _PlainMLPArith(blocks.BlockArith):
    def params(self, model):
        h, f = model.hidden_size, model.ffn_hidden_size
        return [blocks.Param("w_in.weight", (f, h), 0, "mlp.dense_h_to_4h"),
                blocks.Param("w_out.weight", (h, f), 1, "mlp.dense_4h_to_h")]

    def macs(self, model):
        return 2 * model.hidden_size * model.ffn_hidden_size

    def stash(self, model):
        return blocks.Terms(seq=model.hidden_size, split=2 * model.ffn_hidden_size)


def test_one_more_mlp_builder_is_one_table_entry(monkeypatch):
    """Registered in the two tables and chosen by ``ModelConfig.mlp_block``: the model builds it, and the
    counts, FLOPs, stash, checkpoint names and Megatron paths read its statements."""
    arith_entry = _PlainMLPArith()
    monkeypatch.setitem(blocks.MLP_BLOCKS, "plain", arith_entry)
    monkeypatch.setitem(transformer.MLPS, "plain", transformer.Block(_PlainMLP, arith_entry))
    monkeypatch.setattr(ModelConfig, "mlp_block", property(lambda self: "plain"))
    cfg = get_preset("gpt-tiny")
    h, f, s = cfg.hidden_size, cfg.ffn_hidden_size, cfg.seq_length
    model = nn.ModuleList(ModelSpec(cfg, ModelGroups(), 1).build(0, cfg.num_layers + 2))
    assert isinstance(model[1].mlp, _PlainMLP)
    assert names.layer_suffixes(cfg)[-2:] == ["mlp.w_in.weight", "mlp.w_out.weight"]
    # the new MLP's 2hf; QKV and the projection with their biases (4h^2 + 4h); two LayerNorms (4h)
    assert arith.layer_params(cfg, 1) == sum(p.numel() for p in model[1].parameters()) == 2 * h * f + 4 * h * h + 8 * h
    assert names.megatron_path(cfg, "1.mlp.w_out.weight")[-1] == "layers.0.mlp.dense_4h_to_h.weight"
    attn_macs = h * blocks.qkv_outputs(cfg) + h * h
    assert arith.layer_forward_flops(cfg, 2, 1) == 2 * 2 * s * (attn_macs + 2 * h * f) + 4 * 2 * s * s * h
    b, e, a = 2, 2, cfg.num_attention_heads
    masks = 2 * b * s * h if cfg.hidden_dropout > 0 else 0  # the two hidden-dropout masks (1 byte each)
    kv = 2 * cfg.query_groups * cfg.head_dim
    want = (4 * h + 2 * h + kv + 2 * f) * b * s * e + masks + 4 * a * b * s  # + the fused core's log-sum-exp
    assert layer_costs.layer_stash_bytes(cfg, b, 1, e, kernel="fused") == want
