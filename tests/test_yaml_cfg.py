"""--yaml-cfg against the trainer's real parser, and the one-line hint for unknown flags."""

from __future__ import annotations

import pytest

from megatron_2bw.errors import ConfigError
from megatron_2bw.yaml_cfg import (
    MEGATRON_UNSUPPORTED,
    add_yaml_cfg_argument,
    expand_yaml_cfg,
    explain_unrecognized,
    nearest_flag,
)

try:  # the parser builder may move to megatron_2bw.cli
    from megatron_2bw.cli import build_parser  # type: ignore[attr-defined]
except ImportError:
    from megatron_2bw.arguments import build_parser

REQUIRED = ["--train-iters", "5", "--lr", "0.1"]


def parser(kind: str = "gpt", with_flag: bool = True):
    p = build_parser(kind)
    if with_flag and "--yaml-cfg" not in p._option_string_actions:
        add_yaml_cfg_argument(p)
    return p


def parse(tmp_path, text: str, argv: list[str], kind: str = "gpt"):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    p = parser(kind)
    return p.parse_args(expand_yaml_cfg(["--yaml-cfg", str(cfg), *argv], p)), cfg


def test_yaml_values_reach_the_namespace_with_both_key_spellings(tmp_path):
    text = ("train_iters: 1000\nlr: 2.0e-4\nmin-lr: 1.0e-5\nmicro_batch_size: 4\nlr_decay_style: cosine\n"
            "split: 98,2,0\ndata_path: [0.3, a_text_document, 0.7, b_text_document]\nseed: 7\n")
    args, cfg = parse(tmp_path, text, [])
    assert (args.train_iters, args.lr, args.min_lr, args.micro_batch_size) == (1000, 2.0e-4, 1.0e-5, 4)
    assert args.lr_decay_style == "cosine" and args.split == "98,2,0" and args.seed == 7
    assert args.data_path == ["0.3", "a_text_document", "0.7", "b_text_document"]
    assert args.yaml_cfg == str(cfg)


def test_the_command_line_wins(tmp_path):
    args, _ = parse(tmp_path, "train_iters: 1000\nlr: 0.5\ndata_path: [x_text_document]\n",
                    ["--lr", "0.25", "--data-path", "y_text_document", "z_text_document"])
    assert args.train_iters == 1000 and args.lr == 0.25
    assert args.data_path == ["y_text_document", "z_text_document"]
    args, _ = parse(tmp_path, "train_iters: 1000\nlr: 0.5\n", ["--train-iters=3"])
    assert args.train_iters == 3 and args.lr == 0.5


def test_booleans_are_switches_and_null_is_the_default(tmp_path):
    args, _ = parse(tmp_path, "fp16: true\nrecompute_activations: false\nmin_lr: null\n", REQUIRED)
    assert args.fp16 is True and args.recompute_activations is False
    assert args.min_lr == build_parser("gpt").get_default("min_lr")


def test_bert_only_flags(tmp_path):
    args, _ = parse(tmp_path, "mask_prob: 0.2\n", REQUIRED, kind="bert")
    assert args.mask_prob == 0.2
    with pytest.raises(ConfigError, match="unknown key 'mask_prob'"):
        parse(tmp_path, "mask_prob: 0.2\n", REQUIRED, kind="gpt")


def test_unknown_key_names_the_nearest_flag(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, "train_iter: 10\n", REQUIRED)
    msg = str(e.value)
    assert "unknown key 'train_iter'" in msg and "did you mean --train-iters?" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="Megatron flag not supported by megatron_2bw: --use-mcore-models"):
        parse(tmp_path, "use_mcore_models: true\n", REQUIRED)


@pytest.mark.parametrize("text,match", [
    ("- train_iters\n- 10\n", "expected a mapping of flag names to values.*got a list"),
    ("just a string\n", "got a str"),
    ("train_iters: [1, 2]\n", "train_iters takes one value"),
    ("fp16: yes please\n", "fp16 is a switch"),
    ("lr: true\n", "lr takes a value, not true"),
    ("train_iters: 10\n  lr: [\n", "invalid YAML"),
    ("yaml_cfg: other.yaml\n", "cannot be set in a YAML config"),
])
def test_bad_files_are_one_line_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse(tmp_path, text, REQUIRED)
    assert "\n" not in str(e.value)


def test_empty_file_and_missing_file(tmp_path):
    args, _ = parse(tmp_path, "", REQUIRED)
    assert args.train_iters == 5
    p = parser()
    with pytest.raises(ConfigError, match="no such file"):
        expand_yaml_cfg(["--yaml-cfg", str(tmp_path / "nope.yaml")], p)
    with pytest.raises(ConfigError, match="given twice"):
        expand_yaml_cfg(["--yaml-cfg", "a", "--yaml-cfg", "b"], p)
    assert expand_yaml_cfg(REQUIRED, p) == REQUIRED


def test_a_parser_without_the_flag_gets_the_file_flag_dropped(tmp_path):
    import argparse

    cfg = tmp_path / "c.yaml"
    cfg.write_text("train_iters: 9\nlr: 0.3\n")
    p = argparse.ArgumentParser()
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--lr", type=float)
    assert expand_yaml_cfg([f"--yaml-cfg={cfg}"], p) == ["--train-iters=9", "--lr=0.3"]
    args = p.parse_args(expand_yaml_cfg([f"--yaml-cfg={cfg}"], p))
    assert (args.train_iters, args.lr) == (9, 0.3)


def test_unknown_flag_hint_names_the_nearest_flag():
    p = parser()
    with pytest.raises(ConfigError) as e:
        p.parse_args([*REQUIRED, "--micro-batch", "4", "--tensor-parallel-size=2"])
    msg = explain_unrecognized(str(e.value), p)
    assert msg == ("unrecognized argument --micro-batch (did you mean --micro-batch-size?); "
                   "unrecognized argument --tensor-parallel-size (did you mean --tensor-model-parallel-size?)")
    assert nearest_flag("zzzz", p) is None
    assert explain_unrecognized("unrecognized arguments: --zzzz", p) == "unrecognized argument --zzzz (see --help)"
    assert explain_unrecognized("the following arguments are required: --lr", p) == \
        "the following arguments are required: --lr"


def test_known_megatron_flags_say_they_are_not_supported():
    p = parser()
    with pytest.raises(ConfigError) as e:
        p.parse_args([*REQUIRED, "--transformer-impl", "local"])
    msg = explain_unrecognized(str(e.value), p)
    assert msg.startswith("Megatron flag not supported by megatron_2bw: --transformer-impl (")
    # No flag in the list exists in the parser (else the hint would be wrong).
    assert not set(MEGATRON_UNSUPPORTED) & set(p._option_string_actions)
