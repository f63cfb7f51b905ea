"""The offline tools as safe as the trainer (issue 37): the exact commands of the issue's bad and poor
cases, each refused in one ``error:`` line (exit 2) or working."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict

from megatron_2bw.config.presets import get_preset
from megatron_2bw.planner.hardware import load_cluster
from megatron_2bw.planner.search import PlanRequest, default_costs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(name: str):
    """``tools/<name>.py`` as a module (its ``main`` is the command line)."""
    path = os.path.join(REPO, "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tool37_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_error(capsys, code: int, starts: str) -> str:
    """The single ``error:`` line a refused command printed (exit 2)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(starts), (code, err)
    return lines[0]


def test_simulate_refuses_a_cpu_profile_for_an_h200_cluster_as_plan_does(tmp_path, capsys):
    """Poor case: tools/simulate.py accepted a CPU profile for an H200 cluster where tools/plan.py refuses it."""
    model = get_preset("gpt-tiny")
    data = default_costs(PlanRequest(model, load_cluster("dgx-h200"), 4, 16, "fp32")).to_json()
    data.update(source="test", model=asdict(model), meta={"dtype": "fp32", "device": "x86_64", "device_type": "cpu"})
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    want = f"error: --profile {path} was measured on x86_64 (cpu) but the plan's devices are NVIDIA H200"
    code = tool("simulate").main(["--schedule", "2bw", "--d", "2", "--m", "4", "--profile", str(path),
                                  "--cluster", "dgx-h200", "--precision", "fp32"])
    one_error(capsys, code, want)
    code = tool("plan").main(["--model-preset", "gpt-tiny", "--precision", "fp32", "--cluster", "dgx-h200",
                              "--num-gpus", "4", "--global-batch-size", "16", "--profile", str(path)])
    one_error(capsys, code, want)
    # the same profile for the CPU host's cluster is simulated
    assert tool("simulate").main(["--schedule", "2bw", "--d", "2", "--m", "4", "--profile", str(path),
                                  "--cluster", "cpu-host", "--precision", "fp32"]) == 0, capsys.readouterr().err


# ---- checkpoint_util: never into another run's or another model's directory -----------------------------
def _tiny_ckpt(root, iteration: int) -> str:
    from export_helpers import tiny

    from megatron_2bw.checkpoint.megatron_format import write_megatron_dir

    ex, _ = tiny("gpt")
    ex.iteration = iteration
    write_megatron_dir(str(root), ex, t=1, d=1)
    return str(root)


def _tree(path) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), path)] = fh.read()
    return out


def test_hf_export_into_another_runs_training_directory_is_refused(tmp_path, capsys):
    """Bad case: GPT-2 files beside another run's iter_* folders, which tools then silently read as the model."""
    src, run_dir = _tiny_ckpt(tmp_path / "src", 4), _tiny_ckpt(tmp_path / "other_run", 10)
    before = _tree(run_dir)
    for extra in ([], ["--overwrite"]):  # --overwrite never replaces another run's checkpoints
        code = tool("checkpoint_util").main(["--load-dir", src, "--save-dir", run_dir, "--saver", "hf", *extra])
        one_error(capsys, code, f"error: --save-dir {run_dir} holds another run's checkpoints "
                                "(latest_checkpointed_iteration.txt names iteration 10): checkpoint_util never moves")
    assert _tree(run_dir) == before and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_reshard_into_another_runs_save_never_moves_its_pointer(tmp_path, capsys):
    """Bad case: resharding into another run's --save moved its pointer from 10 to 60."""
    src, run_dir = _tiny_ckpt(tmp_path / "src", 60), _tiny_ckpt(tmp_path / "other_run", 10)
    code = tool("checkpoint_util").main(["--load-dir", src, "--save-dir", run_dir,
                                         "--target-tensor-parallel-size", "2"])
    one_error(capsys, code, f"error: --save-dir {run_dir} holds another run's checkpoints")
    assert open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")).read().strip() == "10"
    # its own earlier output is replaced whole by the same command
    out = str(tmp_path / "t2")
    for _ in range(2):
        assert tool("checkpoint_util").main(["--load-dir", src, "--save-dir", out, "--target-tensor-parallel-size",
                                             "2"]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(out, "iter_0000060"))) == ["mp_rank_00", "mp_rank_01"]


def test_hf_export_over_another_models_hf_directory(tmp_path, capsys):
    """Bad case: an HF export replaced a LlamaForCausalLM with a GPT2LMHeadModel (exit 0, no word)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = _tiny_ckpt(tmp_path / "src", 4)
    llama = str(tmp_path / "llama_hf")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(llama)
    open(os.path.join(llama, "notes.txt"), "w").write("the Llama model's own file\n")
    before = _tree(llama)
    capsys.readouterr()
    code = tool("checkpoint_util").main(["--load-dir", src, "--save-dir", llama, "--saver", "hf"])
    one_error(capsys, code, f"error: --save-dir {llama} is not empty (")
    assert _tree(llama) == before
    # --overwrite replaces it whole: nothing of the Llama directory is left beside the GPT-2 files
    assert tool("checkpoint_util").main(["--load-dir", src, "--save-dir", llama, "--saver", "hf", "--overwrite"]) == 0
    assert json.load(open(os.path.join(llama, "config.json")))["model_type"] == "gpt2"
    assert not os.path.exists(os.path.join(llama, "notes.txt"))
    # a failed conversion leaves the target as it was
    after = _tree(llama)
    code = tool("checkpoint_util").main(["--load-dir", src, "--save-dir", llama, "--saver", "hf", "--overwrite",
                                         "--target-tensor-parallel-size", "2"])
    one_error(capsys, code, "error: --saver hf writes one whole model")
    assert _tree(llama) == after


# ---- preprocess_data.py and train_tokenizer.py: their own earlier output only ---------------------------
def test_preprocess_replaces_only_its_own_earlier_output(tmp_path, tmp_path_factory, capsys):
    from e2e import shared_corpus

    sp = shared_corpus(tmp_path_factory).model
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"text": "The first corpus.\nTwo lines."}) + "\n")
    b.write_text(json.dumps({"text": "Another corpus altogether."}) + "\n")
    prefix = str(tmp_path / "data" / "corpus")
    flags = ["--output-prefix", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp]
    pre = tool("preprocess_data")
    assert pre.main(["--input", str(a), *flags]) == 0 and pre.main(["--input", str(a), *flags]) == 0  # its own
    before = _tree(tmp_path / "data")
    capsys.readouterr()
    one_error(capsys, pre.main(["--input", str(b), *flags]),
              f"error: --output-prefix: {prefix}_text_document.bin, {prefix}_text_document.idx, ")
    assert _tree(tmp_path / "data") == before
    assert pre.main(["--input", str(b), *flags, "--overwrite"]) == 0 and _tree(tmp_path / "data") != before
    # files of another tool (no sidecar) are refused too
    other = str(tmp_path / "mine")
    open(other + "_text_document.bin", "wb").write(b"not a dataset")
    capsys.readouterr()
    one_error(capsys, pre.main(["--input", str(a), "--output-prefix", other, *flags[2:]]),
              f"error: --output-prefix: {other}_text_document.bin exists and is not an earlier output")


def test_train_tokenizer_replaces_only_its_own_model(tmp_path, tmp_path_factory, capsys):
    from e2e import shared_corpus

    corpus = os.path.join(shared_corpus(tmp_path_factory).dir, "corpus.jsonl")
    train = tool("train_tokenizer")
    prefix = str(tmp_path / "tok")
    argv = ["--input", corpus, "--vocab-size", "400", "--model-prefix", prefix]
    assert train.main(argv) == 0 and train.main(argv) == 0  # its own earlier output is replaced
    assert sorted(os.listdir(tmp_path)) == ["tok.model", "tok.vocab"]  # no temporary name left
    foreign = str(tmp_path / "foreign")
    open(foreign + ".model", "wb").write(b"someone else's model")
    capsys.readouterr()
    one_error(capsys, train.main([*argv[:-1], foreign]),
              f"error: --model-prefix: {foreign}.model exists and is not an earlier output of train_tokenizer.py")
    assert open(foreign + ".model", "rb").read() == b"someone else's model"


# ---- the benchmarks' outputs -----------------------------------------------------------------------------
def test_benchmark_outputs_replace_only_their_own(tmp_path, capsys):
    import sys

    import pytest

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import common
    finally:
        sys.path.pop(0)
    res = tmp_path / "results.json"
    common.write_json(str(res), {"a": 1})
    common.write_json(str(res), {"a": 2})  # its own earlier output (a JSON object) is replaced
    assert json.loads(res.read_text()) == {"a": 2} and sorted(os.listdir(tmp_path)) == ["results.json"]
    notes = tmp_path / "notes.txt"
    notes.write_text("a person's notes\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        common.write_json(str(notes), {"a": 3})
    assert e.value.code == 2
    one_error(capsys, 2, f"error: --json {notes} exists and is not a JSON results file")
    assert notes.read_text() == "a person's notes\n"
    out = str(tmp_path / "runs")
    assert common.out_dir(out, "convergence") == out and common.out_dir(out, "convergence") == out
    run_dir = _tiny_ckpt(tmp_path / "ckpt", 10)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        common.out_dir(run_dir, "convergence")
    one_error(capsys, 2, f"error: --out-dir {run_dir} is not empty "
                         "(latest_checkpointed_iteration.txt names iteration 10)")
    with pytest.raises(SystemExit):
        common.out_dir(out, "log_interval")  # another benchmark's directory
    one_error(capsys, 2, f"error: --out-dir {out} is not empty (")


def test_build_demo_corpus_replaces_only_its_own_corpus(tmp_path, capsys):
    build = tool("build_demo_corpus")
    out = str(tmp_path / "corpus.jsonl")
    assert build.main(["--output", out, "--max-mb", "0.02"]) == 0
    assert build.main(["--output", out, "--max-mb", "0.02"]) == 0
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"text": "a corpus of my own"}\n')
    capsys.readouterr()
    one_error(capsys, build.main(["--output", str(mine), "--max-mb", "0.02"]),
              f"error: --output: {mine} exists and is not an earlier output of build_demo_corpus.py")
    assert mine.read_text() == '{"text": "a corpus of my own"}\n' and sorted(os.listdir(tmp_path)) == ["corpus.jsonl",
                                                                                                    "mine.jsonl"]


def test_profile_model_refuses_an_out_that_is_not_a_profile(tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text("not a profile\n")
    code = tool("profile_model").main(["--model-preset", "gpt-tiny", "--micro-batch-sizes", "1", "--out", str(notes)])
    one_error(capsys, code, f"error: --out: {notes} exists and is not an earlier output of profile_model.py")
    assert notes.read_text() == "not a profile\n"
