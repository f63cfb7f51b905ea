"""Megatron flags -> validated config dataclasses (pure: no process, no file)."""

from __future__ import annotations

import json

import pytest

from megatron_2bw.argv import megatron_args
from megatron_2bw.cli import build_config, env_world, parse_args
from megatron_2bw.errors import ConfigError

DATA = ["--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"]
MINIMAL = ["--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--device", "cpu", *DATA]


def cfg_of(argv, kind="gpt", world=1):
    return build_config(parse_args(argv, kind), kind, world)


def test_every_megatron_flag_of_the_issue_is_accepted():
    argv = [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "100",
        "--lr", "1e-3", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
        "--weight-decay", "0.1", "--clip-grad", "0.5", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--optimizer", "adam", "--hidden-dropout", "0.0", "--attention-dropout", "0.05", "--seed", "7", "--fp16",
        "--loss-scale", "1024", "--recompute-activations", "--data-path", "0.3", "a", "0.7", "b", "--split", "98,1,1",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt", "--save", "s",
        "--load", "s", "--save-interval", "50", "--log-interval", "5", "--eval-interval", "20", "--eval-iters", "3",
        "--exit-interval", "60", "--pipeline-schedule", "flush", "--metrics-file", "m.jsonl",
        "--distributed-backend", "gloo", "--distributed-timeout-minutes", "3", "--device", "cpu",
        "--fused-kernels", "torch",
    ]
    cfg = cfg_of(argv, world=8)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data) == (2, 2, 2)
    assert cfg.pipeline.schedule == "flush" and cfg.pipeline.recompute and cfg.pipeline.num_microbatches == 4
    assert cfg.optimizer.dtype == "fp16" and cfg.optimizer.loss_scale == 1024 and cfg.optimizer.adam_beta2 == 0.95
    assert cfg.model.max_position_embeddings == 64 and cfg.model.attention_dropout == 0.05
    assert cfg.model.hidden_dropout == 0.0
    assert (cfg.lr.decay_style, cfg.lr.warmup_iters, cfg.lr.decay_iters, cfg.lr.min_lr) == ("cosine", 10, 100, 1e-5)
    assert cfg.training.exit_interval == 60 and cfg.data.data_path == ("0.3", "a", "0.7", "b")
    assert cfg.system.timeout_minutes == 3 and cfg.system.fused_kernels == "torch"
    json.dumps(megatron_args(cfg))  # stored in checkpoints


def test_preset_with_explicit_overrides():
    cfg = cfg_of(["--model-preset", "gpt-tiny", "--num-layers", "8", "--hidden-size", "128", *MINIMAL])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (8, 128, 512)
    assert cfg.model.num_attention_heads == 4 and cfg.model.hidden_dropout == 0.0  # the preset's
    longer = cfg_of(["--model-preset", "gpt-tiny", "--seq-length", "64", *MINIMAL])
    assert longer.model.seq_length == 64 and longer.model.max_position_embeddings == 64
    assert cfg.with_vocab(1000).model.vocab_size == 1000


def test_without_preset_megatron_defaults():
    cfg = cfg_of(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "8",
                  *MINIMAL], kind="bert")
    assert cfg.model.kind == "bert" and cfg.model.num_tokentypes == 2
    assert cfg.model.hidden_dropout == 0.1 and cfg.model.attention_dropout == 0.1
    assert cfg.pipeline.schedule == "flush" and cfg.optimizer.dtype == "fp32"  # one stage: flush
    assert cfg.training.global_batch_size == 2 and cfg.training.seed == 1234 and cfg.data.split == "969, 30, 1"
    with pytest.raises(ConfigError, match="--num-layers is required"):
        cfg_of(MINIMAL)


@pytest.mark.parametrize("flags, schedule", [
    ([], "flush"), (["--pipeline-no-flushes"], "2bw"), (["--gpipe"], "gpipe"),
    (["--pipeline-schedule", "flush"], "flush"), (["--pipeline-schedule", "2bw", "--pipeline-no-flushes"], "2bw"),
])
def test_schedule_spellings(flags, schedule):
    assert cfg_of(["--model-preset", "gpt-tiny", *MINIMAL, *flags]).pipeline.schedule == schedule


def test_batch_and_layout_from_world_size():
    cfg = cfg_of(["--model-preset", "gpt-tiny", *MINIMAL, "--pipeline-model-parallel-size", "2",
                  "--global-batch-size", "32"], world=8)
    assert cfg.parallel.data == 4 and cfg.pipeline.num_microbatches == 4
    with pytest.raises(ConfigError, match="m=1 < d=2"):
        cfg_of(["--model-preset", "gpt-tiny", *MINIMAL, "--pipeline-model-parallel-size", "2",
                "--global-batch-size", "4"], world=4)
    flush = cfg_of(["--model-preset", "gpt-tiny", *MINIMAL, "--pipeline-model-parallel-size", "2",
                    "--pipeline-schedule", "flush", "--global-batch-size", "4"], world=4)
    assert flush.pipeline.num_microbatches == 1  # m < d is legal (if wasteful) for the flushing schedules


def test_warmup_fraction_and_checkpoint_alias():
    cfg = cfg_of(["--model-preset", "gpt-tiny", *MINIMAL, "--lr-warmup-fraction", "0.25", "--checkpoint-activations"])
    assert cfg.lr.warmup_iters == 2 and cfg.pipeline.recompute
    with pytest.raises(ConfigError, match="not both"):
        cfg_of(["--model-preset", "gpt-tiny", *MINIMAL, "--lr-warmup-fraction", "0.25", "--lr-warmup-iters", "1"])


def test_device_resolution():
    args = parse_args(["--model-preset", "gpt-tiny", *MINIMAL, "--device", "auto"], "gpt")
    assert build_config(args, "gpt", 1, cuda_available=False).system.device == "cpu"
    on_gpu = build_config(args, "gpt", 1, cuda_available=True).system
    assert (on_gpu.device, on_gpu.backend) == ("cuda", "nccl")
    args = parse_args(["--model-preset", "gpt-tiny", *MINIMAL, "--device", "cuda"], "gpt")
    with pytest.raises(ConfigError, match="no CUDA device"):
        build_config(args, "gpt", 1, cuda_available=False)


def test_env_world(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert env_world() == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert env_world() == (3, 8)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env_world() == (1, 4)  # torchrun's variables win, as in parallel_state.distributed_env


def test_parser_errors_are_config_errors():
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_args([*MINIMAL, "--optimizer", "lamb"], "gpt")
    with pytest.raises(ConfigError, match="required"):
        parse_args([], "bert")


def test_p2p_mode_flag():
    base = ["--model-preset", "gpt-tiny", *MINIMAL]
    assert cfg_of(base).pipeline.p2p_mode == "auto"
    assert cfg_of([*base, "--p2p-mode", "grouped"]).pipeline.p2p_mode == "grouped"
    with pytest.raises(ConfigError, match="--p2p-mode: invalid choice"):
        parse_args([*MINIMAL, "--p2p-mode", "eager"], "gpt")
    from megatron_2bw.config import PipelineConfig
    with pytest.raises(ConfigError, match="--p2p-mode"):
        PipelineConfig(p2p_mode="eager")


def test_muon_and_ef_flags():
    base = [*MINIMAL, "--model-preset", "gpt-tiny", "--pipeline-model-parallel-size", "2", "--optimizer", "muon"]
    cfg = cfg_of([*base, "--muon-momentum", "0.9", "--no-muon-nesterov", "--muon-ns-steps", "3", "--muon-lr", "0.02",
                  "--muon-adjust-lr-fn", "match_rms_adamw", "--2bw-compensation", "ef", "--2bw-ef-scale", "0.5"],
                 world=2)
    o = cfg.optimizer
    assert (o.optimizer, o.muon_momentum, o.muon_nesterov, o.muon_ns_steps, o.muon_lr, o.muon_adjust_lr_fn) == \
        ("muon", 0.9, False, 3, 0.02, "match_rms_adamw")
    assert cfg.pipeline.compensation == "ef" and cfg.pipeline.ef_scale == 0.5
    d = cfg_of(base, world=2).optimizer
    assert (d.muon_momentum, d.muon_nesterov, d.muon_ns_steps, d.muon_lr) == (0.95, True, 5, None)
    mega = cfg_of([*base, "--muon-use-nesterov", "--muon-num-ns-steps", "4"], world=2).optimizer  # Megatron's spellings
    assert mega.muon_nesterov and mega.muon_ns_steps == 4
    for bad, msg in [(["--muon-nesterov", "--no-muon-nesterov"], "contradict"),
                     (["--2bw-compensation", "predict"], "predict extrapolates Adam or SGD"),
                     (["--muon-momentum", "1.5"], "--muon-momentum"), (["--2bw-ef-scale", "-1"], "--2bw-ef-scale")]:
        with pytest.raises(ConfigError, match=msg):
            cfg_of([*base, *bad], world=2)
    with pytest.raises(ConfigError, match="only applies to --pipeline-schedule 2bw"):
        cfg_of([*base, "--pipeline-schedule", "flush", "--2bw-compensation", "ef"], world=2)


def test_default_compensation_follows_the_measurements():
    """--2bw-compensation auto (the default): ef with Muon, predict with Adam (or SGD with momentum) in bf16/fp16
    without the distributed optimizer (free there), none otherwise; an explicit mode is kept."""
    base = [*MINIMAL, "--model-preset", "gpt-tiny", "--pipeline-model-parallel-size", "2"]

    def mode(*extra, world=2):
        return cfg_of([*base, *extra], world=world).pipeline.compensation

    assert mode("--optimizer", "muon") == mode("--optimizer", "muon", "--bf16") == "ef"
    assert (mode("--bf16") == mode("--fp16") == mode("--bf16", "--optimizer", "sgd", "--sgd-momentum", "0.9")
            == "predict")
    assert mode() == "none"  # fp32: predict would cost a weight copy
    assert mode("--bf16", "--optimizer", "sgd", "--sgd-momentum", "0") == "none"  # no momentum to extrapolate with
    assert mode("--bf16", "--use-distributed-optimizer", world=4) == "none"
    assert (mode("--bf16", "--pipeline-schedule", "flush")
            == mode("--optimizer", "muon", "--pipeline-schedule", "flush") == "none")
    assert mode("--bf16", "--2bw-compensation", "none") == "none"
    assert mode("--2bw-compensation", "ef") == "ef"


def test_prefetch_p2p_refused_with_nccl(capsys):
    """Review finding H2: prefetching receives deadlocks on NCCL's in-order p2p; one line, exit 2."""
    from megatron_2bw.errors import run_cli

    cuda = ["--model-preset", "gpt-tiny", *MINIMAL, "--device", "cuda", "--distributed-backend", "nccl"]

    def run(argv):
        build_config(parse_args(argv, "gpt"), "gpt", 1, cuda_available=True)

    assert run_cli(run, [*cuda, "--p2p-mode", "prefetch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --p2p-mode prefetch deadlocks on NCCL"), err
    for mode in ("grouped", "auto"):
        assert run_cli(run, [*cuda, "--p2p-mode", mode]) == 0
    assert run_cli(run, ["--model-preset", "gpt-tiny", *MINIMAL, "--p2p-mode", "prefetch"]) == 0  # gloo: its mode
