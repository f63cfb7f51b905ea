"""The start-up line names every choice that changes the math (issue 37): the model family's features,
sequence parallelism, the optimizer, the schedule with 2BW's compensation, the precision."""

from __future__ import annotations

from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.training.log_format import math_choices

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3", "--device", "cpu",
        "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def line(*extra: str, world: int = 1) -> str:
    return math_choices(build_config(parse_args([*BASE, *extra], "gpt"), "gpt", world))


def test_gpt2_defaults_are_named():
    s = line("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", world=2)
    assert "model learned positions, GELU, LayerNorm |" in s and "sequence parallel off" in s
    assert "optimizer Adam (betas 0.9/0.999), clip 1" in s and "schedule 2bw, 2BW compensation none" in s
    assert s.endswith("precision fp32")


def test_llama_sp_muon_ef_bf16_are_named():
    s = line("--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
             "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--optimizer", "muon", "--bf16",
             "--2bw-compensation", "ef", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", world=4)
    assert "model RoPE (base 10000), SwiGLU, RMSNorm, GQA 2 groups, untied output, no linear biases |" in s
    assert "sequence parallel on" in s and "optimizer Muon (momentum 0.95, 5 NS steps; AdamW elsewhere)" in s
    assert "2BW compensation ef (gamma 1)" in s and "precision bf16 (fp32 gradient accumulation)" in s


def test_flush_and_fp16_dynamic_scale():
    s = line("--pipeline-schedule", "flush", "--fp16", "--optimizer", "sgd", "--clip-grad", "0", "--hidden-dropout",
             "0.1")
    assert "model learned positions, GELU, LayerNorm, dropout 0.1 hidden, 0 attention |" in s
    assert "schedule flush |" in s and "compensation" not in s
    assert "optimizer SGD (momentum 0.9), no clipping" in s and "precision fp16, dynamic loss scale" in s


class _Writer:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, rec: dict) -> None:
        self.records.append(rec)


def _report(device: str, monkeypatch):
    import types

    import torch

    from megatron_2bw.fused import Kernels
    from megatron_2bw.training import report

    monkeypatch.setattr(report.torch.cuda, "get_device_name", lambda dev: "NVIDIA H200")
    cfg = build_config(parse_args(BASE, "gpt"), "gpt", 1)
    state = types.SimpleNamespace(device=torch.device(device), t=1, d=1, w=1, c=1, data_width=1, world_size=1)
    stats = {"weight_bytes": 1 << 20, "grad_bytes": 1 << 20, "optimizer_bytes": 2 << 20}
    rep = report.StepReport(cfg, state, _Writer(), (), lambda n: n, 0)
    rep.start([stats], 0, Kernels(), None)
    return rep


def test_on_cuda_the_log_says_its_clocks_are_the_hosts(monkeypatch, caplog):
    """gpu-review-2 N15: the bubble column and the update wait are host times on a GPU; the log says so once."""
    import logging

    from megatron_2bw.training.report import HOST_CLOCK_NOTE

    with caplog.at_level(logging.INFO, logger="megatron_2bw"):
        rep = _report("cuda", monkeypatch)
    assert sum(HOST_CLOCK_NOTE in r.getMessage() for r in caplog.records) == 1
    assert rep.metrics.records[0]["type"] == "start"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_2bw"):
        _report("cpu", monkeypatch)
    assert not any(HOST_CLOCK_NOTE in r.getMessage() for r in caplog.records)
