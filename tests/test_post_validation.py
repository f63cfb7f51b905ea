"""Optimizer post-validation (``--enable-optimizer-post-validation``): speculative updates checked in the
next step's warm-up, rolled back and redone where the global norm says so.

- Programs: every small zb-h1 / zb-h2 pipeline with post-validation is correct for the checker (gloo's
  queues and NCCL's rendezvous, speculating or not), every VALIDATE is a consistent cut, and the checker
  refuses one that is not; with the paper's equal F, I and W times zb-h2 then has no bubble at all in
  the steady state, where the flushed zb-h2 idles ``(d - 1) f`` per step.
- Numerics (gloo processes): the speculative runs equal the exact zb-h2 run bitwise on the same layout (the
  update writes what the exact one writes; a rollback restores what it overwrote and the warm-up re-runs
  from the same RNG state), with clipping that triggers on some steps (rolled back) and not on others
  (kept), through the tied embedding split across stages, dropout and recomputation, tensor parallelism,
  the grouped (NCCL-order) transfers, the distributed optimizer and an fp16 overflow; and the single
  process within the pipelined tolerance.
"""

from __future__ import annotations

import pytest
from multiproc import run_workers
from pipeline_harness import train_tiny
from test_pipeline_layouts import compare

from megatron_2bw.config import PipelineConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.schedule.actions import Op, format_actions
from megatron_2bw.schedule.checker import ScheduleError, check_actions, check_schedule
from megatron_2bw.schedule.grouping import check_grouped
from megatron_2bw.schedule.replay import Replay, Timing
from megatron_2bw.schedule.schedules import get_schedule, stage_actions

ZB = ("zb-h1", "zb-h2")  # one chunk; zb-v (two in a V) takes post-validation too


# ---------------------------------------------------------------- programs

def test_d2_m4_program() -> None:
    """Stage 0 starts step 1 right after its speculative U0 and checks it after one forward; the last stage
    reduces the tied embedding after its last I (E0) and checks after its first receive of step 1."""
    line = [format_actions(stage_actions("zb-h2", 2, r, 4, 0, 2, post_validation=True)) for r in range(2)]
    assert line[0] == ("F0v0 SA0 F1v0 SA1 F2v0 SA2 RG0 I0v0 W0v0 RG1 I1v0 F3v0 SA3 RG2 I2v0 W1v0 W2v0 RG3 I3v0 W3v0 "
                       "R0 U0 F4v1 SA4 V0 F5v1 SA5 F6v1 SA6 RG4 I4v1 W4v1 RG5 I5v1 F7v1 SA7 RG6 I6v1 W5v1 W6v1 RG7 "
                       "I7v1 W7v1 R1 U1")
    assert line[1] == ("RA0 F0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 RA2 F2v0 I2v0 SG2 W0v0 RA3 F3v0 I3v0 SG3 E0 W1v0 W2v0 "
                       "W3v0 R0 U0 RA4 V0 F4v1 I4v1 SG4 RA5 F5v1 I5v1 SG5 RA6 F6v1 I6v1 SG6 W4v1 RA7 F7v1 I7v1 SG7 E1 "
                       "W5v1 W6v1 W7v1 R1 U1")


@pytest.mark.parametrize("schedule", (*ZB, "zb-v"))
def test_every_small_pipeline_is_correct(schedule: str) -> None:
    for d in range(1 if schedule in ZB else 2, 9 if schedule in ZB else 7):
        for m in range(d, 4 * d + 2):
            if m < get_schedule(schedule).min_microbatches(d):
                continue
            for first, steps in ((0, 3), (2, 1), (3, 2)):
                plain = check_schedule(schedule, d, m, first, steps)
                report = check_schedule(schedule, d, m, first, steps, post_validation=True)
                assert report.max_inflight == plain.max_inflight, (d, m)
                assert report.time_slots <= plain.time_slots, (d, m)
            check_grouped(schedule, d, m, 0, 3, post_validation=True)


def _period(name: str, d: int, m: int, pv: bool) -> float:
    """One step's steady state with F = I = W = 1 (a chunk's, for zb-v): three steps' makespan less two steps'."""
    zeros = (0.0,) * d
    timing = Timing((1.0,) * d, (2.0,) * d, zeros, zeros, zeros, zeros, zeros, input_s=(1.0,) * d, weight_s=(1.0,) * d)
    place = get_schedule(name).placement(d)
    spans = [Replay([stage_actions(name, d, r, m, 0, n, post_validation=pv) for r in range(d)], timing=timing,
                    placement=place).run().makespan for n in (2, 3)]
    return spans[1] - spans[0]


@pytest.mark.parametrize("d", [2, 3, 4, 6])
def test_zb_h2_and_zb_v_have_no_bubble_with_post_validation(d: int) -> None:
    """The paper's zero bubble: the parallelograms of consecutive steps tile; flushed, each step pays its fill
    (zb-v: of d - 1 chunk forwards, each half a microbatch's)."""
    for m in (2 * d - 1, 2 * d, 4 * d):
        assert _period("zb-h2", d, m, True) == 3 * m, (d, m)
        assert _period("zb-h2", d, m, False) == 3 * m + (d - 1), (d, m)
        assert _period("zb-v", d, m, True) == 6 * m, (d, m)
        assert _period("zb-v", d, m, False) == 6 * m + (d - 1), (d, m)
        for name in ("zb-h2", "zb-v"):
            assert get_schedule(name, post_validation=True).bubble(d, m) == 0.0


def test_priced_bubble_is_the_replayed_steady_state() -> None:
    """What the planner prices (``bubble_time`` of a +pv spec: the longest span of one rank's computes in one
    flushed step, less the work) is the steady state of the overlapping steps, three steps' makespan less two
    steps', at random F, I and W and m from 2d - 1 to 4d."""
    import random

    rng = random.Random(7)
    for _ in range(24):
        name, d = rng.choice(("zb-h1", "zb-h2", "zb-v")), rng.choice((2, 3, 4, 6))
        m, b, w = rng.randint(2 * d - 1, 4 * d), round(rng.uniform(0.5, 2.0), 3), round(rng.uniform(0.3, 1.5), 3)
        spec = get_schedule(name, post_validation=True)
        scale = 1 / spec.chunks  # a chunk's share of each time
        zeros = (0.0,) * d
        timing = Timing((scale,) * d, ((b + w) * scale,) * d, zeros, zeros, zeros, zeros, zeros,
                        input_s=(b * scale,) * d, weight_s=(w * scale,) * d)
        spans = [Replay([stage_actions(name, d, r, m, 0, n, post_validation=True) for r in range(d)], timing=timing,
                        placement=spec.placement(d)).run().makespan for n in (2, 3)]
        steady = spans[1] - spans[0] - m * (1 + b + w)
        assert spec.bubble_time(d, m, 1.0, b, w) == pytest.approx(max(steady, 0.0), abs=1e-9), (name, d, m, b, w)


def test_checker_refuses_an_inconsistent_cut() -> None:
    """Stage 0's VALIDATE moved before its first forward of step 1: stage 1 would take, before its own check,
    activations that stage 0 sends after its check, which a rollback could not re-send. Stage 1's moved after
    its I4: a backward on speculative weights."""
    progs = [stage_actions("zb-h2", 2, r, 4, 0, 2, post_validation=True) for r in range(2)]
    p = progs[0]
    i = next(k for k, a in enumerate(p) if a.op is Op.VALIDATE)
    p.insert(i - 2, p.pop(i))
    with pytest.raises(ScheduleError, match="not a consistent cut: stage 0 sends microbatches \\[\\] before it, "
                                            "stage 1 receives \\[4\\]"):
        check_actions("zb-h2", 2, 4, 0, 2, progs, post_validation=True)
    progs = [stage_actions("zb-h2", 2, r, 4, 0, 2, post_validation=True) for r in range(2)]
    p = progs[1]
    k = next(k for k, a in enumerate(p) if a.op is Op.VALIDATE)
    p.insert(k + 2, p.pop(k))  # after F4 and I4
    with pytest.raises(ScheduleError, match="only step 1's forwards"):
        check_actions("zb-h2", 2, 4, 0, 2, progs, post_validation=True)


def test_config_refuses_what_it_cannot_run() -> None:
    for bad, match in [(dict(schedule="flush"), "zero-bubble schedules"),
                       (dict(schedule="interleaved-1f1b"), "zero-bubble schedules")]:
        with pytest.raises(ConfigError, match=match):
            PipelineConfig(post_validation=True, **bad)
    with pytest.raises(ConfigError, match="at least d microbatches"):
        stage_actions("zb-h1", 4, 0, 3, 0, 2, post_validation=True)
    assert PipelineConfig("zb-h2", post_validation=True).spec.post_validation


# ---------------------------------------------------------------- numerics

def _runs(layout, variants):
    return {v: train_tiny(v[0], layout=layout, **dict(v[1])) for v in variants}


def _identical(outs, a, b) -> None:
    """Every rank's parameters and the last stage's losses of runs ``a`` and ``b``: bitwise."""
    for o in outs:
        x, y = o[a], o[b]
        assert x["losses"] == y["losses"] and x["norms"] == y["norms"] and x["skipped"] == y["skipped"]
        for k, p in y["params"].items():
            assert x["params"][k].equal(p), k


def _counts(outs, v) -> tuple[int, int]:
    """(speculated, rolled back): the same on every rank (the decisions follow the global norm)."""
    seen = {(o[v]["speculated"], o[v]["rolled_back"]) for o in outs}
    assert len(seen) == 1, seen
    return seen.pop()


def _expected(exact: dict, clip: float) -> tuple[int, int]:
    """(speculated, rolled back) from the exact run's norms: every step but the segment's last is validated;
    one speculates unless the step before it clipped or overflowed, and is rolled back where it does itself."""
    wrong = [s or n > clip for n, s in zip(exact["norms"], exact["skipped"])]
    spec = [t for t in range(len(wrong) - 1) if t == 0 or not wrong[t - 1]]
    return len(spec), sum(wrong[t] for t in spec)


# gpt-tiny at lr 1e-3: the global norm falls 2.97, 2.49, 2.23, 2.03, 1.84, ... over 8 steps, so clipping at 2.1
# clips steps 0-2 (the first speculates and is rolled back, the next wait for the norm) and speculates, and
# keeps, later ones; the segment's last update is always exact
CLIPPED = (("steps", 8), ("lr", 1e-3), ("clip", 2.1))
PV = (("post_validation", True),)


def test_d2_m4_tied_equals_the_exact_run_and_the_single_process():
    """Including a rollback whose re-sent activations meet receives the transport had posted ahead; zb-v (its
    V holds the tied embedding on rank 0) re-runs its first chunk's warm-up, in both transports."""
    plain = (("global_batch", 4), *CLIPPED)
    grouped = (*plain, ("p2p_mode", "grouped"))
    pairs = [("zb-h2", plain), ("zb-h1", plain), ("zb-h2", grouped), ("zb-v", plain), ("zb-v", grouped)]
    variants = [(name, o) for name, opts in pairs for o in (opts, opts + PV)]
    outs = run_workers(_runs, 2, (1, 2, 1), variants, timeout=300)
    for name, opts in pairs:
        _identical(outs, (name, opts + PV), (name, opts))
        assert _counts(outs, (name, opts + PV)) == _expected(outs[0][(name, opts)], 2.1) == (4, 1)
    dloss, dparam = compare([o[("zb-h2", plain + PV)] for o in outs], train_tiny("flush", **dict(plain)))
    assert dloss < 2e-5 and dparam < 1e-4, (dloss, dparam)


def test_d4_m8_dropout_recompute_and_t2():
    """The re-run warm-up draws the same dropout masks (recomputed at I too); at t = 2 its forwards' all-reduces
    run again on both tensor ranks; four stages roll back and re-run different numbers of forwards."""
    dr = (("global_batch", 8), ("dropout", 0.1), ("recompute", True), *CLIPPED)
    outs = run_workers(_runs, 4, (1, 4, 1), [("zb-h2", dr), ("zb-h2", dr + PV)], timeout=300)
    _identical(outs, ("zb-h2", dr + PV), ("zb-h2", dr))
    assert _counts(outs, ("zb-h2", dr + PV)) == _expected(outs[0][("zb-h2", dr)], 2.1)
    t2 = (("global_batch", 4), ("dropout", 0.1), *CLIPPED)
    outs = run_workers(_runs, 4, (2, 2, 1), [("zb-h2", t2), ("zb-h2", t2 + PV)], timeout=300)
    _identical(outs, ("zb-h2", t2 + PV), ("zb-h2", t2))
    assert _counts(outs, ("zb-h2", t2 + PV)) == _expected(outs[0][("zb-h2", t2)], 2.1)


def _fp16_and_sharded(layout):
    fp16 = dict(dtype="fp16", steps=6, lr=3e-3, clip=1e3, global_batch=4, inject_inf=(1, 3))
    zero = dict(steps=8, lr=1e-3, clip=2.1, global_batch=4, distributed_optimizer=True)
    return {(s, pv, k): train_tiny(s, layout=layout, post_validation=pv, **kw)
            for s in ("zb-h2",) for pv in (False, True) for k, kw in (("fp16", fp16), ("zero", zero))}


def test_fp16_overflow_and_the_distributed_optimizer():
    """An inf in the last stage's gradient of step 3 (speculated: steps 1 and 2 neither clipped nor overflowed)
    rolls the update back and skips it, halving the loss scale from step 4 on, as the exact run does; with the
    distributed optimizer (w = 2) a rollback restores this rank's shard and gathers the exact update again."""
    outs = run_workers(_fp16_and_sharded, 4, (1, 2, 2), timeout=300)
    for o in outs:
        a, b = o[("zb-h2", True, "fp16")], o[("zb-h2", False, "fp16")]
        assert a["skipped"] == b["skipped"] == [False, False, False, True, False, False]
        assert a["scales"] == b["scales"] == [2.0**12] * 4 + [2.0**11] * 2
        assert (a["speculated"], a["rolled_back"]) == (4, 1)
    _identical(outs, ("zb-h2", True, "fp16"), ("zb-h2", False, "fp16"))
    _identical(outs, ("zb-h2", True, "zero"), ("zb-h2", False, "zero"))
    assert _counts(outs, ("zb-h2", True, "zero")) == _expected(outs[0][("zb-h2", False, "zero")], 2.1)
