"""Pipeline schedule actions: the vocabulary shared by the schedule generator, the checker
and the executor, so that a schedule is plain data that can be printed, compared and verified
before any process runs it."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError


class Op(enum.Enum):
    """One thing a stage does; the value is the short label used in printed schedules."""

    RECV_ACT = "RA"
    FORWARD = "F"
    SEND_ACT = "SA"
    RECV_GRAD = "RG"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  # the input-gradient half of a split backward (zero-bubble schedules)
    BACKWARD_WEIGHT = "W"  # the weight-gradient half, run later from the graph I kept
    SEND_GRAD = "SG"
    REDUCE_GRADS = "R"
    APPLY_UPDATE = "U"
    # optimizer post-validation (--enable-optimizer-post-validation): the tied word embedding's gradient
    # all-reduced as soon as the last stage has it, and the check of a speculative update against the
    # global norm, in the next step's warm-up
    REDUCE_EMBEDDING = "E"
    VALIDATE = "V"

    # Members are singletons: hash by identity (in C) rather than by Enum's Python-level name hash,
    # since replays dispatch every action on its op.
    __hash__ = object.__hash__


MICROBATCH_OPS: frozenset[Op] = frozenset(
    {Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT, Op.RECV_GRAD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT,
     Op.SEND_GRAD}
)
"""Ops that act on one microbatch (``mb`` is meaningful); the others act on a whole step."""

COMPUTE_OPS: frozenset[Op] = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
"""Ops that run the model on a weight version (``version`` is meaningful)."""

STEP_OPS: frozenset[Op] = frozenset({Op.REDUCE_GRADS, Op.APPLY_UPDATE, Op.REDUCE_EMBEDDING, Op.VALIDATE})
"""Ops that act on a whole step (``step`` is meaningful, ``mb`` is not)."""

TRANSFERS: dict[Op, tuple[int, Op]] = {
    Op.SEND_ACT: (1, Op.RECV_ACT),
    Op.RECV_GRAD: (1, Op.SEND_GRAD),
    Op.RECV_ACT: (-1, Op.SEND_ACT),
    Op.SEND_GRAD: (-1, Op.RECV_GRAD),
}
"""Transfer op -> (peer stage offset, the op the peer runs for the same microbatch)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage's program.

    ``mb`` is the global 0-based microbatch index counted from the start of training,
    ``step`` the optimizer step it belongs to (``mb // m``; for the step ops, REDUCE_GRADS,
    APPLY_UPDATE, REDUCE_EMBEDDING and VALIDATE, the step whose gradients they handle) and
    ``version`` the weight version W(v) a compute action runs on. Unused fields stay -1. ``chunk`` is
    the model chunk (virtual stage) of the rank a microbatch action belongs to: 0 unless the schedule
    places several chunks on a rank (interleaved, V); printed as ``c<chunk>`` only when it is not 0
    (``F3c1v0``, ``SA3c1``). BACKWARD is a whole backward; BACKWARD_INPUT then BACKWARD_WEIGHT split it
    in two.
    """

    op: Op
    mb: int = -1
    step: int = -1
    version: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        label = self.op.value
        if self.op in STEP_OPS:
            return f"{label}{self.step}"
        c = f"c{self.chunk}" if self.chunk else ""
        if self.op in COMPUTE_OPS:
            return f"{label}{self.mb}{c}v{self.version}"
        return f"{label}{self.mb}{c}"


def format_actions(actions: Iterable[Action]) -> str:
    """One stage's program on one line (``F0v0 SA0 RG0 B0v0 SG0 ...``), for logs and tests."""
    return " ".join(str(a) for a in actions)


_TOKEN = re.compile(r"(RA|SA|RG|SG|F|B|I|W|R|U|E|V)(\d+)(?:c(\d+))?(?:v(\d+))?")
_BY_LABEL: dict[str, Op] = {op.value: op for op in Op}


def parse_action(token: str, m: int) -> Action:
    """Inverse of ``str(Action)``; ``m`` (microbatches per step) restores the ``step`` field."""
    if m < 1:
        raise ConfigError(f"microbatches per step must be >= 1, got m={m}")
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise ConfigError(f"cannot parse schedule action {token!r}")
    op, number, chunk, version = _BY_LABEL[match.group(1)], int(match.group(2)), match.group(3), match.group(4)
    if (version is not None) != (op in COMPUTE_OPS):
        raise ConfigError(f"action {token!r}: only F, B, I and W carry a version (F3v1)")
    if op in MICROBATCH_OPS:
        return Action(op, number, number // m, -1 if version is None else int(version), int(chunk or 0))
    if chunk is not None:
        raise ConfigError(f"action {token!r}: R, U, E and V act on a whole step and carry no chunk")
    return Action(op, step=number)


def parse_actions(line: str, m: int) -> list[Action]:
    """Inverse of :func:`format_actions`, so tests and tools can write schedules by hand."""
    return [parse_action(token, m) for token in line.split()]
