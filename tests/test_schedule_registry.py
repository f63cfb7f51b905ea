"""The schedule registry is the one source of schedule facts: every schedule is built through it, and
the planner's counts (in flight, weight versions, gradient buffers, bubble) match what replaying the
schedules' real action programs measures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.cost_model import bubble_slots
from megatron_2bw.planner.memory_model import Candidate, in_flight, weight_versions
from megatron_2bw.planner.simulator import StageCosts, simulate
from megatron_2bw.schedule.actions import Op
from megatron_2bw.schedule.checker import check_actions
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, SCHEDULES, get_schedule, stage_actions, validate_pipeline

STEPS = 4  # enough for 2BW to run steps on two versions at once


def _runs(name: str, d: int, m: int) -> bool:
    """Whether the schedule runs this layout (interleaved-1f1b and zb-v refuse one stage, zb-v m < 2d - 1)."""
    try:
        validate_pipeline(name, d, m)
    except ConfigError:
        return False
    return True


CASES = [(name, d, m) for name in SCHEDULE_NAMES for d in (1, 2, 4) for m in (4, 8) if _runs(name, d, m)]


def _programs(name: str, d: int, m: int, steps: int = STEPS):
    spec = get_schedule(name)
    return [spec.actions(d, r, m, 0, steps) for r in range(d)]


def _live_gradient_steps(program) -> int:
    """Most steps whose gradients are held at once: from a step's first backward (or W) to its update."""
    held: set[int] = set()
    most = 0
    for a in program:
        if a.op is Op.BACKWARD or a.op is Op.BACKWARD_WEIGHT:
            held.add(a.step)
            most = max(most, len(held))
        elif a.op is Op.APPLY_UPDATE:
            held.discard(a.step)
    return most


def _live_versions(events) -> int:
    """Most weight versions one stage needs at once: those of its in-flight microbatches and the newest."""
    newest, inflight, most = 0, {}, 1
    for e in events:
        if e.op is Op.FORWARD:
            inflight[(e.mb, e.chunk)] = e.version
        elif e.op is Op.BACKWARD or e.op is Op.BACKWARD_WEIGHT:  # a split backward holds its weights until W
            inflight.pop((e.mb, e.chunk))
        elif e.op is Op.APPLY_UPDATE:
            newest = e.step + 1
        most = max(most, len(set(inflight.values()) | {newest}))
    return most


def test_registry_names_and_lookup():
    assert tuple(SCHEDULES) == SCHEDULE_NAMES
    for name in SCHEDULE_NAMES:
        assert get_schedule(name).name == name
    assert SCHEDULE_NAMES[:7] == ("2bw", "flush", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
    # the refusal names every registered schedule (a new one is listed without touching this test)
    with pytest.raises(ConfigError, match=rf"^unknown pipeline schedule 'pipedream'; choose one of "
                                          rf"{re.escape(', '.join(SCHEDULE_NAMES))}$"):
        get_schedule("pipedream")


@pytest.mark.parametrize(("name", "d", "m"), CASES)
def test_memory_model_counts_match_the_replayed_programs(name, d, m):
    spec = get_schedule(name)
    report = check_actions(name, d, m, 0, STEPS, _programs(name, d, m))
    sim = simulate(name, d, m, [StageCosts(1.0, 2.0) for _ in range(d)], num_steps=STEPS)
    live = [_live_versions(events) for events in sim.events]
    assert list(report.max_inflight) == sim.max_inflight  # two consumers of the replay agree
    assert list(report.max_live_versions) == live
    for r in range(d):
        assert in_flight(name, d, m, r) == report.max_inflight[r], r
        # a stage never needs more versions than the memory model (and the executor) keeps
        assert live[r] <= weight_versions(name) == spec.weight_versions
    if d > 1:  # with a pipeline some stage runs new microbatches while older ones are in flight
        assert max(live) == weight_versions(name)
    assert max(_live_gradient_steps(p) for p in _programs(name, d, m)) == spec.grad_buffers
    # the steady-state step in microbatch times: m plus the bubble the cost model adds
    assert sim.step_time_s / 3.0 == pytest.approx(m + bubble_slots(name, d))
    assert sim.bubble_fraction == pytest.approx(spec.bubble(d, m), abs=1e-12)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_staleness_and_minimum_microbatches(name):
    spec = get_schedule(name)
    forwards = [a for p in _programs(name, 4, 8) for a in p if a.op is Op.FORWARD]
    assert max(a.step - a.version for a in forwards) == spec.stale_steps
    for d in (1, 2, 4, 8):
        least = spec.min_microbatches(d)
        if not _runs(name, d, least):
            continue
        stage_actions(name, d, 0, least, 0, 1)  # the minimum runs ...
        Candidate(1, d, 1, 1, least, False, name)
        if least > 1:  # ... one fewer is refused by the engine and the planner alike
            with pytest.raises(ConfigError, match=rf"m={least - 1} < (d={d}|{least})"):
                stage_actions(name, d, 0, least - 1, 0, 1)
            with pytest.raises(ConfigError, match=rf"m={least - 1} < (d={d}|{least})"):
                Candidate(1, d, 1, 1, least - 1, False, name)


# Library files that must read schedule facts from the registry instead of restating them.
ROOT = Path(__file__).resolve().parents[1] / "megatron_2bw"
REGISTRY_USERS = [
    "schedule/checker.py", "schedule/grouping.py", "schedule/replay.py", "schedule/actions.py", "schedule/stages.py",
    "planner/memory_model.py", "planner/cost_model.py", "planner/search.py", "planner/simulator.py",
    "planner/timeline.py", "planner/layer_costs.py", "planner/efficiency.py", "planner/hardware.py",
    "pipeline/executor.py", "pipeline/weights.py", "pipeline/updater.py", "pipeline/transport.py",
    "pipeline/compensation.py", "checkpoint/trainer_reshard.py", "training/loop.py", "checkpoint/checkpointing.py",
]
SCHEDULE_FACTS = {  # what each fact looks like when restated, and the pattern that finds it
    "the schedule name tuple": ('SCHEDULES = ("2bw", "flush", "gpipe")',
                                r"""\(\s*["']2bw["']\s*,\s*["']flush["']\s*,\s*["']gpipe["']"""),
    "a 2BW or GPipe special case": ('if schedule == "gpipe":', r"""["'](2bw|gpipe)["']"""),
    "the m >= d rule": ("if self.num_micro_batches < self.pipeline_parallel:",
                        r"\b(m|num_micro_batches)\s*<\s*(d|self\.pipeline_parallel)\b"),
    "the in-flight formula": ("return min(d - stage, m)", r"min\(\s*d\s*-\s*(r|stage|i)\s*,\s*m\s*\)"),
    "the bubble formula": ("(d - 1) / (m + d - 1)", r"\(\s*d\s*-\s*1\s*\)\s*/\s*\(\s*m\s*\+\s*d\s*-\s*1\s*\)"),
    "a version count": ('versions=2 if pipe.schedule == "2bw" else 1', r"""\b2 if [^\n]*["']2bw["']"""),
}


def test_schedule_facts_live_only_in_the_registry():
    for what, (example, pattern) in SCHEDULE_FACTS.items():
        assert re.search(pattern, example), f"the pattern for {what} misses {example!r}"
        for rel in REGISTRY_USERS:
            hits = [line for line in (ROOT / rel).read_text().splitlines() if re.search(pattern, line)]
            assert not hits, f"{rel} restates {what}: {hits}"
