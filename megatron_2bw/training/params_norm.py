"""``--log-params-norm``: the weights' global L2 norm in the training line, as Megatron prints it.

Each rank adds the squared norm of its newest weights (data-parallel rank 0 only; parameters that
the tensor group replicates counted on tensor rank 0, the tied embedding once: the gradient norm's
rule, ``RankWeights.counted``) to the step's asynchronous all-reduce (``step_stats``), so the sum is
the whole model's. Computed only at log steps: one read of the stage's weights, no extra collective.
"""

from __future__ import annotations

import torch


def params_sumsq(stage) -> float:
    """This rank's share of the squared L2 norm of the newest weights ``W(stage.step)`` (fp32 sums)."""
    w = stage.weights
    slot = w.slot(stage.step)
    stage.reducer.wait_slot(slot)  # the distributed optimizer's all-gather of the newest weights
    if stage.state.dp_rank != 0:  # replicas hold the same weights: one of them counts
        return 0.0
    views = [v for v, c in zip(w._views(w.flat[slot]), w.counted) if c]  # noqa: SLF001
    if not views:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(v, dtype=torch.float32) for v in views])  # one per parameter
    return float(norms.double().pow(2).sum())


def with_params_norm(line: str, norm: float | None) -> str:
    """Megatron's `` params norm: {:.3f} |`` field, placed where Megatron puts it (before the skipped count)."""
    if norm is None:
        return line
    return line.replace(" number of skipped iterations:",
                        f" params norm: {norm:.3f} | number of skipped iterations:", 1)
