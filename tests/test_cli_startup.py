"""Start-up behaviour of the trainer's command line (issues 11 and 14).

Defaults that fit the layout (the schedule by depth, a valid global batch), ``--validate-only``,
``--yaml-cfg`` and the unknown-flag hint through the real entry point, the refusal to resume
with changed data or schedule settings, the ``--save`` directory check, and the data-index
memory bound measured against numpy's real allocations.
"""

from __future__ import annotations

import os
import re
import tracemalloc

import numpy as np
import pytest
import torch
from e2e import PY, REPO, clean_env, corpus, read_metrics, run, train_args  # noqa: F401

from megatron_2bw import cli
from megatron_2bw.argv import megatron_args
from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.cli import build_config, parse_args, schedule_note
from megatron_2bw.errors import ConfigError
from megatron_2bw.schedule.schedules import get_schedule
from megatron_2bw.training.launch import dataset_sizes
from megatron_2bw.training.startup_checks import check_save_dir, index_bytes

GPT = os.path.join(REPO, "pretrain_gpt.py")
DATA = ["--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"]


def _cfg(argv: list[str], world: int = 1, kind: str = "gpt"):
    return build_config(parse_args([*argv, "--train-iters", "10", "--lr", "1e-3", "--device", "cpu", *DATA], kind),
                        kind, world)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---- defaults (issue 14) ------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("w", [1, 2])
@pytest.mark.parametrize("b", [1, 3])
def test_default_schedule_and_global_batch_fit_the_layout(d, w, b):
    shape = ["--model-preset", "gpt-tiny", "--num-layers", "4", "--micro-batch-size", str(b),
             "--pipeline-model-parallel-size", str(d)]
    cfg = _cfg(shape, world=d * w)
    expected = "2bw" if d > 1 else "flush"
    assert cfg.pipeline.schedule == expected
    assert cfg.training.global_batch_size == b * w * d and cfg.pipeline.num_microbatches == d
    assert cfg.pipeline.num_microbatches >= get_schedule(expected).min_microbatches(d)
    note = schedule_note(parse_args([*shape, "--train-iters", "1", "--lr", "1"], "gpt"))
    assert note.startswith(f"--pipeline-schedule not given: {expected} (")
    # an explicit schedule or global batch still wins
    explicit = _cfg([*shape, "--pipeline-schedule", "gpipe", "--global-batch-size", str(2 * b * w * d)], world=d * w)
    assert (explicit.pipeline.schedule, explicit.pipeline.num_microbatches) == ("gpipe", 2 * d)
    assert schedule_note(parse_args([*shape, "--gpipe", "--train-iters", "1", "--lr", "1"], "gpt")) is None


def test_seed_range_is_numpys():
    for seed in (-1, 0, 2**32 - 1, 2**32):
        try:
            np.random.seed(seed)
            numpy_ok = True
        except ValueError:
            numpy_ok = False
        try:
            _cfg(["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--seed", str(seed)])
            ours = True
        except ConfigError:
            ours = False
        assert ours == numpy_ok, seed


def test_constant_loss_scale_refused_exactly_when_it_overflows_fp16():
    fp16_max = torch.finfo(torch.float16).max
    for scale in (1024.0, fp16_max, fp16_max + 1, 1e5, 1e30):
        argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--fp16", "--loss-scale", repr(scale)]
        if scale > fp16_max:  # a scaled loss of 1 is not an fp16 number
            with pytest.raises(ConfigError, match="above fp16's largest value 65504"):
                _cfg(argv)
        else:
            assert _cfg(argv).optimizer.loss_scale == scale


# ---- --save ------------------------------------------------------------------------------------
def test_save_dir_is_created_or_refused_when_not_writable(tmp_path):
    nested = tmp_path / "a" / "b"
    check_save_dir(str(nested))
    assert nested.is_dir() and os.listdir(nested) == []  # the write probe leaves nothing behind
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        target = str(locked)
    else:  # root writes through permission bits; sysfs refuses even root
        target = "/sys"
    with pytest.raises(OSError):
        open(os.path.join(target, "probe"), "w").close()
    with pytest.raises(ConfigError, match=rf"--save {re.escape(target)} is not writable"):
        check_save_dir(target)


# ---- the data index must fit in memory ---------------------------------------------------------
# Runs a command and prints its peak resident memory (KiB) on stdout.
MEASURE_CHILD = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                 "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def _measured_bytes_per_sample(kind: str, corpus, n: int) -> float:  # noqa: F811
    from megatron_2bw.data import build_datasets, build_tokenizer

    tok = build_tokenizer("SentencePieceTokenizer", corpus.model, None, None)
    tracemalloc.start()
    try:
        ds = build_datasets(kind, [corpus.prefix], "90,5,5", 16, (n, 0, 0), 1, tok)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds[0]) == n
    return peak / n


def test_index_memory_estimate_matches_numpy_and_refuses_a_billion_iterations(corpus, tmp_path):  # noqa: F811
    n = 200_000
    per = {}
    for kind, preset in (("gpt", "gpt-tiny"), ("bert", "bert-tiny")):
        per[kind] = _measured_bytes_per_sample(kind, corpus, n)
        cfg = _cfg(["--model-preset", preset, "--micro-batch-size", "1"], kind=kind)
        assert 0.6 * per[kind] * n <= index_bytes(cfg, (n, 0, 0)) <= 1.6 * per[kind] * n, (kind, per[kind])

    iters, B, eval_interval, eval_iters = 10**9, 8, 1000, 100
    argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", str(B),
            "--train-iters", str(iters), "--lr", "1e-3", "--device", "cpu", *corpus.data_args()]
    res = run([PY, "-c", MEASURE_CHILD, PY, GPT, *argv], timeout=120)
    assert res.returncode == 2, res.describe()
    lines = [x for x in _lines(res.stderr) if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.describe()
    samples = iters * B + (iters // eval_interval + 1) * eval_iters * B + eval_iters * B
    m = re.search(r"asks for ([\d,]+) samples .* needs about ([\d.]+) GiB", lines[0])
    assert m and int(m.group(1).replace(",", "")) == samples, lines[0]
    assert 0.6 * per["gpt"] * samples <= float(m.group(2)) * 2**30 <= 1.6 * per["gpt"] * samples
    maxrss_kib = int(re.search(r"^maxrss_kib (\d+)$", res.stdout, re.M).group(1))
    assert maxrss_kib < 4 * 2**20, maxrss_kib  # the trainer's peak: nothing near 60 GiB was tried
    cfg = _cfg(["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", str(B)])
    assert sum(dataset_sizes(cfg, 0, 0)) == 10 * B + (10 // 1000 + 1) * 100 * B + 100 * B  # the same formula


# ---- --validate-only ---------------------------------------------------------------------------
def test_validate_only_checks_everything_once_and_prints_one_line(corpus, tmp_path):  # noqa: F811
    """As the launch scripts call it: RANK=0 and the job's WORLD_SIZE, no peers, no process group."""
    env = clean_env(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    save = tmp_path / "new" / "ckpt"
    argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2",
            "--train-iters", "5", "--lr", "1e-3", "--device", "cpu", "--save", str(save), *corpus.data_args()]
    res = run([PY, GPT, *argv, "--validate-only"], env=env, timeout=120)
    assert res.returncode == 0, res.describe()
    (line,) = _lines(res.stdout)
    b, w, d, iters = 2, 2, 2, 5
    assert line.startswith("config OK: GPT ") and f"layout t=1 d={d} w={w} (4 processes" in line, line
    assert f"schedule 2bw, b={b} m={d} B={b * w * d}" in line
    assert f"{iters} iterations, {iters * b * w * d} training" in line
    assert "--pipeline-schedule not given: 2bw (2 pipeline stages" in res.stderr
    assert save.is_dir()  # --save checked (created) at start-up
    bad = run([PY, GPT, *argv, "--tokenizer-model", corpus.small_model, "--validate-only"], env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", bad.describe()
    errors = [x for x in _lines(bad.stderr) if not x.startswith(" --pipeline-schedule")]
    assert len(errors) == 1 and "this run's tokenizer is SentencePieceTokenizer, vocabulary 400" in errors[0], \
        bad.describe()


# ---- --yaml-cfg and the unknown-flag hint, through the entry point -------------------------------
def test_yaml_cfg_gives_flags_and_the_command_line_wins(corpus, tmp_path):  # noqa: F811
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model_preset: gpt-tiny\nmicro-batch-size: 2\nglobal_batch_size: 4\ntrain_iters: 2\nlr: 0.5\n"
        f"device: cpu\ndata_path: [{corpus.prefix}]\nsplit: 90,5,5\ntokenizer_type: SentencePieceTokenizer\n"
        f"tokenizer_model: {corpus.model}\neval_interval: 2\neval_iters: 1\nlog_interval: 1\n"
    )
    metrics = tmp_path / "m.jsonl"
    res = run([PY, GPT, "--yaml-cfg", str(cfg), "--lr", "1e-3", "--metrics-file", str(metrics)], timeout=180)
    assert res.returncode == 0, res.describe()
    rows = read_metrics(str(metrics))
    start = next(r for r in rows if r["type"] == "start")["config"]
    assert start["optimizer"]["lr"] == 1e-3 and start["lr"]["lr"] == 1e-3  # the command line's, not the file's 0.5
    assert start["training"]["train_iters"] == 2 and start["training"]["global_batch_size"] == 4
    assert start["data"]["data_path"] == [corpus.prefix]
    assert [r["iteration"] for r in rows if r["type"] == "train"] == [0, 1]

    cfg.write_text("train_iter: 2\n")
    bad = run([PY, GPT, "--yaml-cfg", str(cfg)], timeout=60)
    assert bad.returncode == 2 and _lines(bad.stderr) == [
        f"error: --yaml-cfg {cfg}: unknown key 'train_iter': unrecognized argument --train-iter "
        "(did you mean --train-iters?)"], bad.describe()


@pytest.mark.parametrize("flag, hint", [
    ("--foo-bar", "unrecognized argument --foo-bar (see --help)"),
    ("--pipeline-schedul", "unrecognized argument --pipeline-schedul (did you mean --pipeline-schedule?)"),
    ("--use-mcore-models", "Megatron flag not supported by megatron_2bw: --use-mcore-models ("),
])
def test_unknown_flag_is_one_line_with_a_hint(flag, hint):
    res = run([PY, GPT, "--train-iters", "5", "--lr", "1e-3", flag], timeout=60)
    lines = _lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: " + hint), res.describe()


# ---- resume with changed settings (issue 14) -------------------------------------------------------
def test_resume_with_changed_settings_is_refused_unless_overridden(corpus, tmp_path):  # noqa: F811
    save = str(tmp_path / "ckpt")

    def trainer(iters: int, *extra: str, metrics: str = "m.jsonl"):
        args = train_args(corpus, preset="gpt-tiny", schedule="flush", iters=iters,
                          extra=("--save", save, "--load", save, "--log-interval", "1",
                                 "--metrics-file", str(tmp_path / metrics), *extra))
        return run([PY, GPT, *args], timeout=180)

    first = trainer(4, "--exit-interval", "2")
    assert first.returncode == 0 and ck.read_tracker(save) == 2, first.describe()
    saved = vars(ck.load_rank_file(save, 2, 1, 1, 0, 0)["args"])
    assert (saved["train_iters"], saved["seed"], saved["lr_decay_iters"]) == (4, 1234, 4)

    same = trainer(4, "--validate-only")
    assert same.returncode == 0 and "resuming from iteration 2" in same.stdout, same.describe()

    refused = trainer(6, "--seed", "7")
    errors = [x for x in _lines(refused.stderr) if x.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.describe()
    # raising --train-iters (and the --lr-decay-iters that follows it) extends the run (test_resume_extend.py)
    assert errors[0].startswith(f"error: resuming {save} at iteration 2 with changed settings: "
                                "--seed 1234 -> 7 ("), errors[0]
    assert "--override-resumed-settings" in errors[0] and ck.read_tracker(save) == 2

    forced = trainer(6, "--seed", "7", "--override-resumed-settings", metrics="forced.jsonl")
    assert forced.returncode == 0, forced.describe()
    assert re.search(r"--override-resumed-settings: resuming with changed settings: --seed 1234 -> 7$",
                     forced.stderr, re.M), forced.describe()
    assert "with the run extended: --train-iters 4 -> 6; --lr-decay-iters 4 -> 6" in forced.stderr
    trained = [r["iteration"] for r in read_metrics(str(tmp_path / "forced.jsonl")) if r["type"] == "train"]
    assert trained == [2, 3, 4, 5] and ck.read_tracker(save) == 6


def test_a_changed_compensation_is_a_resume_setting():
    from megatron_2bw.training.startup_checks import changed_settings

    def cfg(*extra):
        argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--global-batch-size", "2",
                "--train-iters", "4", "--lr", "1e-3", "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer",
                "--pipeline-schedule", "2bw", *extra]
        return cli.build_config(cli.parse_args(argv, "gpt"), "gpt", 1, cuda_available=False)

    saved = megatron_args(cfg("--2bw-compensation", "predict"))
    assert changed_settings(saved, cfg()) == [("--2bw-compensation", "predict", "none")]
    assert changed_settings(saved, cfg("--2bw-compensation", "predict")) == []


def test_gloo_with_cuda_is_refused_in_one_line():
    """gloo has no CUDA reduce-scatter / all-gather-into-tensor (review L4): refused at start-up."""
    argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", *DATA,
            "--device", "cuda"]
    assert build_config(parse_args(argv, "gpt"), "gpt", 1, cuda_available=True).system.backend == "nccl"
    with pytest.raises(ConfigError, match=r"^--distributed-backend gloo is not supported with --device cuda"):
        build_config(parse_args([*argv, "--distributed-backend", "gloo"], "gpt"), "gpt", 1, cuda_available=True)
    assert build_config(parse_args([*argv[:-1], "cpu", "--distributed-backend", "gloo"], "gpt"), "gpt", 1)
