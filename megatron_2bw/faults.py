"""Faults injected on purpose: the engine's two hooks as a protocol, and the injector the environment describes.

The engine, the trainer and the checkpoint writer depend on this module only, never on the tests: like
Megatron's ``RerunErrorInjector``, the faults a run should suffer are described once, up front, and passed
to ``build_stage(..., faults=...)`` as any object that has the two hooks of :class:`Faults`:

- REDUCE_GRADS(t): :meth:`Faults.poison` may write an inf into the rank's step-t gradient, which must make
  every rank skip step t (the overflow path);
- FORWARD of a microbatch of step t: :meth:`Faults.before_forward` may end the process
  (``os._exit(1)``, no clean-up, as a crash would) on the rank chosen to die.

:class:`FaultInjector` is the one implementation the trainer builds: processes started by ``torchrun``
get theirs from the environment (:meth:`FaultInjector.from_env`, called by the session, never by the
engine; docs/training.md "Fault injection"); tests hand one in, or their own object with the same hooks.
Torch-free: a gradient is only indexed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class Faults(Protocol):
    """What the engine asks at its two injection points."""

    def poison(self, rank: int, step: int, grad: Tensor) -> None:
        """Make ``grad`` (this rank's flat step-``step`` gradient) non-finite, or leave it."""

    def before_forward(self, rank: int, step: int) -> None:
        """End this process, or return."""


KILL_RANK_ENV = "MEGATRON_2BW_FAULT_KILL_RANK"
KILL_ITER_ENV = "MEGATRON_2BW_FAULT_KILL_ITER"
# "restart:rank:step,...": kill ``rank`` at ``step`` only in the launch attempt whose
# $TORCHELASTIC_RESTART_COUNT is ``restart`` (torchrun --max-restarts), so a restarted job is not
# killed again at the same step.
KILL_PLAN_ENV = "MEGATRON_2BW_FAULT_KILL_PLAN"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
# "rank:first-last,...": an inf in ``rank``'s gradient of every step from ``first`` to ``last`` (0-based;
# "rank:step" for one step): the overflow path through the command line
POISON_ENV = "MEGATRON_2BW_FAULT_POISON"


@dataclass(frozen=True)
class FaultInjector:
    """The faults an environment (or a test) describes. The trainer honours the ``MEGATRON_2BW_FAULT_*``
    variables it documents, so this lives in the library, not in test support."""

    poison_grads: frozenset[tuple[int, int]] = frozenset()  # (global rank, step): an inf in that gradient
    kill_rank: int | None = None  # the global rank that dies ...
    kill_iteration: int = 0  # ... when it starts a forward of this step (0-based) or a later one

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultInjector | None:
        """The kill fault named by ``$MEGATRON_2BW_FAULT_KILL_RANK`` / ``_ITER``, or this launch attempt's
        entry of ``$MEGATRON_2BW_FAULT_KILL_PLAN``, with the gradients ``$MEGATRON_2BW_FAULT_POISON``
        names; None when none is set."""
        poison = cls.parse_poison(environ.get(POISON_ENV, ""))
        if environ.get(KILL_PLAN_ENV):
            kill = cls.from_plan(environ[KILL_PLAN_ENV], int(environ.get(RESTART_COUNT_ENV, "0")))
        elif environ.get(KILL_RANK_ENV) is not None:
            kill = cls(kill_rank=int(environ[KILL_RANK_ENV]), kill_iteration=int(environ.get(KILL_ITER_ENV, "0")))
        else:
            kill = None
        if not poison:
            return kill
        return cls(poison, kill.kill_rank, kill.kill_iteration) if kill is not None else cls(poison)

    @staticmethod
    def parse_poison(spec: str) -> frozenset[tuple[int, int]]:
        """``"rank:first-last,..."`` (or ``"rank:step"``) as (rank, step) pairs."""
        out = set()
        for item in filter(None, (x.strip() for x in spec.split(","))):
            rank, steps = item.split(":")
            first, _, last = steps.partition("-")
            out.update((int(rank), s) for s in range(int(first), int(last or first) + 1))
        return frozenset(out)

    @classmethod
    def from_plan(cls, plan: str, restart: int) -> FaultInjector | None:
        """The kill that ``plan`` (``"restart:rank:step,..."``) names for launch attempt ``restart``, else None."""
        for item in plan.split(","):
            attempt, rank, step = (int(x) for x in item.split(":"))
            if attempt == restart:
                return cls(kill_rank=rank, kill_iteration=step)
        return None

    def poison(self, rank: int, step: int, grad: Tensor) -> None:
        """Make ``grad`` (this rank's flat step-``step`` gradient) non-finite if asked to."""
        if (rank, step) in self.poison_grads:
            grad[0] = float("inf")

    def before_forward(self, rank: int, step: int) -> None:
        """End this process, as a crash would, if it is the rank chosen to die at this step."""
        if self.kill_rank == rank and step >= self.kill_iteration:
            print(f"error: rank {rank}: fault injection (kill rank {rank} at iteration {self.kill_iteration}): "
                  f"exiting at iteration {step}", file=sys.stderr, flush=True)
            os._exit(1)


# "kill:N" / "fail:N": the torch_dist save of iteration N, after its files are written and before it
# is published, ends the process (os._exit(1), as a crash) or fails with ENOSPC (as a full disk)
SAVE_FAULT_ENV = "MEGATRON_2BW_FAULT_SAVE"


def before_publish(iteration: int, environ: Mapping[str, str] = os.environ) -> None:
    """The save fault ``$MEGATRON_2BW_FAULT_SAVE`` names for ``iteration``, if any (tests)."""
    spec = environ.get(SAVE_FAULT_ENV)
    if not spec:
        return
    what, _, it = spec.partition(":")
    if int(it) != iteration:
        return
    if what == "kill":
        print(f"fault injection: killing this process during the save of iteration {iteration}", file=sys.stderr,
              flush=True)
        os._exit(1)
    if what == "fail":
        import errno  # noqa: PLC0415

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
