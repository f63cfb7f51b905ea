"""Our log lines read back with the regular expressions a Megatron-LM log parser uses."""

from __future__ import annotations

import math
import re
from datetime import datetime

import pytest

from megatron_2bw.training.log_format import (
    CudaMemory,
    MemoryReading,
    eta_line,
    framed,
    iteration_of_step,
    memory_from_stages,
    memory_report_line,
    peak_tflops_of,
    saved_checkpoint_line,
    train_log_line,
    validation_line,
    window_line,
)

NUM = r"([-+]?[\d.]+(?:E[-+]\d+)?)"
# One pattern per field, as a Megatron log parser writes them (fields are " name: value |").
MEGATRON = {
    "timestamp": r"^ \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration",
    "iteration": r"iteration\s+(\d+)/\s*(\d+)",
    "consumed": r"consumed samples:\s+(\d+)",
    "ms": r"elapsed time per iteration \(ms\):\s+" + NUM,
    "lr": r"learning rate:\s+" + NUM,
    "gbs": r"global batch size:\s+(\d+)",
    "lm": r"lm loss:\s+" + NUM,
    "sop": r"sop loss:\s+" + NUM,
    "scale": r"loss scale:\s+" + NUM,
    "gnorm": r"grad norm:\s+" + NUM,
    "skipped": r"number of skipped iterations:\s+(\d+)",
    "nan": r"number of nan iterations:\s+(\d+)",
    "sps": r"samples/s:\s+" + NUM,
    "tps": r"tokens/s:\s+" + NUM,
    "mem_cuda": r"max allocated \(MB\):\s+" + NUM,
    "mem_engine": r"engine memory \(MB\):\s+" + NUM,
    "tflops": r"TFLOP/s/device:\s+" + NUM,
    "mfu": r"MFU:\s+" + NUM + "%",
}
VALID = {
    "at": r"validation loss at iteration (\d+)( on (?:validation|test) set)? \|",
    "lm": r"lm loss value:\s+" + NUM,
    "lm_ppl": r"lm loss PPL:\s+" + NUM,
    "sop": r"sop loss value:\s+" + NUM,
    "sop_ppl": r"sop loss PPL:\s+" + NUM,
}


def grab(pattern: str, line: str):
    m = re.search(pattern, line)
    return None if m is None else (m.groups() if len(m.groups()) > 1 else m.group(1))


def line_for(**over):
    args = dict(iteration=10, train_iters=150, consumed_samples=160, ms_per_iter=487.04, lr=2.0e-4, global_batch=16,
                losses={"lm loss": 6.4861473}, loss_scale=65536.0, grad_norm=0.5391, skipped=2, nan=1,
                samples_per_sec=32.8514, tokens_per_sec=2102.49, memory=MemoryReading(123_456_789, "engine"),
                tflops_per_device=0.01234, peak_tflops=None, now=datetime(2026, 11, 30, 12, 0, 7))
    args.update(over)
    return args, train_log_line(**args)


def test_every_megatron_field_parses_back_to_the_input():
    a, line = line_for()
    assert datetime.strptime(grab(MEGATRON["timestamp"], line), "%Y-%m-%d %H:%M:%S") == a["now"]
    assert tuple(map(int, grab(MEGATRON["iteration"], line))) == (a["iteration"], a["train_iters"])
    assert int(grab(MEGATRON["consumed"], line)) == a["consumed_samples"]
    assert float(grab(MEGATRON["ms"], line)) == pytest.approx(a["ms_per_iter"], abs=0.05)
    assert float(grab(MEGATRON["lr"], line)) == pytest.approx(a["lr"], rel=1e-6)
    assert int(grab(MEGATRON["gbs"], line)) == a["global_batch"]
    assert float(grab(MEGATRON["lm"], line)) == pytest.approx(a["losses"]["lm loss"], rel=1e-6)
    assert float(grab(MEGATRON["scale"], line)) == a["loss_scale"]
    assert float(grab(MEGATRON["gnorm"], line)) == pytest.approx(a["grad_norm"], abs=5e-4)
    assert int(grab(MEGATRON["skipped"], line)) == a["skipped"]
    assert int(grab(MEGATRON["nan"], line)) == a["nan"]
    assert grab(MEGATRON["sop"], line) is None  # GPT: no sentence-order loss


def test_field_order_and_widths_are_megatrons():
    _, line = line_for(iteration=7, train_iters=123456, consumed_samples=112, skipped=0, nan=0)
    # Megatron: "{:8d}/{:8d}", "{:12d}", "{:5d}", "{:3d}", each field closed by " |".
    assert line.startswith(" [2026-11-30 12:00:07] iteration        7/  123456 | consumed samples:          112 |")
    assert " global batch size:    16 |" in line
    assert " number of skipped iterations:   0 | number of nan iterations:   0 |" in line
    names = ["iteration", "consumed samples", "elapsed time per iteration", "learning rate", "global batch size",
             "lm loss", "loss scale", "grad norm", "number of skipped", "number of nan", "samples/s", "tokens/s"]
    positions = [line.index(n) for n in names]
    assert positions == sorted(positions)


def test_our_fields_after_megatrons_parse_back():
    a, line = line_for(peak_tflops=0.5)
    assert float(grab(MEGATRON["sps"], line)) == pytest.approx(a["samples_per_sec"], abs=0.005)
    assert float(grab(MEGATRON["tps"], line)) == pytest.approx(a["tokens_per_sec"], abs=0.5)
    assert float(grab(MEGATRON["mem_engine"], line)) == pytest.approx(123_456_789 / 2**20, abs=0.05)
    assert float(grab(MEGATRON["tflops"], line)) == pytest.approx(a["tflops_per_device"], abs=5e-5)
    assert float(grab(MEGATRON["mfu"], line)) == pytest.approx(100 * 0.01234 / 0.5, abs=0.005)
    assert line.index("number of nan iterations") < line.index("samples/s")
    _, no_peak = line_for(peak_tflops=None)
    assert grab(MEGATRON["mfu"], no_peak) is None


def test_bert_losses_are_separate_fields():
    a, line = line_for(losses={"lm loss": 7.25, "sop loss": 0.6931})
    assert float(grab(MEGATRON["lm"], line)) == pytest.approx(7.25, rel=1e-6)
    assert float(grab(MEGATRON["sop"], line)) == pytest.approx(0.6931, rel=1e-6)


def test_a_window_without_a_finite_loss_prints_no_loss_and_counts_nans():
    _, line = line_for(losses={"lm loss": float("nan")}, nan=10, grad_norm=float("inf"))
    assert grab(MEGATRON["lm"], line) is None and grab(MEGATRON["gnorm"], line) is None
    assert int(grab(MEGATRON["nan"], line)) == 10


def test_memory_reading_from_stage_statistics():
    engine = [{"stage": 0, "weight_bytes": 100, "grad_bytes": 50, "optimizer_bytes": 200, "peak_stashed_bytes": 7,
               "cuda_peak_bytes": None},
              {"stage": 1, "weight_bytes": 300, "grad_bytes": 150, "optimizer_bytes": 600, "peak_stashed_bytes": 1,
               "cuda_peak_bytes": None}]
    assert memory_from_stages(engine) == MemoryReading(300 + 150 + 600 + 1, "engine")
    cuda = [dict(engine[0], cuda_peak_bytes=5 * 2**20), dict(engine[1], cuda_peak_bytes=9 * 2**20)]
    reading = memory_from_stages(cuda)
    assert reading == MemoryReading(9 * 2**20, "cuda")
    _, line = line_for(memory=reading)
    assert float(grab(MEGATRON["mem_cuda"], line)) == 9.0
    assert memory_from_stages([]) is None


def test_validation_line_is_megatrons_and_ppl_is_of_the_mlm_loss_only():
    line = validation_line(10, {"lm loss": 6.753573, "sop loss": 0.55})
    assert line.startswith(" validation loss at iteration 10 | lm loss value: 6.753573E+00 | lm loss PPL: ")
    assert grab(VALID["at"], line) == ("10", None)
    assert float(grab(VALID["lm"], line)) == pytest.approx(6.753573, rel=1e-6)
    assert float(grab(VALID["lm_ppl"], line)) == pytest.approx(math.exp(6.753573), rel=1e-6)
    assert float(grab(VALID["sop"], line)) == pytest.approx(0.55, rel=1e-6)
    assert grab(VALID["sop_ppl"], line) is None
    # Megatron caps the exponent at 20.
    assert float(grab(VALID["lm_ppl"], validation_line(3, {"lm loss": 50.0}))) == pytest.approx(math.exp(20), rel=1e-6)
    assert grab(VALID["at"], validation_line(150, {"lm loss": 1.0}, final=True))[1] == " on validation set"
    assert grab(VALID["at"], validation_line(150, {"lm loss": 1.0}, split="test"))[1] == " on test set"
    rules = framed(line).split("\n")
    assert rules[1] == line and rules[0] == rules[2] == "-" * (len(line) + 1)


def test_one_numbering_everywhere():
    # The engine's 0-based step 9 is the 10th completed step: iteration 10 in every line.
    n = iteration_of_step(9)
    _, train = line_for(iteration=n)
    valid = validation_line(n, {"lm loss": 2.0})
    ckpt = saved_checkpoint_line(n, "runs/x/iter_0000010", 0.5)
    assert int(grab(MEGATRON["iteration"], train)[0]) == 10
    assert int(grab(VALID["at"], valid)[0]) == 10
    assert int(grab(r"saved checkpoint from iteration\s+(\d+)", ckpt)) == 10
    with pytest.raises(ValueError):
        iteration_of_step(-1)


def test_eta_line_numbers():
    line = eta_line(iteration=30, train_iters=150, start_iteration=10, elapsed_s=8.0)  # 20 steps in 8 s
    assert re.search(r"iteration\s+(\d+)/\s*(\d+)", line) is None  # Megatron parsers' iteration regex
    m = re.fullmatch(r" \[ETA\] (\d+) of (\d+) iterations done \| elapsed (\d+):(\d\d):(\d\d) \| "
                     r"remaining (\d+):(\d\d):(\d\d) \| ([\d.]+) it/s", line)
    assert m is not None, line
    g = [float(x) for x in m.groups()]
    assert g[:2] == [30, 150]
    assert g[2] * 3600 + g[3] * 60 + g[4] == 8
    assert g[5] * 3600 + g[6] * 60 + g[7] == round(120 / (20 / 8.0))  # 120 steps left at 2.5 it/s
    assert g[8] == 2.5
    assert "remaining ?:??:??" in eta_line(10, 150, 10, 0.0)


def test_memory_report_line():
    cuda = CudaMemory(allocated=3 * 2**20, max_allocated=5 * 2**20, reserved=8 * 2**20, max_reserved=10 * 2**20)
    line = memory_report_line(0, 10, cuda)
    pat = (r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
           r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")
    assert [float(x) for x in re.fullmatch(pat, line).groups()] == [0, 10, 3, 5, 8, 10]
    stages = [{"stage": 0, "weight_bytes": 2**20, "grad_bytes": 2**21, "optimizer_bytes": 2**22,
               "peak_stashed_bytes": 2**19}]
    cpu = memory_report_line(0, 1, None, stages)
    assert [float(x) for x in re.findall(r"(?:weights|grads|optimizer|peak stashed): ([\d.]+)", cpu)] == [1, 2, 4, 0.5]


def test_peak_of_a_known_gpu_comes_from_the_cluster_presets():
    import json
    from pathlib import Path

    import megatron_2bw.planner as planner

    data = json.loads((Path(planner.__file__).parent / "clusters" / "dgx-h200.json").read_text())
    assert peak_tflops_of("NVIDIA H200", "bf16") == pytest.approx(float(data["peak_TFLOPs"]["bf16"]))
    assert peak_tflops_of("Some CPU", "bf16") is None


def window_records():
    """Four steps of the loop's records: step 2 skipped by the optimizer, step 3 with a NaN loss."""
    base = dict(lr=1e-3, grad_norm=0.75, loss_scale=1.0, skipped=False, tflops_per_device=0.02)
    rows = [dict(base, loss=7.0, step_time_s=0.5, consumed_samples=16 * 7),
            dict(base, loss=6.5, step_time_s=0.7, consumed_samples=16 * 8, skipped=True),
            dict(base, loss=float("nan"), step_time_s=0.6, consumed_samples=16 * 9, skipped=True),
            dict(base, loss=6.25, step_time_s=0.4, consumed_samples=16 * 10, lr=9e-4, grad_norm=0.5)]
    return rows


def test_window_line_follows_megatrons_accounting():
    rows = window_records()
    line = window_line(rows, completed=10, train_iters=100, global_batch=16, seq_length=64,
                       stages=[{"stage": 0, "weight_bytes": 2**20, "grad_bytes": 0, "optimizer_bytes": 0,
                                "peak_stashed_bytes": 0, "cuda_peak_bytes": None}])
    mean_time = (0.5 + 0.7 + 0.6 + 0.4) / 4
    assert tuple(map(int, grab(MEGATRON["iteration"], line))) == (10, 100)
    assert int(grab(MEGATRON["consumed"], line)) == 160
    assert float(grab(MEGATRON["lm"], line)) == pytest.approx((7.0 + 6.25) / 2, rel=1e-6)  # skipped steps left out
    assert int(grab(MEGATRON["skipped"], line)) == 2 and int(grab(MEGATRON["nan"], line)) == 1
    assert float(grab(MEGATRON["ms"], line)) == pytest.approx(1e3 * mean_time, abs=0.05)
    assert float(grab(MEGATRON["sps"], line)) == pytest.approx(16 / mean_time, abs=0.005)
    assert float(grab(MEGATRON["tps"], line)) == pytest.approx(16 * 64 / mean_time, abs=0.5)
    assert float(grab(MEGATRON["lr"], line)) == pytest.approx(9e-4, rel=1e-6)
    assert float(grab(MEGATRON["gnorm"], line)) == 0.5
    assert float(grab(MEGATRON["mem_engine"], line)) == 1.0


def test_window_line_loss_digits_match_the_plain_mean_without_skips():
    # fp32 runs skip nothing: the printed loss is the plain mean of the window, digit for digit.
    losses = [8.817234, 8.51, 8.0012345, 7.9]
    rows = [dict(loss=x, lr=1e-3, grad_norm=1.0, loss_scale=1.0, skipped=False, step_time_s=0.1,
                 consumed_samples=4 * (i + 1), tflops_per_device=0.0) for i, x in enumerate(losses)]
    line = window_line(rows, completed=4, train_iters=4, global_batch=4, seq_length=8)
    assert f" lm loss: {sum(losses) / len(losses):.6E} |" in line


def test_window_line_bert_losses():
    rows = [dict(lm_loss=5.0 + i, sop_loss=0.7 - 0.1 * i, lr=1e-4, grad_norm=1.0, loss_scale=1.0, skipped=False,
                 step_time_s=1.0, consumed_samples=8 * (i + 1), tflops_per_device=None) for i in range(3)]
    line = window_line(rows, completed=3, train_iters=9, global_batch=8, seq_length=32,
                       loss_keys={"lm loss": "lm_loss", "sop loss": "sop_loss"})
    assert float(grab(MEGATRON["lm"], line)) == pytest.approx(6.0, rel=1e-6)
    assert float(grab(MEGATRON["sop"], line)) == pytest.approx(0.6, rel=1e-6)
    assert grab(MEGATRON["tflops"], line) is None
    with pytest.raises(ValueError):
        window_line([], completed=1, train_iters=1, global_batch=1, seq_length=1)


# ---- model FLOPs (review S3) and the window's TFLOP/s and MFU (issue 19 item 5) ---------------------
def _matmul_flops(L: int, h: int, s: int, V: int, B: int, recompute: bool) -> float:
    """Every matrix multiply of a GPT step, counted one by one: per token and layer, the QKV
    projection 2*h*3h, the scores 2*s*h, scores x values 2*s*h, the output projection 2*h*h and the
    MLP 2*h*4h + 2*4h*h; the logits 2*h*V per token. Backward is twice the forward; full
    recomputation runs the layers' forward once more (not the logits')."""
    layer = 2 * h * 3 * h + 2 * s * h + 2 * s * h + 2 * h * h + 2 * h * 4 * h + 2 * 4 * h * h
    passes = 4 if recompute else 3
    return B * s * (passes * L * layer + 3 * 2 * h * V)


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("preset", ["gpt-demo", "gpt-1.3b"])
def test_flops_are_megatrons_closed_form_with_the_padded_vocabulary(preset, recompute, t):
    from megatron_2bw.config.arith import flops_per_step, tflops_per_device
    from megatron_2bw.config.presets import get_preset

    cfg = get_preset(preset)
    L, h, s, B = cfg.num_layers, cfg.hidden_size, cfg.seq_length, 512
    V = -(-cfg.vocab_size // (128 * t)) * 128 * t  # Megatron pads to a multiple of 128 x t
    assert V > cfg.vocab_size or cfg.vocab_size % (128 * t) == 0
    closed = (96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)) if recompute
              else 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)))
    got = flops_per_step(cfg, B, recompute, t)
    assert got == pytest.approx(closed, rel=1e-12)
    assert got == pytest.approx(_matmul_flops(L, h, s, V, B, recompute), rel=1e-12)
    assert tflops_per_device(cfg, B, 2.0, 8, recompute, t) == pytest.approx(closed / (2.0 * 8 * 1e12), rel=1e-12)


def test_full_recomputation_counts_and_selective_does_not():
    from types import SimpleNamespace as NS

    from megatron_2bw.config.arith import counts_recompute

    assert counts_recompute(NS(recompute=True, recompute_granularity=None))
    assert counts_recompute(NS(recompute=False, recompute_granularity="full"))
    assert not counts_recompute(NS(recompute=False, recompute_granularity="selective"))
    assert not counts_recompute(NS(recompute=False, recompute_granularity=None))


def test_peaks_tell_h100_sxm_from_pcie_and_nvl():
    assert peak_tflops_of("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.0, rel=1e-3)  # SXM
    assert peak_tflops_of("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops_of("NVIDIA H100 NVL", "fp16") == 835.0
    assert peak_tflops_of("NVIDIA H100 NVL", "fp32") == 60.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312.0, rel=1e-3)


def test_window_tflops_and_mfu_are_the_windows_not_the_last_steps():
    """Four steps of one model (the same FLOPs F each) taking 0.5, 0.7, 0.6 and 0.4 s: each record's
    TFLOP/s is F / t; the window's is F / mean(t), Megatron's throughput over a log interval."""
    F = 3.0  # TFLOP per step and device
    rows = [dict(r, tflops_per_device=F / r["step_time_s"]) for r in window_records()]
    line = window_line(rows, completed=10, train_iters=100, global_batch=16, seq_length=64, peak_tflops=50.0)
    mean_time = (0.5 + 0.7 + 0.6 + 0.4) / 4
    window = F / mean_time
    assert float(grab(MEGATRON["tflops"], line)) == pytest.approx(window, abs=5e-5)
    assert window != pytest.approx(rows[-1]["tflops_per_device"], rel=0.05)  # the last step's value is 7.5
    mfu = re.search(r" MFU: ([\d.]+)% \|", line)
    assert mfu and float(mfu.group(1)) == pytest.approx(100 * window / 50.0, abs=0.005)
    assert " MFU:" not in window_line(rows, completed=10, train_iters=100, global_batch=16, seq_length=64)
