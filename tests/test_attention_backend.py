"""``--attention-backend`` (Megatron's names) and the planner's activation memory for the kernel it runs.

The unfused core equals a plain-PyTorch attention (K and V repeated per query head) with the same
dropout draw; a layer's saved bytes, counted by saved-tensor hooks as the engine counts its stash,
match ``layer_stash_bytes`` for the kernel ``attention_kernel`` says runs (unfused: Korthikanti's
``s^2`` terms; flash/fused and CPU auto without dropout: no ``s^2`` tensor; CPU auto with dropout:
torch's fp32 math path), within 5%.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError, run_cli
from megatron_2bw.fused import Kernels
from megatron_2bw.models.attention_core import attention, unfused_attention
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.transformer import TransformerLayer
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import (
    analytic_microbatch_costs,
    attention_kernel,
    core_stash_bytes,
    dropout_mask_bytes,
    layer_stash_bytes,
)
from megatron_2bw.tensor_parallel.random import RNGTracker

MINIMAL = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
           "--device", "cpu", "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
           "t.model"]


def reference_attention(q, k, v, mask, p, causal):
    """softmax(QK^T/sqrt(d) + mask) with dropout, times V, with K and V repeated for each query head."""
    per = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores + torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)
    if mask is not None:
        scores = scores + (torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
                           if mask.dtype == torch.bool else mask)
    probs = torch.nn.functional.dropout(scores.softmax(-1), p, p > 0)
    return probs @ v


@pytest.mark.torch_floor
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("masking", ["causal", "bool", "float"])
def test_unfused_core_equals_reference_and_sdpa(groups, masking):
    g = torch.Generator().manual_seed(groups)
    b, a, s, d = 2, 4, 12, 8
    q = torch.randn(b, a, s, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, groups, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    causal = masking == "causal"
    mask = None
    if masking == "bool":
        mask = torch.rand(b, 1, 1, s, generator=g) > 0.3
        mask[..., 0] = True  # every row attends somewhere
    elif masking == "float":
        mask = torch.randn(b, 1, s, s, generator=g, dtype=torch.float64)
    want = reference_attention(q, k, v, mask, 0.0, causal)
    assert torch.allclose(unfused_attention(q, k, v, mask, 0.0, causal), want, atol=1e-12, rtol=0)
    for backend in ("auto", "unfused", "local"):
        assert torch.allclose(attention(backend, q, k, v, mask, 0.0, causal), want, atol=1e-12, rtol=0)
    # the same dropout draw ([b, a, s, s] from the same generator state) gives the same output
    torch.manual_seed(5)
    ours = unfused_attention(q, k, v, mask, 0.3, causal)
    torch.manual_seed(5)
    assert torch.allclose(ours, reference_attention(q, k, v, mask, 0.3, causal), atol=1e-12, rtol=0)
    assert not torch.allclose(ours, want)  # dropout did act


@pytest.mark.torch_floor
def test_flash_backend_matches_auto_on_cpu():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    assert torch.allclose(attention("flash", q, k, v, None, 0.0, True), attention("auto", q, k, v, None, 0.0, True),
                          atol=1e-6, rtol=0)


def _saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves in one forward, each storage once, parameters excluded (the engine's rule)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.data_ptr() not in params:
            seen.add(st.data_ptr())
            total += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, {})
    return total


CPU = load_cluster("cpu-host")


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,dropout", [("auto", 0.0), ("flash", 0.0), ("unfused", 0.0), ("auto", 0.1),
                                             ("unfused", 0.1), ("local", 0.1)])
def test_layer_stash_matches_the_planner_for_the_kernel_used(preset, dtype, backend, dropout):
    extra = {"normalization": "LayerNorm"} if preset == "llama-tiny" else {}  # torch's RMSNorm keeps one more tensor
    cfg = get_preset(preset, seq_length=128, max_position_embeddings=128, hidden_dropout=dropout,
                     attention_dropout=dropout, **extra)
    b, e = 2, 4 if dtype == torch.float32 else 2
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, ModelGroups(), 1, 0, causal=True, rng=RNGTracker(1, 0),
                             kernels=Kernels(attention=backend)).to(dtype).train()
    measured = _saved_bytes(layer, torch.randn(b, cfg.seq_length, cfg.hidden_size, dtype=dtype, requires_grad=True))
    cluster = replace(CPU, attention_backend=backend)
    kernel = attention_kernel(cluster, cfg)
    assert kernel == {"flash": "fused", "unfused": "unfused", "local": "unfused"}.get(
        backend, "math" if dropout else "fused")
    want = layer_stash_bytes(cfg, b, 1, e, kernel=kernel, mask_bytes=dropout_mask_bytes(cluster, e))
    assert want == analytic_microbatch_costs(cfg, cluster, "fp32" if e == 4 else "bf16", 1, b).layer.stash_bytes
    assert abs(measured - want) <= 0.05 * want, (measured, want)
    # the s^2 terms are most of it here (s = 128, h = 64): a wrong kernel would be far off
    other = "fused" if kernel != "fused" else "unfused"
    assert abs(measured - layer_stash_bytes(cfg, b, 1, e, kernel=other, mask_bytes=e)) > 0.2 * want


def test_planner_core_terms_by_backend():
    """Korthikanti's 5as^2b (fp16, dropout on, 1-byte GPU masks) unfused; 4abs fused; 12as^2b CPU math."""
    cfg = get_preset("gpt-tiny", attention_dropout=0.1, hidden_dropout=0.1)
    s, a, b = cfg.seq_length, cfg.num_attention_heads, 3
    gpu = load_cluster("aws-p3.16xlarge")
    assert not gpu.is_cpu and CPU.is_cpu
    by = {bk: attention_kernel(replace(gpu, attention_backend=bk), cfg) for bk in ("auto", "flash", "fused", "unfused")}
    assert by == {"auto": "unfused", "flash": "fused", "fused": "fused", "unfused": "unfused"}
    assert attention_kernel(load_cluster("dgx-h100"), cfg) == "fused"
    assert core_stash_bytes(cfg, b, 1, 2, kernel="unfused", mask_bytes=dropout_mask_bytes(gpu, 2)) == 5 * a * s * s * b
    assert core_stash_bytes(cfg, b, 2, 2, kernel="fused") == 4 * a * s * b // 2
    h = cfg.hidden_size  # plus fp32 Q, K, V in place of the fp16 ones (6h more per token)
    assert core_stash_bytes(cfg, b, 1, 2, kernel="math", mask_bytes=2) == 12 * a * s * s * b + 6 * h * s * b
    assert attention_kernel(CPU, cfg) == "math"
    assert attention_kernel(CPU, replace(cfg, attention_dropout=0.0)) == "fused"
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        replace(CPU, attention_backend="xformers")


def test_attention_backend_flag(capsys):
    cfg = build_config(parse_args([*MINIMAL, "--attention-backend", "unfused"], "gpt"), "gpt", 1)
    assert cfg.system.attention_backend == "unfused"
    assert build_config(parse_args(MINIMAL, "gpt"), "gpt", 1).system.attention_backend == "auto"

    def run(argv):
        build_config(parse_args(argv, "gpt"), "gpt", 1)

    assert run_cli(run, [*MINIMAL, "--attention-backend", "flash", "--attention-dropout", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: --attention-backend flash with --attention-dropout 0.1 on the CPU")
    assert run_cli(run, [*MINIMAL, "--attention-backend", "flash"]) == 0
    assert run_cli(run, [*MINIMAL, "--attention-backend", "flash", "--reset-attention-mask"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "takes no attention mask (--reset-attention-mask's mask)" in err[0]
    assert run_cli(run, [*MINIMAL, "--attention-backend", "fused", "--reset-attention-mask"]) == 0
    assert run_cli(run, [*MINIMAL, "--attention-backend", "xformers"]) == 2
    assert "--attention-backend" in capsys.readouterr().err


def test_plan_py_counts_the_backend_and_passes_it_on(capsys):
    """tools/plan.py --attention-backend unfused: the s^2 terms come back into the plan's memory, and the
    command it prints trains with that backend."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "plan.py")
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    argv = ["--model-preset", "gpt-tiny", "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--num-gpus", "1", "--cluster", "dgx-h100", "--global-batch-size", "8", "--max-micro-batch-size", "8",
            "--no-finer-recompute", "--memory-margin", "0"]
    mem = {}
    for backend in ("flash", "unfused"):
        assert plan.main([*argv, "--attention-backend", backend, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["ranked"]
        mem[backend] = {(r["micro_batch_size"], r["recompute"]): r["memory_bytes_per_gpu"] for r in rows}
    cfg = get_preset("gpt-tiny", seq_length=2048, max_position_embeddings=2048)
    s, a, L, b = 2048, cfg.num_attention_heads, cfg.num_layers, 1
    # fp16, no dropout: the unfused core keeps the softmax (2 bytes a score), flash its fp32 log-sum-exp;
    # L layers' stash of one microbatch (the workspace, the largest block's transient, may add more)
    per_layer = a * s * s * 2 * b - 4 * a * s * b
    assert mem["unfused"][(b, False)] - mem["flash"][(b, False)] >= L * per_layer
    want = analytic_microbatch_costs(cfg, replace(load_cluster("dgx-h100"), attention_backend="unfused"), "fp16", 1, b)
    have = analytic_microbatch_costs(cfg, replace(load_cluster("dgx-h100"), attention_backend="flash"), "fp16", 1, b)
    assert want.layer.stash_bytes - have.layer.stash_bytes == per_layer
    assert plan.main([*argv, "--attention-backend", "unfused"]) == 0
    assert "--attention-backend unfused" in capsys.readouterr().out.split("best configuration:")[1]
