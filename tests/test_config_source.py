"""One config source: the flag table, the model rule every tool shares, and the planner's command.

The planner's printed command is parsed by the trainer's own parser and config builder and must
give the planner's model and layout; each tool's model flags must give the trainer's model.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

import pytest

from megatron_2bw.argv import megatron_args, to_argv
from megatron_2bw.cli import FLAGS, build_config, build_parser, parse_args, run_cli
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.presets import PRESETS
from megatron_2bw.errors import ConfigError
from megatron_2bw.flags import MEGATRON_DROPOUT
from megatron_2bw.planner.auto_plan import PlanChoice
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.report import paper_model, pretrain_command
from megatron_2bw.planner.search import PlanRequest, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = ["--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model"]
TRAIN = ["--train-iters", "10", "--lr", "1e-3", "--device", "cpu", *DATA]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)  # loaded by path: tools/ never goes on sys.path
    spec.loader.exec_module(mod)
    return mod


PLAN, PROFILE, SIMULATE = _tool("plan"), _tool("profile_model"), _tool("simulate")


def models_by_path(argv: list[str], kind: str, tool_flags: tuple[str, ...] = ()) -> dict[str, ModelConfig]:
    """The model each entry point builds from the same model flags (``tool_flags``: the tools' extra ones)."""
    trainer = build_config(parse_args([*argv, "--micro-batch-size", "1", *TRAIN], kind), kind, 1).model
    argv = [*argv, *tool_flags]
    tools = {
        "plan": PLAN.model_from_args(PLAN.build_parser().parse_args(argv)),
        "profile_model": PROFILE.model_from_args(PROFILE.build_parser().parse_args([*argv, "--out", "p.json"])),
        "simulate": SIMULATE.model_from_args(
            SIMULATE.build_parser().parse_args([*argv, "--schedule", "flush", "--d", "1", "--m", "1"])),
    }
    return {"trainer": trainer, **tools}


def _overrides(base: ModelConfig) -> list[tuple[list[str], ModelConfig]]:
    """Flag sets on a preset, with the model each must give (written out from the rule, not the code)."""
    h2, s2 = 2 * base.hidden_size, 2 * base.seq_length
    return [
        ([], base),
        # Megatron's default FFN: 4h, or with SwiGLU 2/3 of it rounded down to a multiple of 64
        (["--hidden-size", str(h2)], replace(base, hidden_size=h2,
                                             ffn_hidden_size=int(4 * h2 * 2 / 3 / 64) * 64 if base.swiglu else 4 * h2)),
        (["--hidden-size", str(h2), "--ffn-hidden-size", "96"], replace(base, hidden_size=h2, ffn_hidden_size=96)),
        (["--seq-length", str(s2)], replace(base, seq_length=s2, max_position_embeddings=s2)),
        (["--num-layers", "8", "--hidden-dropout", "0.2"], replace(base, num_layers=8, hidden_dropout=0.2)),
    ]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_gives_one_model_in_trainer_and_every_tool(name):
    base = PRESETS[name]
    for flags, expected in _overrides(base):
        models = models_by_path(["--model-preset", name, *flags], base.kind)
        for path, model in models.items():
            assert model == expected, (name, flags, path)


def test_gpt_2p2b_hidden_4096_is_16384_ffn_everywhere():
    models = models_by_path(["--model-preset", "gpt-2.2b", "--hidden-size", "4096"], "gpt")
    assert {m.ffn_hidden_size for m in models.values()} == {4 * 4096}
    assert {m.hidden_dropout for m in models.values()} == {PRESETS["gpt-2.2b"].hidden_dropout}


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_shape_flags_without_preset_use_megatron_dropout_everywhere(kind):
    shape = ["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", "24"]
    models = models_by_path(shape, kind, ("--model-kind", kind))
    expected = ModelConfig(kind, 3, 48, 4, 24, 24, 1, 192, MEGATRON_DROPOUT, MEGATRON_DROPOUT,
                           num_tokentypes=2 if kind == "bert" else 0)
    for path, model in models.items():  # the trainer's vocabulary comes from its tokenizer later
        assert replace(model, vocab_size=1) == expected, path


def test_preset_of_the_other_kind_is_refused_everywhere():
    with pytest.raises(ConfigError, match="is a BERT model; use pretrain_bert.py"):
        models_by_path(["--model-preset", "bert-tiny"], "gpt")
    with pytest.raises(ConfigError, match="is a BERT model; not --model-kind gpt"):
        PLAN.model_from_args(PLAN.build_parser().parse_args(["--model-preset", "bert-tiny", "--model-kind", "gpt"]))


# ---- the planner's printed command, parsed by the trainer -------------------------------------

V100 = load_cluster("aws-p3.16xlarge")


def _plan_cases():
    wide = PLAN.model_from_args(PLAN.build_parser().parse_args(["--model-preset", "gpt-2.2b", "--hidden-size", "4096"]))
    return [
        ("gpt-2.2b paper", PlanRequest(paper_model("gpt-2.2b"), V100, 64, 512)),
        ("gpt-2.2b hidden 4096", PlanRequest(wide, V100, 64, 512)),
        ("gpt-355m fp32", PlanRequest(PRESETS["gpt-355m"], V100, 8, 64, "fp32")),
        ("bert-355m bf16", PlanRequest(paper_model("bert-355m"), load_cluster("dgx-a100-80gb"), 16, 256, "bf16")),
        ("gpt-tiny", PlanRequest(PRESETS["gpt-tiny"], V100, 4, 16)),
    ]


@pytest.mark.parametrize("label, request_", _plan_cases(), ids=[c[0] for c in _plan_cases()])
def test_planner_command_parses_to_the_planners_model_and_layout(label, request_):
    result = search(request_)
    for ev in result.ranked[:4]:  # the best and a few runners-up (other t, d, b, schedules)
        argv = pretrain_command(ev, request_)
        kind = request_.model.kind
        assert argv[0] == f"pretrain_{kind}.py"
        cfg = build_config(parse_args([*argv[1:], *TRAIN], kind), kind, request_.num_gpus, cuda_available=False)
        c = ev.candidate
        assert cfg.model == replace(request_.model, vocab_size=cfg.model.vocab_size), (label, argv)
        assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data) == (
            c.tensor_parallel, c.pipeline_parallel, c.data_parallel)
        assert (cfg.pipeline.micro_batch_size, cfg.pipeline.num_microbatches, cfg.pipeline.recompute,
                cfg.pipeline.schedule) == (c.micro_batch_size, c.num_micro_batches, c.recompute, c.schedule)
        assert cfg.training.global_batch_size == c.global_batch_size == request_.global_batch_size
        assert cfg.optimizer.dtype == request_.precision


# ---- the table is the parser, the mapping and the inverse -------------------------------------

@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_parser_is_the_table(kind):
    parser = build_parser(kind)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}
    expected = [f for f in FLAGS if kind in f.kinds]
    assert list(by_flag) == [f.name for f in expected]
    for f in expected:
        a = by_flag[f.name]
        assert a.dest == f.dest and a.required == f.required
        assert a.default == (False if f.const is not None else f.default)
    assert all(name in parser.format_help() for name in PRESETS)  # --help lists the presets


CONFIGS = [
    ("gpt", ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", "16",
             "--pipeline-model-parallel-size", "2", *TRAIN], 4),
    ("gpt", ["--model-preset", "gpt-2.2b", "--hidden-size", "4096", "--micro-batch-size", "1", "--gpipe",
             "--checkpoint-activations", "--fp16", "--loss-scale", "512", "--lr-warmup-fraction", "0.3",
             "--lr-decay-style", "cosine", "--save", "s", "--save-interval", "5", *TRAIN], 2),
    ("bert", ["--model-preset", "bert-tiny", "--micro-batch-size", "2", "--mask-prob", "0.2", "--bf16",
              "--pipeline-schedule", "flush", "--tensor-model-parallel-size", "2", "--optimizer", "sgd", *TRAIN], 2),
]


@pytest.mark.parametrize("kind, argv, world", CONFIGS)
def test_config_to_flags_and_back_is_the_same_config(kind, argv, world):
    cfg = build_config(parse_args(argv, kind), kind, world)
    again = build_config(parse_args(to_argv(cfg), kind), kind, world)
    assert again == replace(cfg, model=replace(cfg.model, vocab_size=again.model.vocab_size))
    flat = json.loads(json.dumps(megatron_args(cfg)))  # what checkpoints store
    assert flat == megatron_args(cfg)  # JSON-able as it is
    assert flat["micro_batch_size"] == cfg.pipeline.micro_batch_size and flat["lr"] == cfg.optimizer.lr
    assert flat["fp16"] == (cfg.optimizer.dtype == "fp16") and flat["ffn_hidden_size"] == cfg.model.ffn_hidden_size
    assert set(flat) == {f.dest for f in FLAGS if kind in f.kinds and f.targets and not f.alias}


def test_one_lr_in_both_sections():
    """--lr is stored as the optimizer's base rate and the schedule's peak; a config giving them two values (a
    program or a config file, since the flag writes both) is refused where it is built."""
    kind, argv, world = CONFIGS[0]
    cfg = build_config(parse_args(argv, kind), kind, world)
    assert cfg.optimizer.lr == cfg.lr.lr
    with pytest.raises(ConfigError, match="the optimizer's lr .* and the schedule's lr .* differ"):
        replace(cfg, lr=replace(cfg.lr, lr=2 * cfg.lr.lr))


def test_auto_plan_choice_is_applied_to_the_config():
    choice = PlanChoice(t=1, d=2, w=2, b=2, recompute=True, schedule="flush")
    args = parse_args(["--model-preset", "gpt-tiny", "--auto-plan", "--global-batch-size", "16", *TRAIN], "gpt")
    cfg = build_config(args, "gpt", 4, layout=choice.layout)
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data) == (1, 2, 2)
    assert (cfg.pipeline.micro_batch_size, cfg.pipeline.recompute, cfg.pipeline.schedule) == (2, True, "flush")
    assert cfg.pipeline.num_microbatches == 16 // (2 * 2)
    with pytest.raises(ConfigError, match="--micro-batch-size is required"):
        build_config(args, "gpt", 4)
    with pytest.raises(ConfigError, match="m=1 < d=2"):  # the choice is validated like flags are
        build_config(args, "gpt", 16, layout=PlanChoice(1, 2, 8, 2, False, "2bw").layout)


def test_run_cli_prints_returns_and_turns_config_errors_into_one_line(capsys):
    assert run_cli(lambda argv: " ".join(argv), ["a", "b"]) == 0
    assert capsys.readouterr().out == "a b\n"
    assert run_cli(lambda argv: 3, []) == 3

    def bad(argv):
        raise ConfigError("no such thing")

    assert run_cli(bad, []) == 2
    assert capsys.readouterr().err == "error: no such thing\n"
