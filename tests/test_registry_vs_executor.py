"""The planner's memory model against what the executor measures, every schedule, d in {1,2,4}, m in {4,8}.

The counts the memory model charges (activation stashes in flight per stage, weight versions) come
from the schedule registry; here the engine runs each schedule built through that registry and its
own accounting (StageStats) is compared with them.
"""

import pytest
from multiproc import run_workers
from pipeline_harness import train_tiny

from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.memory_model import in_flight, weight_versions
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, get_schedule, validate_pipeline

MICROBATCHES = (4, 8)


def _runs(s: str, d: int, m: int) -> bool:
    """Whether schedule ``s`` runs at depth ``d`` with ``m`` microbatches (interleaved-1f1b and zb-v need
    d >= 2, zb-v m >= 2d - 1)."""
    try:
        validate_pipeline(s, d, m)
    except ConfigError:
        return False
    return True


def _layers(s: str, d: int) -> dict:
    """A model with a layer for each of the d * chunks virtual stages where the tiny one has too few."""
    n = d * get_schedule(s).chunks
    return {"num_layers": n} if n > 4 else {}


def _run_all(layout):
    d = 1 if layout is None else layout[1]
    return {(s, m): train_tiny(s, layout=layout, steps=3, global_batch=m, lr=1e-3, **_layers(s, d))["stats"]
            for s in SCHEDULE_NAMES for m in MICROBATCHES if _runs(s, d, m)}


@pytest.mark.parametrize("d", [1, 2, 4])
def test_memory_model_counts_equal_the_executors(d):
    per_rank = [_run_all(None)] if d == 1 else run_workers(_run_all, d, (1, d, 1), timeout=300)
    for r, stats in enumerate(per_rank):
        for (s, m), st in stats.items():
            spec = get_schedule(s)
            assert st["stage"] == r
            assert st["max_inflight"] == in_flight(s, d, m, r) == spec.inflight(d, r, m), (s, m, r, st)
            assert st["weight_versions"] == weight_versions(s) == spec.weight_versions, (s, m, r, st)
            # Live versions never exceed what is held; the first stage of a deep 2BW pipeline uses both.
            assert 1 <= st["max_live_versions"] <= spec.weight_versions, (s, m, r, st)
            if s == "2bw" and d > 1 and r == 0:
                assert st["max_live_versions"] == 2, (m, st)
