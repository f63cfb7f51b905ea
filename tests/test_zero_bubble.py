"""Zero-bubble schedules (zb-h1, zb-h2): synchronous, so they train like the single-process run (and,
with dropout, like Flush on the same layout, whose stages draw the same masks); their bubbles and
in-flight bounds against the paper's formulas and the replay; the checker refuses broken split programs.

CI runs a covering set of layouts, not the whole cross product: against the single process d4 m8 t1,
d2 m4 t2 (the tied embedding split across stages; Llama under sequence parallelism) and Llama and BERT
at d2 m4; with dropout 0.1 and stage recomputation, against Flush on the layout, d2 m4 t1, d4 m8 t1 and
d2 m4 t2.
"""

from __future__ import annotations

import random

import pytest
from multiproc import run_workers
from pipeline_harness import train_tiny
from test_pipeline_layouts import compare

from megatron_2bw.errors import ConfigError
from megatron_2bw.planner.simulator import StageCosts, simulate
from megatron_2bw.schedule.actions import format_actions, parse_actions
from megatron_2bw.schedule.checker import ScheduleError, check_actions
from megatron_2bw.schedule.schedules import get_schedule, stage_actions

ZB = ("zb-h1", "zb-h2")
KW = dict(steps=4, lr=1e-3)


# ---------------------------------------------------------------- programs and bubbles

def test_zb_h1_d2_m4_exact() -> None:
    """torch's ScheduleInterleavedZeroBubble with one chunk: stage r defers each W by r microbatches."""
    assert format_actions(stage_actions("zb-h1", 2, 0, 4, 0, 1)) == (
        "F0v0 SA0 F1v0 SA1 RG0 I0v0 W0v0 F2v0 SA2 RG1 I1v0 W1v0 F3v0 SA3 RG2 I2v0 W2v0 RG3 I3v0 W3v0 R0 U0")
    assert format_actions(stage_actions("zb-h1", 2, 1, 4, 0, 1)) == (
        "RA0 F0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 W0v0 RA2 F2v0 I2v0 SG2 W1v0 RA3 F3v0 I3v0 SG3 W2v0 W3v0 R0 U0")


def _step_time(name: str, d: int, m: int, f: float, b: float, w: float) -> float:
    sim = simulate(name, d, m, [StageCosts(f, b + w, input_s=b, weight_s=w) for _ in range(d)], num_steps=4)
    return sim.step_time_s


@pytest.mark.parametrize("d", (2, 4, 8))
def test_bubbles_match_the_paper(d: int) -> None:
    """With equal F, I and W: 1F1B idles 3(d-1) per step, ZB-H1 (d-1), a third; ZB-H1 generally idles
    (d-1)(f + b - w) (the paper's formula, m >= d, w <= min(f, b)); ZB-H2 at m >= 2d-1 only for the
    first forward's fill (d-1)f, which a flush per step cannot hide; measured by the planner's simulator."""
    m = 2 * d
    flush = _step_time("flush", d, m, 1, 1, 1) - 3 * m
    assert flush == pytest.approx(3 * (d - 1))
    assert _step_time("zb-h1", d, m, 1, 1, 1) - 3 * m == pytest.approx(flush / 3)
    for f, b, w in ((1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (1.0, 1.3, 0.7), (2.0, 1.0, 1.0)):
        zb1 = _step_time("zb-h1", d, m, f, b, w) - m * (f + b + w)
        assert zb1 == pytest.approx((d - 1) * (f + b - w)), (f, b, w)
        assert get_schedule("zb-h1").bubble_time(d, m, f, b, w) == pytest.approx(zb1)
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 0.8, 0.6), (2.0, 1.0, 1.0)):
        zb2 = _step_time("zb-h2", d, m, f, b, w) - m * (f + b + w)
        assert zb2 == pytest.approx((d - 1) * f), (f, b, w)
        assert get_schedule("zb-h2").bubble_time(d, m, f, b, w) == pytest.approx(zb2)
    # and the replayed bubble_time agrees with the simulator off the formulas' range too (within the
    # 1e-3 rounding of the times relative to f that the planner's price replays on)
    for name in ZB:
        for mm, (f, b, w) in ((d // 2 or 1, (1.0, 1.0, 1.0)), (m, (0.3, 1.0, 2.0)), (d + 1, (1.0, 2.0, 0.5))):
            assert get_schedule(name).bubble_time(d, mm, f, b, w) == pytest.approx(
                _step_time(name, d, mm, f, b, w) - mm * (f + b + w), rel=2e-3), (name, mm, f, b, w)


def test_inflight_and_deferred_weight_grads() -> None:
    """ZB-H1 holds 1F1B's peak, d (stage 0's, now on every stage); ZB-H2 2d - 1 (F to W). Deferred Ws:
    stage r of ZB-H1 keeps r + 1 microbatches between I and W (its lag r plus the one in hand)."""
    h1, h2 = get_schedule("zb-h1"), get_schedule("zb-h2")
    for d in (2, 4, 8):
        m = 4 * d
        assert [h1.inflight(d, r, m) for r in range(d)] == [d] * d
        assert [h2.inflight(d, r, m) for r in range(d)] == [2 * d - 1] * d
        assert [h1.deferred_weight_grads(d, r, m) for r in range(d)] == [r + 1 for r in range(d)]
        assert all(1 <= h2.deferred_weight_grads(d, r, m) <= 2 * d - 1 for r in range(d))
        assert h1.inflight(d, 0, 2) == 2  # never more than the step's microbatches
    assert h1.split_backward and h2.split_backward and not get_schedule("flush").split_backward
    assert h1.stale_steps == h2.stale_steps == 0 and h1.weight_versions == h2.weight_versions == 1


def _check(name: str, lines: list[str], m: int) -> None:
    check_actions(name, len(lines), m, 0, 1, [parse_actions(x, m) for x in lines])


S0 = "F0v0 SA0 F1v0 SA1 RG0 I0v0 W0v0 RG1 I1v0 W1v0 R0 U0"  # zb-h1 at d=2, m=2
S1 = "RA0 F0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 W0v0 W1v0 R0 U0"


def test_checker_refuses_broken_split_programs() -> None:
    assert [S0, S1] == [format_actions(stage_actions("zb-h1", 2, r, 2, 0, 1)) for r in range(2)]
    _check("zb-h1", [S0, S1], 2)
    with pytest.raises(ScheduleError, match="weight gradient before the input gradient"):
        _check("zb-h1", [S0, "RA0 F0v0 W0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 W1v0 R0 U0"], 2)
    with pytest.raises(ScheduleError, match="gradient sent before the backward"):
        _check("zb-h1", [S0, "RA0 F0v0 SG0 I0v0 RA1 F1v0 I1v0 SG1 W0v0 W1v0 R0 U0"], 2)
    with pytest.raises(ScheduleError, match="only 1 of the 2 backwards"):  # a reduction before the last W
        _check("zb-h1", [S0, "RA0 F0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 W0v0 R0 W1v0 U0"], 2)
    with pytest.raises(ScheduleError, match="weight gradient of the microbatch computed twice"):
        _check("zb-h1", [S0, "RA0 F0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 W0v0 W0v0 W1v0 R0 U0"], 2)
    with pytest.raises(ScheduleError, match="splits its backward"):
        _check("zb-h1", ["F0v0 SA0 F1v0 SA1 RG0 B0v0 RG1 B1v0 R0 U0", "RA0 F0v0 B0v0 SG0 RA1 F1v0 B1v0 SG1 R0 U0"], 2)
    with pytest.raises(ScheduleError, match="runs whole backwards"):
        _check("flush", [S0, S1], 2)
    with pytest.raises(ScheduleError, match="3 microbatches in flight, limit is 2"):  # in flight until W
        late = "RA0 F0v0 I0v0 SG0 RA1 F1v0 I1v0 SG1 RA2 F2v0 I2v0 SG2 W0v0 W1v0 RA3 F3v0 I3v0 SG3 W2v0 W3v0 R0 U0"
        _check("zb-h1", [format_actions(stage_actions("zb-h1", 2, 0, 4, 0, 1)), late], 4)


def test_2bw_flags_are_refused() -> None:
    from megatron_2bw.config import PipelineConfig

    for name in ZB:
        refused = f"--2bw-compensation predict only applies to --pipeline-schedule 2bw, not {name}"
        with pytest.raises(ConfigError, match=refused):
            PipelineConfig(name, 1, 4, compensation="predict")


# ---------------------------------------------------------------- numerics


def test_single_stage_equals_flush():
    ref = train_tiny("flush", **KW)
    for name in ZB:
        out = train_tiny(name, **KW)
        assert out["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        for k, p in ref["params"].items():
            assert (p - out["params"][k]).abs().max().item() < 1e-6, k


def _layout_runs(layout, variants):
    return {v: train_tiny(v[0], layout=layout, **dict(v[1])) for v in variants}


def _assert_close(outs, ref, dloss_max, dparam_max):
    dloss, dparam = compare(outs, ref)
    assert dloss < dloss_max and dparam < dparam_max, (dloss, dparam)


def _bounds(outs, name, d):
    spec = get_schedule(name)
    for o in outs:
        st, r = o["stats"], o["coords"][2]
        assert 1 <= st["max_inflight"] <= spec.inflight(d, r, o["m"]), (name, r, st)
        assert st["weight_versions"] == 1


# Adam at lr 1e-3 for 4 steps: the split's only change is where a weight's uses are summed (the same
# products in another order, relative error ~1e-7 per gradient), which Adam's normalized steps keep at
# ~1e-7 of lr per step; the pipelined-vs-single-process bounds are test_pipeline_layouts'.
SAME_LAYOUT = (1e-6, 1e-6)
VS_SINGLE = (2e-5, 1e-4)


def _same_as_flush(outs, names, opts) -> None:
    """Each rank's parameters and the last stage's losses of ``names`` against Flush's on the layout."""
    for name in names:
        dloss = dparam = 0.0
        for o in outs:
            a, b = o[(name, opts)], o[("flush", opts)]
            if a["last"]:
                dloss = max(dloss, max(abs(x - y) for x, y in zip(a["losses"], b["losses"])))
            dparam = max(dparam, max((a["params"][k] - p).abs().max().item() for k, p in b["params"].items()))
        assert dloss < SAME_LAYOUT[0] and dparam < SAME_LAYOUT[1], (name, dloss, dparam)


DROPOUT_RECOMPUTE = (("dropout", 0.1), ("recompute", True), *KW.items())


def test_d2_m4_dropout_and_recompute_equal_flush():
    """zb-h1 and zb-h2 at d=2 m=4 with dropout 0.1 and stage recomputation (recompute at I, W from its
    graph) train like Flush on the same layout, which draws the same dropout masks."""
    opts = (("global_batch", 4), *DROPOUT_RECOMPUTE)
    variants = [(s, opts) for s in ("flush", *ZB)]
    outs = run_workers(_layout_runs, 2, (1, 2, 1), variants, timeout=240)
    _same_as_flush(outs, ZB, opts)
    for name in ZB:
        _bounds([o[(name, opts)] for o in outs], name, 2)
    # the last stage keeps what a deferred W reads of its recomputed graph (and the caught gradients): counted
    last = next(o for o in outs if o[("flush", opts)]["last"])
    flush, zb = last[("flush", opts)]["stats"], last[("zb-h1", opts)]["stats"]
    assert (flush["max_inflight"], zb["max_inflight"]) == (1, 2)
    assert zb["peak_stashed_bytes"] > flush["peak_stashed_bytes"]


@pytest.fixture(scope="module")
def single():
    return {gb: train_tiny("flush", global_batch=gb, **KW) for gb in (4, 8)}


def test_d4_m8_equals_the_single_process(single):
    """And with dropout and recomputation, Flush on the layout."""
    variants = [(s, (("global_batch", 8), *KW.items())) for s in ZB]
    dr = (("global_batch", 8), *DROPOUT_RECOMPUTE)
    outs = run_workers(_layout_runs, 4, (1, 4, 1), variants + [(s, dr) for s in ("flush", *ZB)], timeout=300)
    for v in variants:
        _assert_close([o[v] for o in outs], single[8], *VS_SINGLE)
        _bounds([o[v] for o in outs], v[0], 4)
    _same_as_flush(outs, ZB, dr)


LLAMA = (("global_batch", 4), ("kind", "llama-tiny"), *KW.items())
LLAMA_SP = (*LLAMA, ("sequence_parallel", True))


def test_d2_m4_t2_tied_equals_the_single_process(single):
    """Tensor parallelism (the all-reduces on I's path) and gpt-tiny's tied embedding across stages: the
    head's copy gets its gradient in W, then the embedding all-reduce after every W; and Llama under
    sequence parallelism, whose column GEMMs compute only the half of their backward that I or W asks for
    (gpt-tiny under sequence parallelism: ``test_sequence_parallel_gpt.py``, with SGD)."""
    variants = [(s, (("global_batch", 4), *KW.items())) for s in ZB] + [("zb-h1", LLAMA_SP)]
    dr = (("global_batch", 4), *DROPOUT_RECOMPUTE)  # the tensor-parallel RNG tracker's dropout, replayed at I
    outs = run_workers(_layout_runs, 4, (2, 2, 1), variants + [("flush", dr), ("zb-h2", dr)], timeout=300)
    for v in variants[:2]:
        _assert_close([o[v] for o in outs], single[4], *VS_SINGLE)
    _assert_close([o[("zb-h1", LLAMA_SP)] for o in outs], train_tiny("flush", **dict(LLAMA)), *VS_SINGLE)
    _same_as_flush(outs, ("zb-h2",), dr)


BERT = (("global_batch", 4), ("kind", "bert-tiny"), *KW.items())


GROUPED = (("global_batch", 4), ("p2p_mode", "grouped"), *KW.items())


def test_llama_and_bert_d2_m4_equal_the_single_process(single):
    """Llama (untied output layer, GQA, SwiGLU, RMSNorm) and BERT (pooler, sentence-order head, both
    losses) split their backwards like GPT; and zb-h2 with the NCCL-safe grouped transfers (each send
    waited for: the rendezvous the checker proves) runs without a hang."""
    variants = [("zb-h2", LLAMA), ("zb-h1", BERT), ("zb-h2", GROUPED)]
    outs = run_workers(_layout_runs, 2, (1, 2, 1), variants, timeout=240)
    for name, opts in variants[:2]:
        _assert_close([o[(name, opts)] for o in outs], train_tiny("flush", **dict(opts)), *VS_SINGLE)
    _assert_close([o[("zb-h2", GROUPED)] for o in outs], single[4], *VS_SINGLE)


def _fp16_overflow(layout):
    # the last stage poisons its gradient of step 2: every rank skips it and backs the loss scale off
    return {s: train_tiny(s, layout=layout, dtype="fp16", steps=5, lr=3e-3, clip=1.0, global_batch=4, inject_inf=(1, 2))
            for s in ("flush", "zb-h1")}


def test_fp16_overflow_skips_and_backs_off_like_flush():
    """fp16 dynamic loss scaling through a split backward: the step's scale is fixed at its first I on
    every stage and the update unscales by it; an overflow skips the step and halves the scale from the
    next step on, exactly as Flush does."""
    for o in run_workers(_fp16_overflow, 2, (1, 2, 1), timeout=240):
        flush, zb = o["flush"], o["zb-h1"]
        assert zb["skipped"] == flush["skipped"] == [False, False, True, False, False]
        assert zb["scales"] == flush["scales"] == [2.0**12] * 3 + [2.0**11] * 2
        for k, p in flush["params"].items():
            assert (p - zb["params"][k]).abs().max().item() < 1e-6, k


def test_bubble_time_shortcuts_match_the_full_replay():
    """The planner's zero-bubble price replays at most 4d microbatches on times relative to f rounded to
    1e-3: against the full replay at random costs and m past 4d, within 0.2% (the rounding's reach)."""
    from megatron_2bw.schedule.rounds import _replayed_bubble

    rng = random.Random(0)
    for _ in range(40):
        d = rng.randint(2, 5)
        f, b, w = (rng.uniform(0.2, 2.0) for _ in range(3))
        for name in ("zb-h1", "zb-h2"):
            for m in (4 * d + 1, 8 * d):
                full = _replayed_bubble(get_schedule(name), d, m, f, b, w)
                assert get_schedule(name).bubble_time(d, m, f, b, w) == pytest.approx(full, rel=2e-3, abs=1e-9)


def test_deferred_weight_grads_past_4d_equal_the_full_order():
    """The memory model's deferred-W count is taken at 4d microbatches: it equals the count on the full
    generated order for every stage up to d = 6 and m up to 8d + 2."""
    for name in ("zb-h1", "zb-h2", "zb-v"):
        spec = get_schedule(name)
        for d in range(1 if name != "zb-v" else 2, 7):
            for r in range(d):
                for m in (4 * d + 1, 6 * d + 1, 8 * d + 2):
                    order = (spec.split_order(d, r, m) if name != "zb-v"
                             else [(op, mb) for op, _, mb in spec.chunk_order(d, r, m)])
                    pending = most = held = peak = 0
                    for op, _ in order:
                        pending += (op.value == "I") - (op.value == "W")
                        held += (op.value == "F") - (op.value == "W")
                        most, peak = max(most, pending), max(peak, held)
                    assert spec.deferred_weight_grads(d, r, m) == most, (name, d, r, m)
                    if name == "zb-v":
                        assert spec.inflight(d, r, m) == peak, (name, d, r, m)
