"""Hugging Face model directories: our whole model written as one (``save_pretrained``: config.json, the weights,
the run's tokenizer) and read back (``from_pretrained``), the class chosen by the model's family and options:
GPT2LMHeadModel, MegatronBertForPreTraining and LlamaForCausalLM (``hf_format.py``), MixtralForCausalLM and
Qwen2MoeForCausalLM for models with experts (``hf_moe.py``)."""

from __future__ import annotations

import os
import re

from ..checkpoint.megatron_format import Exported
from ..errors import ConfigError, os_error_line
from . import hf_moe
from .hf_format import (
    config_from_gpt2,
    config_from_llama,
    config_from_megatron_bert,
    from_hf_gpt2,
    from_hf_llama,
    from_hf_megatron_bert,
    gpt2_config,
    llama_config,
    megatron_bert_config,
    to_hf_gpt2,
    to_hf_llama,
    to_hf_megatron_bert,
)


def _quiet() -> None:
    """No progress bars from transformers: the tools print one summary line."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()


def _model_and_state(ex: Exported):
    """The (empty) HF model of ``ex.cfg`` and ``ex``'s weights as its state dict."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, MegatronBertForPreTraining  # noqa: PLC0415

    cfg = ex.cfg
    if cfg.moe is not None:
        return hf_moe.hf_moe_class(cfg)(hf_moe.hf_moe_config(cfg)), hf_moe.to_hf_moe(cfg, ex.weights)
    if cfg.kind == "gpt" and cfg.llama_style:
        return LlamaForCausalLM(llama_config(cfg)), to_hf_llama(cfg, ex.weights)
    gpt = cfg.kind == "gpt"
    config = (gpt2_config if gpt else megatron_bert_config)(cfg)
    model = (GPT2LMHeadModel if gpt else MegatronBertForPreTraining)(config)
    return model, (to_hf_gpt2 if gpt else to_hf_megatron_bert)(cfg, ex.weights)


def hf_model(ex: Exported):
    """The HF model object holding ``ex``'s weights (GPT2LMHeadModel, MegatronBertForPreTraining,
    LlamaForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM)."""
    _quiet()
    # the HF model class per family stays here: it is the export's table, not the model's
    model, sd = _model_and_state(ex)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias", "position_ids"))]
    if missing or unexpected:
        raise ConfigError(f"HF model does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


def save_hf_dir(path: str, ex: Exported) -> str:
    """A directory ``from_pretrained`` loads (config.json + weights, and the run's tokenizer when its files
    are there: export/hf_tokenizer.py); returns what was done with the tokenizer."""
    from .hf_tokenizer import write_tokenizer  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    model = hf_model(ex)
    note, eod = write_tokenizer(path, ex.tokenizer)
    if eod is not None and ex.cfg.family.causal:  # GPT-2's convention: <|endoftext|> is both
        model.config.eos_token_id = model.config.bos_token_id = int(eod)
    try:
        model.save_pretrained(path)
    except Exception as e:  # safetensors removes its partial file and names no file: say which (F05)
        m = re.search(r"os error (\d+)", str(e))
        if m is None:
            raise
        code = int(m.group(1))
        err = OSError(code, os.strerror(code))
        raise ConfigError(os_error_line(err, os.path.join(path, "model.safetensors"))) from None
    return note


def load_hf_dir(path: str) -> Exported:
    """A GPT2LMHeadModel, MegatronBertForPreTraining, LlamaForCausalLM, MixtralForCausalLM or
    Qwen2MoeForCausalLM directory as a whole model of ours."""
    from transformers import AutoConfig, GPT2LMHeadModel, MegatronBertForPreTraining  # noqa: PLC0415

    _quiet()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json)")
    conf = AutoConfig.from_pretrained(path, local_files_only=True)
    if conf.model_type == "gpt2":
        cfg = config_from_gpt2(conf)
        sd = GPT2LMHeadModel.from_pretrained(path, local_files_only=True).state_dict()
        return Exported(cfg, from_hf_gpt2(cfg, sd), tokenizer=exported_tokenizer(path))
    if conf.model_type == "megatron-bert":
        cfg = config_from_megatron_bert(conf)
        sd = MegatronBertForPreTraining.from_pretrained(path, local_files_only=True).state_dict()
        return Exported(cfg, from_hf_megatron_bert(cfg, sd), tokenizer=exported_tokenizer(path))
    if conf.model_type == "llama":
        from transformers import LlamaForCausalLM  # noqa: PLC0415

        cfg = config_from_llama(conf)
        sd = LlamaForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
        return Exported(cfg, from_hf_llama(cfg, sd), tokenizer=exported_tokenizer(path))
    if conf.model_type in hf_moe.MODEL_TYPES:
        cfg = hf_moe.config_from_hf_moe(conf)
        sd = hf_moe.hf_moe_class(cfg).from_pretrained(path, local_files_only=True).state_dict()
        return Exported(cfg, hf_moe.from_hf_moe(cfg, sd), tokenizer=exported_tokenizer(path))
    raise ConfigError(f"{path}: model type {conf.model_type!r} is not supported (gpt2, megatron-bert, llama, "
                      f"{', '.join(hf_moe.MODEL_TYPES)})")


def exported_tokenizer(path: str) -> dict:
    """The tokenizer of a Hugging Face directory: the one its export recorded (hf_tokenizer.RECORD: the training
    run's flags and fingerprint), plus ``exported_dir`` when the directory holds transformers' tokenizer files."""
    from .hf_tokenizer import read_record  # noqa: PLC0415

    tok = read_record(path)
    if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        tok["exported_dir"] = path
    return tok
