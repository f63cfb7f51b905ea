"""Logging without drains: the pipeline drains only for evaluation, saving and exit.

- Pure: a segment cut short ``STOP_LAG`` steps after an update keeps every action already run
  (a prefix of the shorter segment's) and every receive the transport may have posted ahead, for
  every schedule, depth, microbatch count and stage; one step less is not enough.
- Two processes (d = 2), the real ``Trainer``: with ``--log-interval 1`` and ``4``, 2BW's per-step
  losses are bitwise those of the engine run as one drained segment, and ``pipeline_drains`` is 1
  (every schedule); with evaluations and saves it counts those boundaries plus the end. An exit
  signal seen on one rank (with prefetched and with grouped transfers) and a non-finite gradient
  stop every rank at the step the documented lags give (``WAIT_LAG`` to agree, ``STOP_LAG`` to
  cut), with the same losses up to there.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
from e2e import corpus, train_args  # noqa: F401
from multiproc import run_workers

from megatron_2bw.errors import ConfigError
from megatron_2bw.pipeline.transport import Transport
from megatron_2bw.schedule.actions import Op
from megatron_2bw.schedule.schedules import SCHEDULE_NAMES, STOP_LAG, cut_segment, stage_actions, validate_pipeline
from megatron_2bw.training.health import EXIT_UNHEALTHY
from megatron_2bw.training.step_stats import WAIT_LAG

RECVS = (Op.RECV_ACT, Op.RECV_GRAD)
AHEAD = inspect.signature(Transport).parameters["ahead"].default  # receives of a kind the transport posts ahead


def _maybe_posted(actions, i: int) -> list:
    """Receives a prefetching transport may have posted once ``actions[i]`` ran: every one up to the next
    action, and the next ``AHEAD`` of each kind not yet consumed (a superset of what it posts)."""
    out = [a for a in actions[:i + 2] if a.op in RECVS]
    for kind in RECVS:
        out += [a for a in actions[i + 1:] if a.op is kind][:AHEAD]
    return out


def _cut_failures(lag: int, first: int = 1, steps: int = 8) -> list[tuple]:
    """Every (schedule, d, m, stage, update step) where cutting at ``update + lag`` would break a run."""
    bad = []
    # with optimizer post-validation a speculative update reports its step at its VALIDATE, an exact one at itself
    for schedule, pv in [(s, False) for s in SCHEDULE_NAMES] + [("zb-h1", True), ("zb-h2", True)]:
        for d in (1, 2, 3, 4):
            for m in sorted({d, 2 * d}):
                try:
                    # its own rules: m >= d, interleaved's m % d, zb-v's 2d - 1
                    validate_pipeline(schedule, d, m, post_validation=pv)
                except ConfigError:
                    continue
                for r in range(d):
                    full = stage_actions(schedule, d, r, m, first, steps, post_validation=pv)
                    for i, a in enumerate(full):
                        end = a.step + lag
                        if a.op not in (Op.APPLY_UPDATE, Op.VALIDATE) or end >= first + steps:
                            continue
                        try:
                            rest = cut_segment(schedule, d, r, m, first, full[:i + 1], end, post_validation=pv)
                        except RuntimeError:
                            bad.append((schedule, d, m, r, a.step, "prefix"))
                            continue
                        if full[:i + 1] + rest != stage_actions(schedule, d, r, m, first, end - first,
                                                                post_validation=pv):
                            bad.append((schedule, d, m, r, a.step, "rest"))
                        if any(p.step >= end for p in _maybe_posted(full, i)):
                            bad.append((schedule, d, m, r, a.step, "posted"))
    return bad


def test_a_segment_can_be_cut_stop_lag_steps_after_any_update():
    assert _cut_failures(STOP_LAG) == []
    shorter = _cut_failures(STOP_LAG - 1)
    assert {b[0] for b in shorter} >= {"2bw"} and {b[5] for b in shorter} == {"prefix", "posted"}


def test_cutting_too_late_is_refused():
    full = stage_actions("2bw", 2, 0, 2, 0, 6)
    i = full.index(next(a for a in full if a.op is Op.APPLY_UPDATE and a.step == 2))
    with pytest.raises(RuntimeError, match="cannot end the segment from step 0 at step 4 on stage 0"):
        cut_segment("2bw", 2, 0, 2, 0, full[:i + 1], 4)


# ------------------------------------------------------------------ the real trainer on two processes
ITERS = 12
SIGNAL_STEP = 3  # rank 1 "receives" an exit signal as it fetches this step's first microbatch
BAD_STEP = 4  # rank 0's gradient of this step gets an inf


def _trainer(argv: list[str], faults=None):
    import torch.distributed as dist

    from megatron_2bw import parallel_state
    from megatron_2bw.training import launch, loop, signals

    prep, _ = launch.configure("gpt", argv)
    prep.exit_handler = signals.ExitSignalHandler((), handle_sigint=False, rank=dist.get_rank(),
                                                  announce=lambda _: None)
    prep.exit_duration = signals.ExitDuration(None)
    state = parallel_state.initialize(prep.cfg.parallel, backend="gloo", device="cpu")
    return loop.Trainer(prep, state, faults)


def _signal_on_rank_1(trainer) -> None:
    get, m = trainer.get_batch, trainer.m

    def fetch(mb: int) -> dict:
        if trainer.state.rank == 1 and mb == SIGNAL_STEP * m:
            trainer.prep.exit_handler.received = "SIGUSR1"
        return get(mb)

    trainer.get_batch = fetch


def _runs(base: list[str], out: str) -> dict:
    """Every case on this rank: (exit code, completed steps); the engine reference's losses on the last stage."""
    from megatron_2bw.faults import FaultInjector
    from megatron_2bw.training.lr_schedule import lr_at

    cases = {
        "log1": ["--log-interval", "1"], "log4": ["--log-interval", "4"],
        "flush": ["--log-interval", "1", "--pipeline-schedule", "flush"],
        "gpipe": ["--log-interval", "1", "--pipeline-schedule", "gpipe"],
        "boundaries": ["--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3", "--save-interval", "4",
                       "--save", os.path.join(out, "ckpt_b")],
        "signal": ["--log-interval", "1", "--save", os.path.join(out, "ckpt_s")],
        "signal_grouped": ["--log-interval", "1", "--p2p-mode", "grouped"],  # NCCL's transfer model, on gloo
        "unhealthy": ["--log-interval", "1"],
    }
    got = {}
    for name, extra in cases.items():
        faults = FaultInjector(poison_grads=frozenset({(0, BAD_STEP)})) if name == "unhealthy" else None
        trainer = _trainer([*base, *extra, "--metrics-file", os.path.join(out, f"{name}.jsonl")], faults)
        if name.startswith("signal"):
            _signal_on_rank_1(trainer)
        got[name] = (trainer.train(), trainer.stage.step)
    from megatron_2bw.training import loop

    cap, loop.SEGMENT_MICROBATCHES = loop.SEGMENT_MICROBATCHES, 2 * 4  # 2 steps of m=4 per segment
    try:
        trainer = _trainer([*base, "--log-interval", "1", "--metrics-file", os.path.join(out, "capped.jsonl")])
        got["capped"] = (trainer.train(), trainer.stage.step)
    finally:
        loop.SEGMENT_MICROBATCHES = cap
    ref = _trainer([*base, "--log-interval", "1"])
    results = ref.stage.train(ITERS, ref.get_batch, lambda t: lr_at(ref.cfg.lr, t))
    got["reference"] = [r.loss for r in results] if ref.state.is_last_stage else None
    return got


def _records(out, name: str) -> tuple[list[float], dict]:
    with open(os.path.join(out, f"{name}.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if r["type"] == "train"]
    assert [r["iteration"] for r in train] == list(range(len(train)))  # every step once, in order
    (end,) = [r for r in rows if r["type"] == "end"]
    return [r["loss"] for r in train], end


def _signal_stop() -> int:
    """Where the signal run must stop: rank 1 (the last stage) sets the flag before its first forward of
    SIGNAL_STEP, so the first update after it carries it; every rank reads it WAIT_LAG updates later and
    cuts the segment STOP_LAG steps after that."""
    acts = stage_actions("2bw", 2, 1, 4, 0, ITERS)
    fwd = acts.index(next(a for a in acts if a.op is Op.FORWARD and a.step == SIGNAL_STEP))
    carrier = next(a.step for a in acts[fwd:] if a.op is Op.APPLY_UPDATE)
    return carrier + WAIT_LAG + STOP_LAG


def test_log_interval_does_not_drain_and_stops_agree(corpus, tmp_path):  # noqa: F811
    base = [*train_args(corpus, preset="gpt-tiny", d=2, schedule="2bw", iters=ITERS, micro=1, global_batch=4),
            "--eval-iters", "0"]
    outs = run_workers(_runs, 2, base, str(tmp_path), timeout=240)
    ref = outs[1]["reference"]  # the engine alone, one drained segment: the last stage's losses
    for name in ("log1", "log4", "flush", "gpipe", "boundaries"):
        assert [o[name] for o in outs] == [(0, ITERS)] * 2, name
    losses, end = _records(tmp_path, "log1")
    assert losses == ref and end["pipeline_drains"] == 1  # bitwise, with a log line every step
    losses, end = _records(tmp_path, "log4")
    assert losses == ref and end["pipeline_drains"] == 1
    for name in ("flush", "gpipe"):  # they drain inside every step by design; the trainer's segments: one
        losses, end = _records(tmp_path, name)
        assert len(losses) == ITERS and end["pipeline_drains"] == 1, name
    losses, end = _records(tmp_path, "capped")  # a long uninterrupted stretch drains every SEGMENT_MICROBATCHES
    assert outs[0]["capped"] == (0, ITERS) and losses == ref and end["pipeline_drains"] == -(-ITERS // 2)
    losses, end = _records(tmp_path, "boundaries")
    stops = {k for k in range(1, ITERS) if k % 3 == 0 or k % 4 == 0}  # evaluations and saves before the end
    assert losses == ref and end["pipeline_drains"] == len(stops) + 1

    stop = _signal_stop()
    assert stop < ITERS and [o["signal"] for o in outs] == [(0, stop)] * 2  # both ranks, the same step
    losses, end = _records(tmp_path, "signal")
    assert losses == ref[:stop] and end["reason"] == "signal" and end["completed_iterations"] == stop
    with open(tmp_path / "ckpt_s" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == stop
    assert [o["signal_grouped"] for o in outs] == [(0, stop)] * 2
    assert _records(tmp_path, "signal_grouped")[0] == ref[:stop]

    stop = BAD_STEP + WAIT_LAG + STOP_LAG
    assert [o["unhealthy"] for o in outs] == [(EXIT_UNHEALTHY, stop)] * 2
    losses, end = _records(tmp_path, "unhealthy")
    assert losses[:BAD_STEP + 1] == ref[:BAD_STEP + 1] and len(losses) == stop
    assert end["reason"] == "unhealthy" and end["completed_iterations"] == stop and end["pipeline_drains"] == 1
