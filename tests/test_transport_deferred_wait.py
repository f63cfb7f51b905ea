"""The gloo transport's receive action does not wait: it hands on the posted receive (``Incoming``) and the
consumer waits. Two gloo processes: rank 0 sends its activation only after a delay; rank 1's receive action
must return before the message could have arrived, and its ``wait()`` must then give rank 0's tensor. A
receive that waited at the action (the old behaviour) would take the whole delay there."""

from __future__ import annotations

import time

import torch
from multiproc import run_workers

from megatron_2bw.pipeline.transport import Incoming, Transport
from megatron_2bw.schedule.actions import Action, Op

DELAY = 0.6
SHAPE = (2, 3)


def _worker() -> dict:
    import torch.distributed as dist

    r = dist.get_rank()
    t = Transport(None if r == 0 else 0, 1 if r == 0 else None, SHAPE, torch.float32, torch.device("cpu"),
                  mode="prefetch")
    if r == 0:
        time.sleep(DELAY)
        t.run([Action(Op.SEND_ACT, 0, 0)], {Action(Op.SEND_ACT, 0, 0): torch.arange(6.0).view(SHAPE)})
        t.drain()
        return {}
    t.plan([Action(Op.RECV_ACT, 0, 0)])
    t0 = time.perf_counter()
    [(a, got)] = t.run([Action(Op.RECV_ACT, 0, 0)], {})
    handed = time.perf_counter() - t0
    x = got.wait()
    waited = time.perf_counter() - t0
    t.drain()
    return {"incoming": isinstance(got, Incoming), "handed": handed, "waited": waited, "x": x.tolist()}


def test_receive_action_hands_on_and_the_consumer_waits():
    _, got = run_workers(_worker, 2, timeout=120)
    assert got["incoming"]
    assert got["handed"] < DELAY / 3, got  # the action did not wait for the late send
    assert got["waited"] >= DELAY / 2, got  # the consumer did
    assert got["x"] == torch.arange(6.0).view(SHAPE).tolist()
