"""Muon's training step on the CPU against AdamW's: the real trainer, one process, ``--preset`` (gpt-demo).

Three runs of ``pretrain_gpt.py`` in this process (Flush, d = 1, mock data with a NullTokenizer of the
preset's vocabulary, one torch thread), each ``--steps`` steps: ``--optimizer adam``, and ``--optimizer muon``
with fp32 and with bf16 Newton-Schulz (torch.optim.Muon's precision, what every CPU ran before issue 45).
The trainer picks bf16 on CPUs with bf16 matrix instructions and fp32 on others (``optimizer/muon.py``'s
``ns_dtype``); ``trainer_picks`` names its choice on this machine, ``muon`` in ``ratio_to_adam`` is that
run. Each run's time per step is the median of the metrics file's ``step_time_s`` without the first step
(warm-up); ``--rounds`` repeats the three runs, in a rotated order each round, and the result of a
configuration is the median over its rounds (each round's ratio is kept too); the ratios are over AdamW's.
Timings on a shared machine are upper bounds: run it on a quiet one (``nice`` keeps it from disturbing
others, not others from disturbing it).

    python benchmarks/muon_cpu_step.py [--steps 6] [--rounds 3] [--json benchmarks/results/muon_cpu_step.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import common
import torch

from megatron_2bw.config.presets import get_preset
from megatron_2bw.optimizer import muon
from megatron_2bw.training.launch import main as train_main

RUNS = (("adam", "adam", None), ("muon_fp32_newton_schulz", "muon", torch.float32),
        ("muon_bf16_newton_schulz", "muon", torch.bfloat16))


def _argv(args: argparse.Namespace, optimizer: str, metrics: str) -> list[str]:
    vocab = get_preset(args.preset).vocab_size
    return ["--model-preset", args.preset, "--micro-batch-size", str(args.micro_batch), "--global-batch-size",
            str(args.global_batch), "--train-iters", str(args.steps), "--lr", "1e-3", "--optimizer", optimizer,
            "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
            "--log-interval", str(args.steps), "--eval-iters", "0", "--metrics-file", metrics]


def _one(args: argparse.Namespace, name: str, optimizer: str, ns: torch.dtype | None, tmp: str) -> dict:
    metrics = os.path.join(tmp, f"{name}.jsonl")
    saved, muon.NS_DTYPE = muon.NS_DTYPE, ns
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = train_main("gpt", _argv(args, optimizer, metrics))
    finally:
        muon.NS_DTYPE = saved
    if rc != 0:
        raise SystemExit(f"error: the {name} run exited {rc}")
    with open(metrics, encoding="utf-8") as f:
        times = [r["step_time_s"] for r in map(json.loads, f) if r.get("type") == "train"]
    ns_dtype = ns if ns is not None else muon.ns_dtype("cpu")
    return {"optimizer": optimizer, "newton_schulz_dtype": str(ns_dtype).replace("torch.", "") if optimizer == "muon"
            else None, "step_s": common.median(times[1:] or times), "step_times_s": times}


def newton_schulz_seconds(preset: str, reps: int = 5) -> dict:
    """Seconds of one 5-step Newton-Schulz of the preset's MLP matrix (ffn x hidden), per dtype: the matmuls
    the choice of dtype is about, without the rest of the step."""
    cfg = get_preset(preset)
    g = torch.randn(cfg.ffn_hidden_size, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        muon.zeropower_via_newtonschulz(g, 5, dtype=dtype)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            muon.zeropower_via_newtonschulz(g, 5, dtype=dtype)
        out[str(dtype).replace("torch.", "")] = (time.perf_counter() - t0) / reps
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-demo")
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed)")
    p.add_argument("--rounds", type=int, default=3, help="repeats of the three runs (rotated order)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is not timed)")
    torch.set_num_threads(1)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]
            rounds.append({name: _one(args, name, opt, ns, tmp) for name, opt, ns in order})
    runs = {name: {**rounds[0][name], "step_s": common.median(rd[name]["step_s"] for rd in rounds),
                   "step_s_per_round": [rd[name]["step_s"] for rd in rounds]} for name, _, _ in RUNS}
    for run in runs.values():
        del run["step_times_s"]
    adam = runs["adam"]["step_s"]
    ratios = {name: r["step_s"] / adam for name, r in runs.items() if name != "adam"}
    per_round = {name: [rd[name]["step_s"] / rd["adam"]["step_s"] for rd in rounds] for name in ratios}
    picks = str(muon.ns_dtype("cpu")).replace("torch.", "")
    ratios["muon"] = ratios[f"muon_{'bf16' if picks == 'bfloat16' else 'fp32'}_newton_schulz"]
    ns = newton_schulz_seconds(args.preset)
    print(f"the trainer's Newton-Schulz on this CPU: {picks}; one of the MLP matrix: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ns.items()))
    for name, r in runs.items():
        print(f"{name:26s} {r['newton_schulz_dtype'] or '-':9s} {r['step_s']:.3f} s/step"
              + (f"  x{ratios[name]:.2f} AdamW" if name in ratios else ""))
    common.write_json(args.json, {"benchmark": "muon_cpu_step", "machine": common.machine_info(),
                                  "settings": vars(args), "runs": runs, "trainer_picks": picks,
                                  "newton_schulz_s": ns, "ratio_to_adam": ratios,
                                  "ratio_to_adam_per_round": per_round})
    return 0


if __name__ == "__main__":
    sys.exit(main())
