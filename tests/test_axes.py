"""The layout's named axes: Megatron's rank order, every group's ranks written out by hand for a layout with
context and expert parallelism, derived sizes, one-line refusals; the planner's and the trainer's records
agree on them; the model's group bundle."""

import pytest

from megatron_2bw.config import ParallelConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.context_parallel.group import CPGroup
from megatron_2bw.errors import ConfigError
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.planner.auto_plan import PlanChoice
from megatron_2bw.planner.candidate import Candidate
from megatron_2bw.planner.report import candidate_layout

# t = 2, c = 2, w = 2 (4 replicas), d = 2, e = 2: 16 ranks, Megatron's tp-cp-dp-pp order, experts folded
# inside the replicas (adjacent replica positions). Written out by hand from
# rank = pp * 8 + replica * 2 + tp, replica = data * 2 + context.
HAND_22222 = {
    "tensor": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "data": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "pipeline": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "context": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "expert": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "expert_data": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
}


def test_groups_of_a_five_axis_layout_match_the_hand_written_ones():
    axes = Axes(tensor=2, context=2, expert=2, data=2, pipeline=2)
    assert (axes.world, axes.replicas, axes.expert_data) == (16, 4, 2)
    groups = axes.groups()
    for name, want in HAND_22222.items():
        assert sorted(groups[name]) == want, name
    assert groups["expert_copies"] == groups["expert"]
    assert sorted(groups["embedding"]) == HAND_22222["pipeline"]  # first and last stage: d = 2
    assert sorted(groups["model"]) == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    for rank in range(axes.world):
        tp, replica, pp = axes.coords(rank)
        assert axes.rank(tp, replica, pp) == rank
        assert rank in groups["tensor"][pp * axes.replicas + replica]
    assert axes.stage_ranks(1) == sorted(r for g in HAND_22222["tensor"][4:] for r in g) == list(range(8, 16))


def test_a_layout_without_context_or_experts_has_no_such_groups():
    groups = Axes(tensor=2, data=2, pipeline=2).groups()
    assert set(groups) == {"tensor", "data", "pipeline", "embedding", "model"}


@pytest.mark.parametrize("kwargs, message", [
    ({"expert": 4, "data": 2}, "--expert-model-parallel-size 4 does not divide data-parallel size 2 x "
                               "--context-parallel-size 1"),
    ({"tensor": 0}, "the tensor axis must be >= 1, got 0"),
    ({"virtual": -1}, "the virtual axis must be >= 1, got -1"),
])
def test_bad_axes_are_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Axes(**kwargs)


def test_the_records_agree_on_the_axes():
    par = ParallelConfig(2, 4, context=2).resolve(32)
    assert par.axes(expert=2, virtual=2) == Axes(tensor=2, context=2, expert=2, data=2, pipeline=4, virtual=2)
    assert par.world_size == 32
    cand = Candidate(2, 4, 2, 1, 8, False, "interleaved-1f1b", context_parallel=2, expert_parallel=2)
    assert cand.axes == Axes(tensor=2, context=2, expert=2, data=2, pipeline=4, virtual=2)
    assert (cand.num_gpus, cand.replicas, cand.expert_replicas) == (32, 4, 2)
    choice = PlanChoice(2, 4, 2, 1, False, "interleaved-1f1b", context=2)
    assert choice.axes == Axes(tensor=2, context=2, data=2, pipeline=4)
    # the two converters to the trainer's layout flags give the same layout
    assert choice.layout == candidate_layout(Candidate(2, 4, 2, 1, 8, False, "interleaved-1f1b", context_parallel=2))
    assert (choice.layout.tensor, choice.layout.pipeline, choice.layout.context) == (2, 4, 2)


def test_model_groups_default_to_one_process():
    g = ModelGroups()
    assert g.tp.size == 1 and g.cp is None and g.moe is None
    assert ModelGroups(cp=CPGroup()).cp is None  # a context group of one is none
