"""End to end through torchrun on CPU (4 gloo processes): GPT and BERT, 2BW and Flush, layouts
(d, w) = (2, 2) and (t, d) = (2, 2). Each run trains 30 steps of a tiny model on the embedded
corpus; the loss must fall and the metrics file must parse and carry every documented key."""

from __future__ import annotations

import math
import os
import re

import pytest
from e2e import REPO, bert_flush_run, corpus, gpt_2bw_run, read_metrics, torchrun, train_args  # noqa: F401

from megatron_2bw.training.log_format import parse_bubble
from megatron_2bw.training.loop import next_boundary

DOC = os.path.join(REPO, "docs", "training.md")


def documented_keys() -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(line type -> keys) from the metrics table of docs/training.md, the per-stage keys, and the
    keys documented as "BERT only" (required in BERT runs, absent from GPT runs)."""
    text = open(DOC, encoding="utf-8").read()
    section = text.split("## Metrics file", 1)[1].split("## Checkpoints", 1)[0]
    per_type: dict[str, set[str]] = {}
    stage_keys: set[str] = set()
    bert_only: set[str] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            types = [t.strip() for t in cells[1].split(",")]
            if cells[2].startswith("BERT only"):
                bert_only.update(re.findall(r"`([a-z_]+)`", cells[0]))
                continue
            for key in re.findall(r"`([a-z_]+)`", cells[0]):
                for t in types:
                    per_type.setdefault(t, set()).add(key)
        elif len(cells) == 2 and cells[0].startswith("`"):
            stage_keys.update(re.findall(r"`([a-z_]+)`", cells[0]))
    everything = per_type.pop("all")
    for keys in per_type.values():
        keys |= everything
    return per_type, stage_keys, bert_only


CASES = {
    # name: (script, preset, t, d, schedule, *more flags) or a shared session run
    "gpt-2bw-d2w2": "gpt_2bw_run",
    "gpt-flush-t2d2": ("pretrain_gpt.py", "gpt-tiny", 2, 2, "flush"),
    # a split backward from the command line, with speculative updates checked in the next step's warm-up
    "gpt-zbh2-t2d2": ("pretrain_gpt.py", "gpt-tiny", 2, 2, "zb-h2", "--enable-optimizer-post-validation"),
    "bert-2bw-t2d2": ("pretrain_bert.py", "bert-tiny", 2, 2, "2bw"),
    "bert-flush-d2w2": "bert_flush_run",
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_end_to_end(case, request, corpus, tmp_path):  # noqa: F811
    spec = CASES[case]
    if isinstance(spec, str):
        run = request.getfixturevalue(spec)
        res, records = run.result, run.metrics
        t, d = int(run.args[run.args.index("--tensor-model-parallel-size") + 1]), 2
        save = run.save
    else:
        script, preset, t, d, schedule, *extra = spec
        metrics = str(tmp_path / "metrics.jsonl")
        res = torchrun(script, [*train_args(corpus, preset=preset, t=t, d=d, schedule=schedule),
                                "--metrics-file", metrics, *extra])
        assert res.returncode == 0, res.describe()
        records, save = read_metrics(metrics), None
    w = 4 // (t * d)
    assert "Traceback" not in res.output, res.describe()
    assert re.search(rf"parameters \| layout t={t} d={d} w={w} \(4 processes", res.stderr), res.describe()
    assert "fused kernels:" in res.stderr and res.stderr.count(" iteration ") >= 3

    per_type, stage_keys, bert_only = documented_keys()
    bert = case.startswith("bert")
    by_type: dict[str, list[dict]] = {}
    for r in records:
        by_type.setdefault(r["type"], []).append(r)
    assert set(by_type) == ({"start", "train", "eval", "stages", "checkpoint", "end"}
                            - (set() if save else {"checkpoint"}))
    for typ, rows in by_type.items():
        for r in rows:
            missing = per_type[typ] - set(r)
            assert not missing, f"{typ} line lacks documented keys {missing}: {r}"
            if typ in ("train", "eval"):  # BERT's masked-LM and sentence-order parts of the loss
                assert (bert_only <= set(r)) if bert else not (bert_only & set(r)), r
                if bert and r["loss"] is not None:
                    assert r["lm_loss"] + r["sop_loss"] == pytest.approx(r["loss"], rel=1e-6)
    for r in by_type["stages"] + by_type["start"]:
        assert len(r["stages"]) == d and all(stage_keys <= set(s) for s in r["stages"])
    for r in by_type["stages"]:  # each stage's idle fraction over the log window
        assert len(r["bubble"]) == d and all(0.0 <= x <= 1.0 for x in r["bubble"]), r
    lines = [ln for ln in res.stderr.splitlines() if "TFLOP/s/device" in ln]
    assert lines and all(len(parse_bubble(ln) or ()) == d for ln in lines), lines[:2]
    start = by_type["start"][0]
    assert start["layout"] == {"t": t, "d": d, "w": w, "c": 1} and start["num_microbatches"] == 8 // (2 * w)

    end = by_type["end"][0]
    if "--enable-optimizer-post-validation" in spec:  # speculated where the previous step did not clip; some did
        assert 0 <= end["rolled_back_updates"] <= end["speculative_updates"] and end["speculative_updates"] > 0, end
    else:
        assert end["speculative_updates"] is None and end["rolled_back_updates"] is None
    train = by_type["train"]
    assert [r["iteration"] for r in train] == list(range(30))
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["samples_per_sec"] > 0 for r in train)
    assert all(r["tokens_per_sec"] == pytest.approx(16 * r["samples_per_sec"]) for r in train)
    first = sum(r["loss"] for r in train[:5]) / 5
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 0.3, f"loss did not fall: {first:.3f} -> {last:.3f}"
    evals = by_type["eval"]
    assert {e["split"] for e in evals} == {"valid", "test"}
    assert [e["iteration"] for e in evals if e["split"] == "valid"] == [9, 19, 29]
    assert evals[-2]["loss"] < evals[0]["loss"] + 0.5  # validation roughly follows
    for e in evals:  # a perplexity of the token-level LM loss only (BERT: not of MLM + sentence order)
        assert e["ppl"] == pytest.approx(math.exp(e["lm_loss"] if bert else e["loss"]), rel=1e-12)
    if save:
        names = {f"mp_rank_{tp:02d}_{pp:03d}" for tp in range(t) for pp in range(d)}
        for it in (10, 20, 30):
            assert set(os.listdir(os.path.join(save, f"iter_{it:07d}"))) - {"manifest.json"} == names
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "30"


def test_segments_stop_only_at_boundaries():
    # log 10, eval 25, save 15, no exit: segments 0-10-15-20-25-30-...
    ends, step = [], 0
    while step < 50:
        step = next_boundary(step, 50, [10, 25, 15, None])
        ends.append(step)
    assert ends == [10, 15, 20, 25, 30, 40, 45, 50]
    assert next_boundary(7, 9, [100, None]) == 9


def test_metrics_writer_in_process(tmp_path, caplog):
    """Strict JSON (non-finite -> null), the progress bar, TensorBoard events, the framed validation line."""
    import json

    from megatron_2bw.training.metrics import Metrics

    path = tmp_path / "m.jsonl"
    with caplog.at_level("INFO", logger="megatron_2bw"):
        m = Metrics(path=str(path), tensorboard_dir=str(tmp_path / "tb"), train_iters=4, start_iter=1, progress=True)
        m.train_step({"iteration": 1, "loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf"), "loss_scale": 1.0,
                      "samples_per_sec": 1.0, "tokens_per_sec": 16.0, "tflops_per_device": 0.0})
        m.progress(1, 2.5)
        m.eval(1, "valid", 2.0, 8)
        m.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # json.loads accepts no NaN/Infinity here
    assert rows[0]["loss"] is None and rows[0]["grad_norm"] is None and "NaN" not in path.read_text()
    assert rows[1]["split"] == "valid" and rows[1]["ppl"] == pytest.approx(math.exp(2.0))
    assert rows[1]["iteration"] == 0  # the JSONL keeps the 0-based step index; the log line says iteration 1
    assert " validation loss at iteration 1 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | " in caplog.text
    assert os.listdir(tmp_path / "tb")


def test_metrics_writer_bert_components(tmp_path, caplog):
    """BERT's eval record and validation line: MLM and SOP values, PPL of the MLM loss only."""
    import json

    from megatron_2bw.pipeline.executor import StepResult
    from megatron_2bw.training.metrics import Metrics, step_record

    path = tmp_path / "m.jsonl"
    lm, sop = 2.5, 0.625
    with caplog.at_level("INFO", logger="megatron_2bw"):
        m = Metrics(path=str(path), tensorboard_dir=None, train_iters=4, start_iter=0, progress=False)
        m.train_step(step_record(StepResult(0, lm + sop, 1.0, False, 1.0, 1e-3), lm + sop, step_time_s=0.5,
                                 global_batch=8, seq_length=16, tflops=0.0, consumed_samples=8,
                                 components={"lm_loss": lm, "sop_loss": sop}))
        m.eval(1, "valid", lm + sop, 8, components={"lm_loss": lm, "sop_loss": sop})
        m.close()
    train, ev = [json.loads(line) for line in path.read_text().splitlines()]
    assert (train["loss"], train["lm_loss"], train["sop_loss"]) == (lm + sop, lm, sop)
    assert (ev["loss"], ev["lm_loss"], ev["sop_loss"]) == (lm + sop, lm, sop)
    assert ev["ppl"] == pytest.approx(math.exp(lm))
    assert (f" validation loss at iteration 1 | lm loss value: {lm:.6E} | lm loss PPL: {math.exp(lm):.6E} | "
            f"sop loss value: {sop:.6E} | ") in caplog.text
