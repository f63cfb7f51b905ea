"""BERT reports its masked-LM and sentence-order losses separately; the gradient stays their sum.

Engine: the per-step components add up to the total, a pipelined run (d=2) reports the same
components as the single-process run, and the evaluation's MLM loss equals an independent
masked cross-entropy over the model's logits. Trainer: one tiny single-process BERT run whose
JSONL and log lines (read with Megatron-style regular expressions) agree, and whose ``lm loss
PPL`` is exp of the MLM loss alone.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from e2e import PY, REPO, corpus, read_metrics, run, train_args  # noqa: F401
from multiproc import run_workers
from pipeline_harness import _dataset, train_tiny
from test_log_format import MEGATRON, VALID, grab

from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import ParallelState
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.tensor_parallel.group import TPGroup

KW = dict(kind="bert-tiny", steps=4, global_batch=8, micro=1)


def _pipelined(layout):
    return train_tiny("flush", layout=layout, **KW)


def test_engine_components_sum_to_the_total_and_survive_pipelining():
    ref = train_tiny("flush", **KW)
    assert len(ref["components"]) == 4
    for loss, c in zip(ref["losses"], ref["components"]):
        assert set(c) == {"lm_loss", "sop_loss"} and c["lm_loss"] > 1.0 and c["sop_loss"] > 0.0
        assert c["lm_loss"] + c["sop_loss"] == pytest.approx(loss, rel=1e-6)
    outs = run_workers(_pipelined, 2, (1, 2, 1), timeout=240)
    last = next(o for o in outs if o["last"])
    assert next(o for o in outs if not o["last"])["components"] is None
    assert last["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for mine, theirs in zip(last["components"], ref["components"]):
        for key in ("lm_loss", "sop_loss"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6)


def test_gpt_steps_have_no_components():
    out = train_tiny("flush", kind="gpt-tiny", steps=2)
    assert out["components"] is None and all(math.isfinite(x) for x in out["losses"])


def test_evaluation_mlm_loss_is_the_masked_cross_entropy():
    """``evaluate_components``' lm_loss/sop_loss against cross-entropies written out here."""
    cfg = get_preset("bert-tiny", hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(5)
    spec = ModelSpec(cfg, ModelGroups(TPGroup.from_state(ParallelState.single())), 5)
    stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), ParallelState.single(),
                          PipelineConfig("flush", 2, 2), OptimizerConfig("adam", lr=1e-3),
                          (2, cfg.seq_length, cfg.hidden_size))
    data = _dataset(cfg, 8)
    batches = [spec.make_batch({k: v[i * 2:(i + 1) * 2] for k, v in data.items()}) for i in range(4)]
    got = stage.evaluate_components(4, lambda i: batches[i])
    lm, so = [], []
    with torch.no_grad():
        for b in batches:
            x = None
            for layer in stage.newest_layers:
                x = layer(x, b)
            logits, sop = x
            ce = F.cross_entropy(logits.float()[..., :cfg.vocab_size].reshape(-1, cfg.vocab_size),
                                 b["labels"].reshape(-1), reduction="none")
            mask = b["loss_mask"].reshape(-1)
            lm.append(float((ce * mask).sum() / mask.sum()))
            so.append(float(F.cross_entropy(sop.float(), b["sop_label"])))
    assert got["lm_loss"] == pytest.approx(sum(lm) / 4, rel=1e-5)
    assert got["sop_loss"] == pytest.approx(sum(so) / 4, rel=1e-5)
    assert got["loss"] == pytest.approx(got["lm_loss"] + got["sop_loss"], rel=1e-6)
    assert stage.evaluate(4, lambda i: batches[i]) == got["loss"]


def test_trainer_logs_mlm_and_sop_separately(corpus, tmp_path):  # noqa: F811
    metrics = str(tmp_path / "m.jsonl")
    args = train_args(corpus, preset="bert-tiny", schedule="flush", iters=6,
                      extra=("--log-interval", "1", "--eval-interval", "3", "--metrics-file", metrics))
    res = run([PY, os.path.join(REPO, "pretrain_bert.py"), *args], timeout=240)
    assert res.returncode == 0, res.describe()
    records = read_metrics(metrics)
    train = [r for r in records if r["type"] == "train"]
    assert [r["iteration"] for r in train] == list(range(6))
    for r in train:
        assert r["lm_loss"] + r["sop_loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert r["lm_loss"] > r["sop_loss"] > 0.0
    lines = [ln for ln in res.stderr.splitlines() if re.search(MEGATRON["iteration"], ln) and "lm loss:" in ln]
    assert len(lines) == 6
    for ln, r in zip(lines, train):  # one step per log window: the line's numbers are the record's
        assert int(grab(MEGATRON["iteration"], ln)[0]) == r["iteration"] + 1
        assert float(grab(MEGATRON["lm"], ln)) == pytest.approx(r["lm_loss"], rel=1e-6)
        assert float(grab(MEGATRON["sop"], ln)) == pytest.approx(r["sop_loss"], rel=1e-6)
    evals = [r for r in records if r["type"] == "eval"]
    vlines = [ln for ln in res.stderr.splitlines() if "validation loss at" in ln]
    assert [e["split"] for e in evals] == ["valid", "valid", "test"] and len(vlines) == 3
    for e, ln in zip(evals, vlines):
        assert e["lm_loss"] + e["sop_loss"] == pytest.approx(e["loss"], rel=1e-6)
        assert e["ppl"] == pytest.approx(math.exp(e["lm_loss"]), rel=1e-12)
        assert float(grab(VALID["lm"], ln)) == pytest.approx(e["lm_loss"], rel=1e-6)
        assert float(grab(VALID["lm_ppl"], ln)) == pytest.approx(math.exp(e["lm_loss"]), rel=1e-6)
        assert float(grab(VALID["sop"], ln)) == pytest.approx(e["sop_loss"], rel=1e-6)
        assert grab(VALID["sop_ppl"], ln) is None
