"""Sequence parallelism as a planner search axis: at t > 1 the search tries it on and off and says which,
a memory-bound layer at t = 8 is planned with it, and the stash it assumes is Korthikanti et al. 2022's
closed forms (Table 2: ``sbh(10 + 24/t + 5as/(ht))`` bytes per layer without, ``sbh/t (34 + 5as/h)``
with sequence parallelism; fp16, f = 4h, dropout on, no fused attention), written out here."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.cost_model import predict
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.layer_costs import analytic_layer_costs
from megatron_2bw.planner.memory_model import Candidate
from megatron_2bw.planner.search import PlanRequest, evaluate, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPT-3-like layers of the paper's era on V100s (16 GB, no fused attention): 24 layers at t = 8 fit only with SP
S, H, A, L, V = 2048, 4096, 32, 24, 51200
MODEL = ModelConfig("gpt", L, H, A, S, S, V, hidden_dropout=0.1, attention_dropout=0.1)
CLUSTER = load_cluster("aws-p3.16xlarge")


def korthikanti_layer_bytes(b: int, t: int, sp: bool) -> int:
    """Activation bytes per layer (Korthikanti et al. 2022, section 4.2.2 and Table 2)."""
    sbh = S * b * H
    if sp:
        return (34 * sbh + 5 * A * S * S * b) // t
    return 10 * sbh + (24 * sbh + 5 * A * S * S * b) // t


def test_sp_chosen_at_t8_when_memory_bound_and_stash_is_korthikantis():
    assert not CLUSTER.flash_attention
    costs = analytic_layer_costs(MODEL, CLUSTER, "fp16", [8], [1], search_sequence_parallel=True)
    for sp in (False, True):
        assert costs.at(8, 1, sp).layer.stash_bytes == korthikanti_layer_bytes(1, 8, sp)
    req = PlanRequest(MODEL, CLUSTER, 8, 8, "fp16", max_micro_batch_size=1, recompute_options=(False,),
                      sequence_parallel_options=(False, True), schedules=("flush",))
    result = search(req, costs, require_fit=False)
    assert result.considered == 2 and result.too_big == 1  # t8 d1 w1 b1, SP off and on
    best = result.best.candidate
    assert (best.tensor_parallel, best.pipeline_parallel, best.sequence_parallel) == (8, 1, True)
    off = evaluate(replace(best, sequence_parallel=False), costs, req)
    assert off.prediction is None
    assert off.memory_bytes_per_gpu > req.memory_limit_bytes >= result.best.memory_bytes_per_gpu
    # one stage, one microbatch: the activations differ by L layers' stash, the embedding's dropout
    # mask (1 byte) and the head's two norm tensors (fp16), each sharded by t with SP
    sbh, t = S * H, 8
    saved = L * (korthikanti_layer_bytes(1, t, False) - korthikanti_layer_bytes(1, t, True)) + (sbh - sbh // t) \
        + 2 * 2 * (sbh - sbh // t)
    assert off.memory[0].activations - result.best.memory[0].activations == saved
    # same parameters, optimizer and weights either way
    assert off.memory[0].weights == result.best.memory[0].weights
    assert off.memory[0].params == result.best.memory[0].params


def test_sp_moves_the_all_reduce_volume_and_an_eighth_of_the_p2p():
    """All-gather + reduce-scatter move the bytes of the all-reduce they replace (same tensor-comm time);
    a stage sends its sequence shard (p2p over t)."""
    model = replace(MODEL, num_layers=8)
    costs = analytic_layer_costs(model, CLUSTER, "fp16", [8], [1], search_sequence_parallel=True)
    on, off = costs.at(8, 1, True), costs.at(8, 1, False)
    assert on.layer.tp_allreduce_forward_bytes == off.layer.tp_allreduce_forward_bytes == 2 * 2 * S * H
    cand = Candidate(8, 2, 1, 1, 4, True, "flush", sequence_parallel=True)
    p_on = predict(on, cand, 8, CLUSTER)
    p_off = predict(off, replace(cand, sequence_parallel=False), 8, CLUSTER)
    for a, b in zip(p_on.stages, p_off.stages):
        assert a.tensor_comm_s == pytest.approx(b.tensor_comm_s, rel=1e-12)
        assert a.compute_s == pytest.approx(b.compute_s, rel=1e-12)
        assert a.p2p_s == pytest.approx(b.p2p_s / 8, rel=1e-12)


def test_search_tries_sp_only_where_it_applies():
    req = PlanRequest(replace(MODEL, num_layers=4, seq_length=512, max_position_embeddings=512), CLUSTER, 8, 16,
                      "fp16", max_micro_batch_size=2, sequence_parallel_options=(False, True))
    result = search(req)
    seen = {(e.candidate.tensor_parallel, e.candidate.sequence_parallel) for e in result.ranked}
    assert {(2, False), (2, True), (8, False), (8, True)} <= seen and (1, True) not in seen
    # the model's own setting (None) searches one: the default before the axis existed
    one = search(replace(req, sequence_parallel_options=None))
    assert not any(e.candidate.sequence_parallel for e in one.ranked)
    with pytest.raises(ConfigError, match="--sequence-parallel needs --tensor-model-parallel-size > 1"):
        Candidate(1, 1, 8, 1, 2, False, "flush", sequence_parallel=True)


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan", os.path.join(ROOT, "tools", "plan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plan_py_reports_sp_and_its_command(capsys):
    plan = _plan_tool()
    argv = ["--num-layers", str(L), "--hidden-size", str(H), "--num-attention-heads", str(A), "--seq-length", str(S),
            "--max-position-embeddings", str(S), "--vocab-size", str(V), "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--num-gpus", "8", "--cluster", "aws-p3.16xlarge", "--global-batch-size", "8",
            "--max-micro-batch-size", "1", "--no-finer-recompute", "--memory-margin", "0"]
    assert plan.main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["ranked"]
    assert all("sequence_parallel" in r for r in rows)
    t8 = [r for r in rows if r["tensor_parallel"] == 8 and r["pipeline_parallel"] == 1 and not r["recompute"]]
    assert t8 and all(r["sequence_parallel"] for r in t8)  # without SP, t8 d1 fits only with recomputation
    assert plan.main(argv + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "seq-par" in out
    best_sp = rows[0]["sequence_parallel"]
    assert ("--sequence-parallel" in out.split("best configuration:")[1]) == best_sp
    assert plan.main(argv + ["--json", "--no-sequence-parallel-search"]) == 0
    assert not any(r["sequence_parallel"] for r in json.loads(capsys.readouterr().out)["ranked"])
