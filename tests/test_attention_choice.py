"""Review 2 N8 (issue 44): ``--attention-backend auto``'s kernel is said at start-up and the planner prices that kernel.

On a GPU, ``auto`` with grouped-query heads and an attention mask (``--reset-attention-mask`` at c = 1) falls to
SDPA's math path; the planner, told about the documents (``Cluster.reset_attention_mask``, ``tools/plan.py
--reset-attention-mask``), prices the math kernel's core (three fp32 ``[b, a, s, s]`` tensors, Q, K and V promoted)
there and the fused kernel's log-sum-exp elsewhere; under context parallelism documents travel as ids, so no
core is math: the ring keeps the same with and without them, all_gather's tiled blocks their output and
log-sum-exp. The start-up line names the kernel in each case, and a
run logs it before its first step.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.attention_choice import attention_kernel_choice
from megatron_2bw.planner.context_costs import context_microbatch_costs
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import analytic_microbatch_costs, attention_kernel
from megatron_2bw.training.launch import attention_line, prepare

GQA = ModelConfig("gpt", 2, 1024, 16, 4096, 4096, 32000, group_query_attention=True, num_query_groups=4,
                  attention_dropout=0.0, hidden_dropout=0.0)
MHA = replace(GQA, group_query_attention=False, num_query_groups=None)
H100 = load_cluster("dgx-h100")
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
         "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
         "--group-query-attention", "--num-query-groups", "2", "--hidden-dropout", "0"]


def test_the_choice_by_device_heads_and_mask():
    assert attention_kernel_choice("auto", False, True, True, False)[0] == "math"
    assert attention_kernel_choice("auto", False, True, False, False)[0] == "fused"
    assert attention_kernel_choice("auto", False, False, True, False)[0] == "fused"  # MHA: memory-efficient + mask
    assert attention_kernel_choice("auto", True, True, True, False)[0] == "fused"  # the CPU flash kernel takes both
    assert attention_kernel_choice("auto", True, False, False, True)[0] == "math"  # CPU dropout
    assert attention_kernel_choice("auto", False, True, True, False, fused_kernels=False)[0] == "unfused"
    assert attention_kernel_choice("unfused", False, True, True, False)[0] == "unfused"
    assert attention_kernel_choice("fused", False, False, False, False)[0] == "fused"


def test_the_planner_prices_gqa_documents_auto_as_math():
    """bf16, b = 1, t = 1, s = 4096, 16 heads: the math core keeps the fp32 softmax (4 a s^2 bytes) and Q, K, V
    promoted to fp32 with K and V repeated per head (4 x 3h - 2(h + 2g d) bytes a token); fused only 4 a s."""
    documents = replace(H100, reset_attention_mask=True)
    assert attention_kernel(documents, GQA, masked=True) == "math"
    math_costs = analytic_microbatch_costs(GQA, documents, "bf16", 1, 1)
    fused_costs = analytic_microbatch_costs(GQA, H100, "bf16", 1, 1)
    s, a, h, kv = 4096, 16, 1024, 2 * 4 * 64
    assert math_costs.layer.core_stash_bytes == 4 * a * s * s + (4 * 3 * h - 2 * (h + kv)) * s
    assert fused_costs.layer.core_stash_bytes == 4 * a * s
    assert math_costs.layer.stash_bytes - fused_costs.layer.stash_bytes == (
        math_costs.layer.core_stash_bytes - fused_costs.layer.core_stash_bytes)
    # MHA with documents keeps the fused kernel; so does GQA without them
    mha = analytic_microbatch_costs(MHA, documents, "bf16", 1, 1).layer.core_stash_bytes
    assert mha == 4 * a * s


def test_context_parallel_documents_are_not_math():
    """c = 2: the cores get document ids, not a mask tensor. The ring keeps the same with documents; all_gather
    runs each chunk as a tiled block, which keeps (bf16, b = 1, s = 4096, L = 2048 tokens a rank, 16 heads, 4
    groups of 64) the gathered K and V and their int64 index, its output and an fp32 log-sum-exp per head and row:
    no score-sized tensor, no ``[n, prefix]`` mask."""
    docs = replace(H100, reset_attention_mask=True)
    ring = [context_microbatch_costs(GQA, cl, "bf16", 1, 1, 2, "p2p").layer for cl in (H100, docs)]
    assert ring[0].stash_bytes == ring[1].stash_bytes and ring[0].core_stash_bytes == ring[1].core_stash_bytes
    gather = context_microbatch_costs(GQA, docs, "bf16", 1, 1, 2, "all_gather").layer
    s, L, a, g, d = 4096, 2048, 16, 4, 64
    assert gather.core_stash_bytes == 2 * g * s * d * 2 + 2 * 8 * s + 4 * a * L + a * L * d * 2


def _cfg(*extra: str, world: int = 1):
    return build_config(parse_args([*FLAGS, *extra], "gpt"), "gpt", world, cuda_available=True)


def test_startup_line_names_the_kernel():
    line = attention_line(_cfg("--device", "cuda", "--bf16", "--reset-attention-mask", "--attention-dropout", "0"))
    assert "auto runs the math kernel" in line and "grouped-query heads with an attention mask" in line
    plain = attention_line(_cfg("--device", "cuda", "--bf16", "--attention-dropout", "0"))
    assert "auto runs the fused kernel" in plain
    cpu = attention_line(_cfg("--device", "cpu", "--attention-dropout", "0.1"))
    assert "math kernel" in cpu and "takes no attention dropout" in cpu
    ring = attention_line(_cfg("--device", "cuda", "--bf16", "--reset-attention-mask", "--attention-dropout", "0",
                               "--context-parallel-size", "2", world=2))
    assert "ring's blocks on the written-out fp32 core in tiles" in ring and "documents on a GPU" in ring
    gather = attention_line(_cfg("--device", "cuda", "--bf16", "--reset-attention-mask", "--attention-dropout", "0",
                                 "--context-parallel-size", "2", "--cp-comm-type", "all_gather", world=2))
    assert "fused kernel in each context-parallel block or chunk" in gather


def test_a_run_logs_the_choice_at_start_up(caplog):
    cfg = build_config(parse_args([*FLAGS, "--device", "cpu", "--attention-dropout", "0", "--reset-attention-mask"],
                                  "gpt"), "gpt", 1)
    with caplog.at_level(logging.INFO):
        prepare(cfg, 0, validate_only=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]
    assert lines == ["attention: --attention-backend auto runs the fused kernel (torch's CPU flash kernel)"], lines
