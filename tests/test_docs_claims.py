"""The docs say what is true today (issue 37): each documented claim that a flag is refused or accepted is
checked against the command line, and the presets table is the generator's output."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from megatron_2bw.cli import build_config, build_parser, parse_args
from megatron_2bw.errors import ConfigError
from megatron_2bw.yaml_cfg import MEGATRON_UNSUPPORTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = os.path.join(REPO, "docs", "training.md")
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--device", "cpu",
        "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"]
REFUSED_SENTENCE = re.compile(r"Megatron flags without a counterpart here \((.*?)\) are refused", re.S)
IMPLEMENTED_SENTENCE = re.compile(r"are refused with one line naming what to use instead;(.*?) are\s+implemented", re.S)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _flags_in(text: str) -> list[str]:
    return re.findall(r"`(--[a-z0-9][a-z0-9-]*)", text)


def _known() -> dict[str, object]:
    out = {}
    for kind in ("gpt", "bert"):
        out.update({s: a for s, a in build_parser(kind)._option_string_actions.items() if s.startswith("--")})  # noqa: SLF001
    return out


def test_flags_documented_as_refused_are_refused():
    found = REFUSED_SENTENCE.search(_read(TRAINING))
    assert found, "docs/training.md lost its sentence listing the refused Megatron flags"
    listed = _flags_in(found.group(1))
    assert sorted(listed) == sorted(MEGATRON_UNSUPPORTED), "the documented list differs from yaml_cfg's"
    for flag in listed:
        with pytest.raises(ConfigError, match=f"Megatron flag not supported by megatron_2bw: {flag} "):
            parse_args([*BASE, flag, "1"], "gpt")


def test_flags_documented_as_implemented_build_a_config():
    """The flags the docs once called refused (--sequence-parallel, interleaving, RoPE, SwiGLU) are accepted."""
    found = IMPLEMENTED_SENTENCE.search(_read(TRAINING))
    assert found
    listed = _flags_in(found.group(1))
    assert {"--sequence-parallel", "--virtual-pipeline-model-parallel-size", "--position-embedding-type",
            "--swiglu"} <= set(listed)
    argv = [*BASE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
            "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved-1f1b",
            "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--global-batch-size", "8"]
    cfg = build_config(parse_args(argv, "gpt"), "gpt", 4)
    assert cfg.model.sequence_parallel and cfg.pipeline.virtual_stages == 2 and cfg.model.swiglu
    assert cfg.model.position_embedding_type == "rope" and cfg.model.normalization == "RMSNorm"


def _table_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, description) of every flags-table row (its first cell starts with a flag)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| `--"):
            cells = line.split("|")
            rows.append((cells[1], "|".join(cells[2:])))
    return rows


def _value_for(action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return ["1"]


def test_every_flag_in_the_tables_is_a_flag_of_the_trainer_and_accepted_rows_parse():
    known = _known()
    rows = _table_rows(_read(TRAINING))
    assert len(rows) > 40
    flags = [f for cell, _ in rows for f in _flags_in(cell)]
    assert flags and not [f for f in flags if f not in known], [f for f in flags if f not in known]
    accepted = [f for cell, desc in rows if desc.strip().startswith("accepted") for f in _flags_in(cell)]
    assert len(accepted) >= 10
    for flag in accepted:  # documented as accepted: a run's flags with it parse
        parse_args([*BASE, flag, *_value_for(known[flag])], "gpt")


def test_presets_table_is_generated():
    path = os.path.join(REPO, "tools", "presets_table.py")
    spec = importlib.util.spec_from_file_location("presets_table", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = _read(os.path.join(REPO, "docs", "your-data.md"))
    assert gen.documented_table(doc) == gen.table(), "run: python tools/presets_table.py --write"
    assert "| `llama-8b` | Llama | 32 | 4096 | 32 | 8 | 14336 | 8192 | 128256 |" in gen.table()


def test_distributed_optimizer_predict_error_advises_what_the_docs_recommend():
    """The error advised `dc or none`; the docs recommend `ef` (dc trains like plain 2BW), and ef builds."""
    argv = [*BASE, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]
    with pytest.raises(ConfigError, match=r"does not support --2bw-compensation predict .*; use ef \(") as e:
        build_config(parse_args([*argv, "--2bw-compensation", "predict"], "gpt"), "gpt", 4)
    assert "\n" not in str(e.value)
    assert build_config(parse_args([*argv, "--2bw-compensation", "ef"], "gpt"), "gpt", 4).pipeline.compensation == "ef"
