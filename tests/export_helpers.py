"""Shared pieces of the export tests: a tiny model with non-trivial weights and transformers' converters."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from megatron_2bw.checkpoint.megatron_format import Exported
from megatron_2bw.config.presets import get_preset
from megatron_2bw.export.model_io import build_full_model, global_state_dict, load_full
from megatron_2bw.models.spec import run_layers

CONVERTERS_ENV = "HF_MEGATRON_CONVERTERS"


def tiny(kind: str = "gpt", seed: int = 7, **overrides) -> tuple[Exported, torch.nn.ModuleList]:
    """A tiny model whose biases and LayerNorms are random too (init leaves them 0/1)."""
    cfg = get_preset(f"{kind}-tiny", **overrides)
    model = build_full_model(cfg, seed).eval()
    g = torch.Generator().manual_seed(seed)
    full = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in global_state_dict(model).items()}
    full["0.word.weight"][cfg.vocab_size:] = 0.0  # padded vocabulary rows stay zero
    if kind == "bert":
        full[f"{cfg.num_layers + 1}.lm_bias"][cfg.vocab_size:] = 0.0
    load_full(model, cfg, full)
    return Exported(cfg, global_state_dict(model), iteration=11), model


def gpt_logits(model, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return run_layers(list(model), {"tokens": tokens})[..., :vocab]


def bert_batch(cfg, b: int = 2, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    s = cfg.seq_length
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[-1, s * 3 // 4:] = False
    return {"tokens": torch.randint(0, cfg.vocab_size, (b, s), generator=g),
            "token_types": (torch.arange(s) >= s // 2).long().expand(b, s).contiguous(), "pad": pad}


def bert_outputs(model, batch: dict, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        lm, sop = run_layers(list(model), {"tokens": batch["tokens"], "token_types": batch["token_types"],
                                           "attention_mask": batch["pad"][:, None, None, :]})
    return lm[..., :vocab], sop


def hf_converter(name: str):
    """transformers' ``convert_megatron_{name}_checkpoint`` module (name: gpt2 or bert).

    transformers 5.x no longer ships these scripts; point $HF_MEGATRON_CONVERTERS at a folder
    holding them (e.g. unzipped from the transformers 4.40 wheel) to run the comparison.
    """
    module = f"convert_megatron_{name}_checkpoint"
    try:
        return importlib.import_module(f"transformers.models.megatron_{name}.{module}")
    except ModuleNotFoundError:
        pass
    path = os.path.join(os.environ.get(CONVERTERS_ENV, ""), f"{module}.py")
    if not os.path.isfile(path):
        pytest.skip(f"transformers has no {module}; run: pip download transformers==4.40.2 --no-deps -d W && unzip -j "
                    f"W/*.whl 'transformers/models/megatron_*/convert_megatron_*' -d DIR; export {CONVERTERS_ENV}=DIR")
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
