"""Which parts of a stage are re-run in backward: Megatron's ``--recompute-*`` flags (no torch here).

Two kinds of recomputation exist. This project's *stage* recompute (``--recompute-activations``,
old spelling ``--checkpoint-activations``) keeps only what a stage received and re-runs the whole
stage, embedding and head included (``pipeline/executor.py``). Megatron's finer options act inside
a stage (``RecomputePolicy``; the model applies them, ``models/transformer.py``):

- ``--recompute-granularity full --recompute-method uniform --recompute-num-layers N``: the stage's
  transformer layers are cut into chunks of N; each chunk keeps only its input and is re-run.
- ``... --recompute-method block --recompute-num-layers N``: each of the stage's first N layers
  keeps only its input and is re-run; the other layers keep everything.
- ``--recompute-granularity selective``: only each layer's attention core (QK^T, softmax, dropout,
  times V) is re-run: it holds the ``s^2`` activations yet costs few FLOPs.

The planner (torch-free) prices the same policies, so this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def check_recompute(stage: bool, granularity: str | None, method: str | None, num_layers: int | None) -> None:
    """Refuse an invalid combination of the recompute flags with a one-line ``ConfigError``."""
    g, meth, n = granularity, method, num_layers
    problems = [
        (g not in (None, *GRANULARITIES), f"--recompute-granularity must be full or selective, got {g!r}"),
        (bool(g) and stage, "use either --recompute-activations (whole stages) or --recompute-granularity"),
        (meth not in (None, *METHODS), f"--recompute-method must be uniform or block, got {meth!r}"),
        (meth is not None and g != "full", f"--recompute-method {meth} needs --recompute-granularity full"),
        (g == "full" and (meth is None or n is None),
         "--recompute-granularity full needs --recompute-method (uniform or block) and --recompute-num-layers"),
        (n is not None and meth is None, "--recompute-num-layers needs --recompute-method"),
        (n is not None and n < 1, f"--recompute-num-layers must be >= 1, got {n}"),
    ]
    for bad, msg in problems:
        if bad:
            raise ConfigError(msg)


@dataclass(frozen=True)
class RecomputePolicy:
    """What a stage re-runs inside itself (see the module docstring); refused when invalid."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        check_recompute(False, self.granularity, self.method, self.num_layers)

    @classmethod
    def from_pipeline(cls, pipe: object) -> RecomputePolicy | None:
        """The policy of a ``PipelineConfig``'s ``recompute_*`` fields (None: nothing inside stages)."""
        g = getattr(pipe, "recompute_granularity", None)
        return cls(g, pipe.recompute_method, pipe.recompute_num_layers) if g else None

    @property
    def active(self) -> bool:
        return self.granularity is not None

    @property
    def label(self) -> str:
        """Short name for reports: ``selective``, ``uniform2``, ``block3``; empty when inactive."""
        if self.granularity == "full":
            return f"{self.method}{self.num_layers}"
        return self.granularity or ""

    def segments(self, n: int) -> list[tuple[int, int, bool]]:
        """``(first, count, recomputed)`` runs over a stage's ``n`` transformer layers (full only)."""
        if self.granularity != "full":
            return [(0, n, False)] if n else []
        k = int(self.num_layers or 1)
        if self.method == "block":
            done = min(k, n)
            return [(i, 1, True) for i in range(done)] + ([(done, n - done, False)] if n > done else [])
        return [(i, min(k, n - i), True) for i in range(0, n, k)]
