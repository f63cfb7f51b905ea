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
