"""Tensor and sequence parallelism held to published measurements (docs/planner.md section 7.2; issue 35).

Tolerance: ``calibration.TOLERANCE`` (15%) on each published value; the predictions outside it are the ones
``calibration_tp.KNOWN_MISSES`` names, each checked on the side and within the margin the docs state."""

import pytest

from megatron_2bw.planner.calibration import TOLERANCE
from megatron_2bw.planner.calibration_tp import KNOWN_MISSES, korthikanti, paper_systems, tensor_mp_64


def test_korthikanti_2022_table5():
    """t = 8 inside an A100 server (and pipelines of them), full recomputation and sequence parallelism with
    selective recomputation: every run within 15% but the 35-stage 530B one (15.2% low, its schedule unstated),
    and what sequence parallelism with selective recomputation gains over full recomputation within 5%."""
    rows = {r.run.name: r for r in korthikanti()}
    assert len(rows) == 8
    for name, r in rows.items():
        print(f"{name}: published {r.run.samples_per_sec:.3f}, predicted {r.samples_per_sec:.3f} ({r.ratio:.3f})")
        assert r.fits, name
        if name in KNOWN_MISSES:
            assert 1 - TOLERANCE - 0.02 < r.ratio < 1 - TOLERANCE, name
        else:
            assert abs(r.ratio - 1) <= TOLERANCE, name
    for model in ("22B", "175B", "530B", "1T"):
        full, sp = rows[f"{model} full recompute"], rows[f"{model} SP + selective"]
        published = sp.run.samples_per_sec / full.run.samples_per_sec  # 1.29-1.32: the paper's "29-32% faster"
        predicted = sp.samples_per_sec / full.samples_per_sec
        assert predicted == pytest.approx(published, rel=0.05), model


@pytest.fixture(scope="module")
def systems():
    return {s.system: s for s in paper_systems()}


def test_figure_6a_systems(systems):
    """GPT-2.2B on one 8-V100 server, batch 64, each system's best layout of the paper's search space."""
    for name, s in systems.items():
        print(f"{name}: {s.layout}, published {s.published}, predicted {s.predicted:.1f} ({s.ratio:.2f})")
    for name in ("2bw", "tensor-mp", "inter-layer"):
        assert abs(systems[name].ratio - 1) <= TOLERANCE, name
    assert 0.80 < systems["flush"].ratio < 1 - TOLERANCE  # KNOWN_MISSES["flush"]: 16% low
    assert systems["gpipe"].ratio > 1 + TOLERANCE  # KNOWN_MISSES["gpipe"]: priced as this engine runs it
    assert systems["tensor-mp"].best.candidate.tensor_parallel == 8


def test_figure_6a_ratios_and_ordering(systems):
    """2BW first and inter-layer last, as published; 2BW over tensor MP (the paper's 1.3x on one server) and over
    Flush within 15%; over inter-layer within 20% (KNOWN_MISSES)."""
    two = systems["2bw"]
    for name, tol in (("tensor-mp", TOLERANCE), ("flush", TOLERANCE), ("inter-layer", 0.20)):
        s = systems[name]
        assert two.predicted / s.predicted == pytest.approx(two.published / s.published, rel=tol), name
    assert two.predicted / systems["tensor-mp"].predicted == pytest.approx(1.3, rel=TOLERANCE)
    predicted = sorted(systems, key=lambda n: -systems[n].predicted)
    assert predicted[0] == "2bw" and predicted[-1] == "inter-layer"
    assert "inter-layer over 2bw" in KNOWN_MISSES


def test_tensor_mp_across_servers():
    """GPT-3.8B on 64 V100s: 2BW's lead over tensor MP grows from under 2x (groups of 8 inside servers) to over
    10x once the tensor group spans servers; the paper's largest was 20x (KNOWN_MISSES: 13x predicted)."""
    rows = tensor_mp_64()
    for batch in {r.global_batch_size for r in rows}:
        by_t = {r.tensor_parallel: r.speedup for r in rows if r.global_batch_size == batch}
        print(f"B={batch}: 2BW over tensor MP {by_t}")
        assert by_t[8] < 2.0 < by_t[16] < by_t[32]
        assert 10 < by_t[32] <= 20 * (1 + TOLERANCE)
    assert "tensor MP across servers" in KNOWN_MISSES
