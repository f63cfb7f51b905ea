"""The planner's context parallelism (issue 36): its memory, the search axis, the plan it hands the trainer.

- The memory model at c = 2 against c = 1, written out by hand for a GPT stage: every per-token term halves,
  and the attention adds what the communication type keeps (all_gather: the whole sequence's K and V).
- What the two cores keep, counted by the engine's saved-tensor accounting on 2 gloo processes (the p2p
  ring and the gathered core, causal and not, fp32 and bf16, grouped heads), equals the planner's count.
- A sequence c = 1 cannot hold (llama-8b at 512k tokens on 32 H100s) gets c > 1, and the printed command and
  the trainer's layout carry it; the paper's 512-token GPT models keep c = 1.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.config import ModelConfig, layout_configs
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.auto_plan import PlanChoice
from megatron_2bw.planner.context_costs import context_microbatch_costs, gather_core_bytes, ring_core_bytes
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import analytic_microbatch_costs, layer_costs_from_json
from megatron_2bw.planner.memory_model import Candidate, stage_memory
from megatron_2bw.planner.report import paper_model, pretrain_command
from megatron_2bw.planner.search import FINER_RECOMPUTE, PlanRequest, default_costs, search, with_context_costs

H100 = load_cluster("dgx-h100")
GPT = ModelConfig("gpt", 4, 1024, 16, 4096, 4096, 50257, ffn_hidden_size=4096)  # no dropout: fused attention


def _activations(c: int, comm: str = "all_gather") -> int:
    costs = (analytic_microbatch_costs(GPT, H100, "bf16", 1, 1) if c == 1
             else context_microbatch_costs(GPT, H100, "bf16", 1, 1, c, comm))
    cand = Candidate(1, 1, 1, 1, 1, False, "flush", context_parallel=c, cp_comm_type=comm)
    return stage_memory(costs, cand, GPT.num_layers, 0).activations


def test_activations_at_c2_halve_every_per_token_term():
    """One stage holding the embedding, 4 layers and the head (bf16, b = 1, s = 4096, h = 1024, f = 4096,
    16 heads), by hand: a layer keeps 4 hidden-sized tensors across the tensor group, Q, K, V and the
    projection's input (4h), the MLP's two f-wide tensors and the fused kernel's fp32 log-sum-exp per head
    and row; the embedding's token ids (8 bytes), the head's norm input and output and fp32 softmax of the
    padded vocabulary. At c = 2 each is over s/2 tokens; all_gather adds the whole sequence's K and V (bf16)
    and the int64 index that orders them; the fused kernels take the causal prefix without a mask."""
    b, s, h, f, a, e, vocab = 1, 4096, 1024, 4096, 16, 2, GPT.padded_vocab_size(1)

    def per_token(tokens: int) -> int:
        layer = 4 * b * tokens * h * e + 4 * h * b * tokens * e + 2 * b * tokens * f * e
        return 4 * layer + b * tokens * 8 + 2 * b * tokens * h * e + 4 * b * tokens * vocab

    lse = 4 * (4 * a * b * s)
    assert _activations(1) == per_token(s) + lse == 1_378_910_208
    gathered = 4 * (2 * b * s * h * e + 2 * 8 * s + 4 * a * b * (s // 2))
    assert _activations(2) == per_token(s // 2) + gathered == 756_826_112
    assert _activations(2) - gathered == (_activations(1) - lse) // 2  # every per-token term halves
    # the ring keeps what a fused kernel keeps: its output ([b, a, s/2, 64], bf16; the projection's input is
    # the copy the layer counts) and an fp32 log-sum-exp per head and row, no K or V of another rank
    ring = 4 * (b * a * (s // 2) * 64 * e + 4 * a * b * (s // 2))
    assert _activations(2, "p2p") == per_token(s // 2) + ring
    assert _activations(2, "p2p") - ring == (_activations(1) - lse) // 2  # the ring's extra is its output alone


CORE_CASES = [(comm, causal, dtype, groups, "auto") for comm in ("p2p", "all_gather")
              for causal, dtype, groups in ((True, "float32", 4), (False, "float32", 4), (True, "bfloat16", 4),
                                            (True, "float32", 2))] + [("all_gather", True, "float32", 4, "unfused")]


def _saved_worker() -> list[int]:
    """This rank's bytes autograd keeps for one attention core at c = 2 in each case of ``CORE_CASES`` (the
    layer's QKV output included where the core keeps views of it: without grouped heads)."""
    from megatron_2bw.context_parallel.attention import all_gather_attention, ring_attention  # noqa: PLC0415
    from megatron_2bw.context_parallel.group import CPGroup  # noqa: PLC0415
    from megatron_2bw.models.attention_core import attention  # noqa: PLC0415
    from megatron_2bw.pipeline.accounting import SavedBytes  # noqa: PLC0415

    c, rank = dist.get_world_size(), dist.get_rank()
    group, out = dist.new_group(list(range(c))), []
    for comm, causal, dtype, groups, backend in CORE_CASES:
        cp = CPGroup(group, rank, c, comm, tuple(range(c)))
        b, n, hd, heads = 2, 32, 16, 4
        per = heads // groups
        leaf = torch.randn(b, 2 * n, (heads + 2 * groups) * hd, dtype=getattr(torch, dtype), requires_grad=True)
        qkv = (leaf * 1).view(b, 2 * n, groups, per + 2, hd)  # the layer's QKV output, split as the layer does
        q = qkv[:, :, :, :per].reshape(b, 2 * n, heads, hd).transpose(1, 2)
        k, v = qkv[:, :, :, per].transpose(1, 2), qkv[:, :, :, per + 1].transpose(1, 2)
        saved = SavedBytes(set())
        with saved.measure():
            if comm == "p2p":
                o = ring_attention(cp, q, k, v, None, 0.0, causal)
            else:
                o = all_gather_attention(cp, backend, partial(attention, backend), q, k, v, None, 0.0, causal)
        o.float().sum().backward()
        out.append(saved.bytes)
    return out


def test_core_bytes_equal_the_engines():
    """The planner's count of one core at c = 2 (s = 128) against what autograd keeps on the fullest rank, for
    both communication types: causal and not, fp32 and bf16, 4 heads with 4 and with 2 key/value groups (this
    CPU's kernels: torch's flash kernel, which keeps its output, and its materialized prefix masks), and the
    unfused core at all_gather (its score-sized tensors over the prefix)."""
    ranks = run_workers(_saved_worker, 2, timeout=120)
    for i, (comm, causal, dtype, groups, backend) in enumerate(CORE_CASES):
        got = max(r[i] for r in ranks)
        gqa = dict(group_query_attention=True, num_query_groups=groups) if groups < 4 else {}
        cfg = ModelConfig("gpt", 2, 64, 4, 128, 128, 256, **gqa)
        e = 4 if dtype == "float32" else 2
        # the layer's QKV output, kept through views of it, or (grouped heads; the unfused core's regrouped chunks)
        # only copies of Q
        copies = comm != "p2p" and (groups < 4 or backend == "unfused")  # the ring keeps views of K and V
        qkv = 2 * 64 * (4 + (0 if copies else 2 * groups)) * 16 * e
        kernel = "fused" if backend == "auto" else "unfused"
        core = (ring_core_bytes(cfg, 2, 1, 2, e, causal) if comm == "p2p"
                else gather_core_bytes(cfg, 2, 1, 2, e, kernel, e, causal, mask_tensor=True, cpu=True))
        assert got == qkv + core, (comm, causal, dtype, groups, backend, got, qkv + core)


def _request(model: ModelConfig, gpus: int, sp: tuple[bool, ...] = (False, True), **kw) -> PlanRequest:
    """What ``tools/plan.py`` searches for ``model`` on ``gpus`` H100s, one sequence per GPU."""
    return PlanRequest(model, H100, gpus, gpus, "bf16", memory_margin=0.1, recompute_policies=FINER_RECOMPUTE,
                       sequence_parallel_options=sp, **kw)


def _llama8b(seq: int) -> ModelConfig:
    return get_preset("llama-8b", seq_length=seq, max_position_embeddings=seq)


def test_long_sequence_gets_context_parallelism():
    """llama-8b at 512k tokens on 32 H100s (4 servers of 8): without context parallelism the smallest candidate
    needs 98.8 GiB (t = 8 with sequence parallelism is as far as its 8 key/value groups shard a layer; the
    10% margin leaves 69.4 GiB); with it the best plan shards each sequence over c = 16 ranks (the ring: the
    gathered K and V of 512k tokens would not fit), and the command and the trainer's layout carry it.
    At 32k tokens on 8 H100s c = 1 fits, but the ring on fused kernels (priced at bf16 speed since issue 44) is
    faster: t2 c4 p2p at 1.44 samples/s against c = 1's best, 1.22."""
    long = _llama8b(524288)
    with pytest.raises(ConfigError, match=r"nothing fits.*98\.8 GiB per GPU"):
        search(_request(long, 32, context_parallel_options=(1,)), top=3)
    result = search(_request(long, 32), top=3)
    best = result.best.candidate
    assert (best.context_parallel, best.cp_comm_type, best.tensor_parallel) == (16, "p2p", 2)
    assert best.num_gpus == 32 and best.replicas == best.data_parallel * 16
    assert result.best.memory_bytes_per_gpu <= result.request.memory_limit_bytes
    argv = pretrain_command(result.best, result.request)
    i = argv.index("--context-parallel-size")
    assert argv[i:i + 4] == ["--context-parallel-size", "16", "--cp-comm-type", "p2p"]
    choice = PlanChoice(best.tensor_parallel, best.pipeline_parallel, best.data_parallel, best.micro_batch_size,
                        best.recompute, best.schedule, best.layer_split, best.distributed_optimizer,
                        best.recompute_policy, best.context_parallel, best.cp_comm_type)
    par, _, _ = layout_configs(choice.layout, long, 32, 32)
    assert (par.context, par.cp_comm_type, par.data) == (16, "p2p", best.data_parallel)
    ring = search(_request(_llama8b(32768), 8), top=1).best
    plain = search(_request(_llama8b(32768), 8, context_parallel_options=(1,)), top=1).best
    assert (ring.candidate.context_parallel, ring.candidate.cp_comm_type) == (4, "p2p"), ring.candidate
    assert round(ring.samples_per_sec, 2) == 1.44 and round(plain.samples_per_sec, 2) == 1.22


def test_profile_costs_get_the_same_context_plan():
    """A profile holds c = 1 only; its context ranks are scaled from it by the analytic ratio. A profile that
    is the analytic estimate itself therefore plans exactly as the analytic search does (llama-8b at 128k
    tokens on 8 H100s without sequence parallelism, which a profile holds one setting of: the best has c = 4)."""
    request = _request(_llama8b(131072), 8, sp=(False,))
    analytic = default_costs(request)
    profile = layer_costs_from_json(analytic.to_json(), "analytic")
    assert not profile.cp_table
    scaled = with_context_costs(request, profile)
    assert set(scaled.cp_table) == set(analytic.cp_table)
    best = search(request, scaled, top=1).best.candidate
    assert best == search(request, analytic, top=1).best.candidate and best.context_parallel == 4


@pytest.mark.parametrize("name", ["gpt-2.2b", "gpt-3.8b"])
def test_paper_models_keep_c1(name):
    """The paper's 512-token models: the search tries no c (each rank would keep under 4096 tokens), and asked
    to try c = 2 and 4 it still picks c = 1 (each layer's K/V exchange costs more than the shorter shard saves)."""
    model = paper_model(name)
    v100 = load_cluster("aws-p3.16xlarge")
    request = PlanRequest(model, v100, 64, 512, distributed_optimizer_options=(False,))
    assert request.context_choices == (1,)
    default = search(request, top=1).best
    asked = search(replace(request, context_parallel_options=(1, 2, 4)), top=1).best
    assert default.candidate.context_parallel == asked.candidate.context_parallel == 1
    assert asked.candidate == default.candidate


def _plan_tool():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "plan.py")
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    return plan


def test_plan_py_fixes_the_context_parallel_size(capsys):
    """tools/plan.py --context-parallel-size C [--cp-comm-type T]: every ranked plan has c = C (and type T),
    the best one is the search's best restricted to C, and its printed command carries C; a C that does not
    divide the GPUs is one error line, exit 2, and so is a C or type with which nothing fits (c = 1, and
    all_gather's whole-sequence K and V at 128k tokens without recomputation inside the stage)."""
    import json

    plan = _plan_tool()
    argv = ["--model-preset", "llama-8b", "--seq-length", "131072", "--max-position-embeddings", "131072",
            "--num-gpus", "8", "--cluster", "dgx-h100", "--global-batch-size", "8", "--precision", "bf16",
            "--no-sequence-parallel-search", "--top", "5"]
    assert plan.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranked"][0]["context_parallel"] == 4  # as the search picks
    for c, kind in ((2, None), (4, "p2p")):
        extra = ["--context-parallel-size", str(c)] + (["--cp-comm-type", kind] if kind else [])
        assert plan.main([*argv, *extra, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["ranked"]
        assert rows and {r["context_parallel"] for r in rows} == {c}
        if kind:
            assert {r["cp_comm_type"] for r in rows} == {kind}
        request = _request(_llama8b(131072), 8, sp=(False,), context_parallel_options=(c,),
                           **({"cp_comm_types": (kind,)} if kind else {}))
        best = search(request, top=1).best
        assert rows[0]["memory_bytes_per_gpu"] == best.memory_bytes_per_gpu
        assert rows[0]["batch_seconds"] == pytest.approx(best.prediction.batch_s, abs=1e-6)
    assert plan.main([*argv, "--context-parallel-size", "2"]) == 0
    command = capsys.readouterr().out.split("best configuration:")[1]
    assert "--context-parallel-size 2 --cp-comm-type" in command
    for bad, why in ((["--context-parallel-size", "1"], "nothing fits"),  # 128k tokens need c > 1 on 8 GPUs
                     # whole K and V, nothing recomputed inside the stage (with full recomputation it fits: 65.3 GiB)
                     (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--no-finer-recompute"],
                      "nothing fits"),
                     (["--context-parallel-size", "3"], "--num-gpus 8 is not divisible by --context-parallel-size 3"),
                     (["--context-parallel-size", "0"], "--context-parallel-size must be positive"),
                     (["--cp-comm-type", "a2a"], "--cp-comm-type")):
        assert plan.main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
