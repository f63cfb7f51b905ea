"""The systems the throughput benchmark compares (our registry's schedules and torch's), their ideal
bubbles, the stage splits and the order a round runs them in (each of ours beside torch's counterpart)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package beside benchmarks/
from megatron_2bw.schedule.schedules import PLANNED_SCHEDULES, SCHEDULES, spec_of  # noqa: E402  (pure data: no torch.distributed)

# every schedule of our registry, and the ids the planner prices (``zb-h2+pv``: with post-validation): a new
# entry is measured with no change here
OURS = PLANNED_SCHEDULES
# torch's systems: (torch.distributed.pipelining class, our registry's counterpart, model chunks per rank,
# stage-to-rank style); adding one is one line here
TORCH: dict[str, tuple[str, str, int, str]] = {
    "torch_1f1b": ("Schedule1F1B", "flush", 1, "loop"),
    "torch_gpipe": ("ScheduleGPipe", "gpipe", 1, "loop"),
    "torch_interleaved_1f1b": ("ScheduleInterleaved1F1B", "interleaved-1f1b", 2, "loop"),
    "torch_interleaved_zb": ("ScheduleInterleavedZeroBubble", "zb-h1", 2, "loop"),
    "torch_zbv": ("ScheduleZBVZeroBubble", "zb-v", 2, "v"),
    "torch_dualpipe_v": ("ScheduleDualPipeV", "dualpipe-v", 2, "v"),
}
COUNTERPART = {ours: t for t, (_, ours, _, _) in TORCH.items()}  # our schedule -> torch's
SYSTEMS = ("single", "engine_d1", *OURS, *TORCH)
SPLITS = ("uniform", "balanced")
# Named models (ModelConfig fields); ``custom`` is the --layers/--hidden/... flags.
MODELS = {
    "gpt-4x256": dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1000),
    "head-heavy": dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=32000),
}
LR = 1e-4
CLIP = 1.0  # the default of --clip, Megatron's
WD = 0.01


def _fallback_bubble(system: str, d: int, m: int) -> float:
    """Ideal bubble of a torch schedule whose counterpart is not in our registry (yet): equal-cost
    stages, free transfers, forward = input-gradient = weight-gradient time, v = 2 chunks per rank.
    Interleaved 1F1B (Narayanan et al. 2021): a fill and drain of (d - 1) chunk slots, (d-1)/(v m + d-1);
    interleaved ZB-H1 (Qi et al. 2024): each of those slots keeps only F + I - W = 1/3 of it idle;
    ZB-V and DualPipe-V: none at these costs (DualPipe-V's (d/2 - 1) overlapped slots vanish at d = 2)."""
    v = TORCH[system][2]
    if system == "torch_interleaved_1f1b":
        return (d - 1) / (v * m + d - 1)
    if system == "torch_interleaved_zb":
        return (d - 1) / (3 * v * m + d - 1)
    if system in ("torch_zbv", "torch_dualpipe_v"):
        return 0.0 if system == "torch_zbv" or d <= 2 else (d / 2 - 1) * 2 / (3 * v * m + (d / 2 - 1) * 2)
    return (d - 1) / (m + d - 1)


def ideal_bubble(system: str, d: int, m: int) -> float:
    """The schedule's idle fraction per step with balanced stages and free transfers: our registry's
    ``ScheduleSpec.bubble`` (torch's systems: their counterpart's, when it is registered with as many
    chunks per rank; torch's interleaved zero bubble has two, our zb-h1 one)."""
    if system in ("single", "engine_d1"):
        return 0.0
    if system in OURS:
        return spec_of(system).bubble(d, m)
    twin = SCHEDULES.get(TORCH[system][1])
    if twin is not None and getattr(twin, "chunks", 1) == TORCH[system][2]:  # the same layout as ours
        return twin.bubble(d, m)
    return _fallback_bubble(system, d, m)


def ideal_vs_single(system: str, d: int, m: int) -> float:
    """Bubble-limited speedup over one process: d stages busy a (1 - bubble) share of the time."""
    return 1.0 if system in ("single", "engine_d1") else d * (1.0 - ideal_bubble(system, d, m))


def splits_of(system: str, splits) -> list[str]:
    """The stage splits a system runs: ours with one chunk per rank every split, the rest the uniform one."""
    return list(splits) if system in OURS and spec_of(system).chunks == 1 else ["uniform"]


def paired_order(systems) -> list[str]:
    """The order a round runs ``systems`` in: each of our schedules straight before torch's counterpart, so a
    pair's ratio is taken over the same few seconds of the machine's drifting speed; the rest keep theirs."""
    out: list[str] = []
    for s in systems:
        twin = COUNTERPART.get(s)
        if s in out:
            continue
        out.append(s)
        if twin in systems and twin not in out:
            out.append(twin)
    return out


def round_order(entries, rnd: int) -> list:
    """Round ``rnd``'s (system, split) order: in odd rounds each pair of :func:`paired_order` swapped (torch's
    first), so a drift within a round favours neither side."""
    out = list(entries)
    if rnd % 2:
        i = 0
        while i + 1 < len(out):
            if COUNTERPART.get(out[i][0]) == out[i + 1][0]:
                out[i], out[i + 1] = out[i + 1], out[i]
                i += 2
            else:
                i += 1
    return out
