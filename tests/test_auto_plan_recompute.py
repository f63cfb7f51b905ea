"""``--auto-plan`` searches Megatron's finer recomputation (selective, per-layer) and hands its choice to
the trainer's config as ``--recompute-granularity/-method/-num-layers``.

A hand-written profile on a toy device where only per-layer recomputation fits: no recomputation keeps
every layer's stash, and the engine's whole-stage recomputation at d = 1 still rebuilds all of them.
"""

from __future__ import annotations

import json

import pytest

from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.config import ModelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.auto_plan import PlanChoice, auto_plan_details
from megatron_2bw.planner.efficiency import EfficiencyCurve
from megatron_2bw.planner.hardware import Cluster
from megatron_2bw.planner.layer_costs import BlockCost, LayerCosts, MicrobatchCosts
from megatron_2bw.schedule.recompute_policy import RecomputePolicy

TRAIN = ["--train-iters", "1", "--lr", "1e-3", "--device", "cpu", "--data-path", "d", "--tokenizer-type",
         "SentencePieceTokenizer", "--tokenizer-model", "t.model"]  # checked, never opened: no files needed
MODEL = ModelConfig("gpt", 4, 64, 4, 16, vocab_size=128)
COSTS = MicrobatchCosts(
    layer=BlockCost(1.0, 2.0, params=10, stash_bytes=1000, input_bytes=10, output_bytes=10, workspace_bytes=10),
    embedding=BlockCost(0.1, 0.1, params=10, stash_bytes=0, input_bytes=8, output_bytes=10),
    head=BlockCost(0.1, 0.2, params=10, stash_bytes=10, input_bytes=10, output_bytes=0),
)


def _cluster(memory: int) -> Cluster:
    return Cluster(name="toy", device="CPU (toy)", device_memory_bytes=memory, reserved_memory_bytes=0,
                   peak_flops={"fp32": 1e12}, memory_bandwidth=1e6, devices_per_server=1,
                   intra_server_allreduce_bandwidth=1e6, intra_server_p2p_bandwidth=1e6,
                   inter_server_bandwidth=1e6, efficiency=EfficiencyCurve(0.5, 1.0))


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(LayerCosts("hand-written", {(1, 2): COSTS}).to_json()))
    return str(path)


def test_auto_plan_chooses_per_layer_recomputation_where_only_it_fits(profile):
    # 40 parameters x 16 bytes = 640; 4 layers' stashes 4000 do not fit in 0.9 x 3000, their inputs (40) do
    plan = auto_plan_details(MODEL, 1, 2, _cluster(3000), profile, "cpu", precision="fp32")
    c = plan.choice
    assert (c.t, c.d, c.w, c.b, c.recompute) == (1, 1, 1, 2, False)
    assert c.recompute_policy == RecomputePolicy("full", "uniform", 1)
    assert "recompute=uniform1" in plan.describe()
    # with room for the stashes no recomputation is cheapest; without the finer policies nothing fits
    roomy = auto_plan_details(MODEL, 1, 2, _cluster(10**6), profile, "cpu", precision="fp32").choice
    assert roomy.recompute_policy is None and not roomy.recompute
    with pytest.raises(ConfigError, match="nothing fits"):
        auto_plan_details(MODEL, 1, 2, _cluster(3000), profile, "cpu", precision="fp32", recompute_policies=())


def test_the_choice_reaches_the_config_as_megatrons_flags():
    choice = PlanChoice(1, 1, 2, 2, False, "flush", None, False, RecomputePolicy("full", "uniform", 1))
    args = parse_args(["--model-preset", "gpt-tiny", "--auto-plan", "--global-batch-size", "8", *TRAIN], "gpt")
    pipe = build_config(args, "gpt", 2, layout=choice.layout).pipeline
    assert (pipe.recompute_granularity, pipe.recompute_method, pipe.recompute_num_layers) == ("full", "uniform", 1)
    assert not pipe.recompute
    sel = PlanChoice(1, 1, 2, 2, False, "flush", None, False, RecomputePolicy("selective"))
    assert build_config(args, "gpt", 2, layout=sel.layout).pipeline.recompute_granularity == "selective"
    # the user's own flags still apply to a layout without a policy
    given = parse_args(["--model-preset", "gpt-tiny", "--auto-plan", "--global-batch-size", "8", *TRAIN,
                        "--recompute-granularity", "selective"], "gpt")
    none = PlanChoice(1, 1, 2, 2, False, "flush")
    assert build_config(given, "gpt", 2, layout=none.layout).pipeline.recompute_granularity == "selective"
