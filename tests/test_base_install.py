"""What a user installs is what the tests run (issue 45): the base dependencies of pyproject.toml cover every
user-facing path, and a feature whose extra is missing says so in one line.

``make test`` installs every extra, so the suite alone cannot see a path that imports an extra's package (or
a package only an extra brings, as ``tensorboard`` and ``wandb`` brought ``protobuf``, which the SentencePiece
export to transformers needs). Here one child process (``base_install_child.py``) refuses the extras'
packages with an import hook and runs tokenizer training, preprocessing, training, resuming, resharding,
every ``--saver``, generation and the planner; transformers alone loads the HF exports of a GPT with a
SentencePiece and with a GPT-2 BPE tokenizer and of a Llama model, and gives the training ids and
``tools/generate.py``'s greedy tokens.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import sys
import tomllib

import pytest
from e2e import PY, REPO, clean_env, run, shared_corpus

EXTRA_STEPS = {"simulate_png": ("matplotlib", "[plot]"), "tensorboard": ("tensorboard", "[tensorboard]"),
               "wandb": ("wandb", "[wandb]")}


def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    corpus = shared_corpus(tmp_path_factory)
    work = tmp_path_factory.mktemp("base_install")
    res = run([PY, os.path.join(REPO, "tests", "base_install_child.py"), str(work),
               os.path.join(corpus.dir, "corpus.jsonl")], env=clean_env(PYTHONPATH=REPO), timeout=400, fresh=True)
    assert res.returncode == 0, res.describe()
    with open(work / "results.json", encoding="utf-8") as f:
        return json.load(f)


def test_every_user_facing_path_runs_without_the_extras(child):
    steps = child["steps"]
    assert {"train_tokenizer", "preprocess_sp", "preprocess_bpe", "train_gpt_sp", "train_gpt_bpe", "train_llama_sp",
            "resume_gpt_sp", "train_torch_dist", "reshard_t2", "saver_megatron", "saver_mcore", "saver_hf_gpt_sp",
            "saver_hf_gpt_bpe", "saver_hf_llama_sp", "generate_gpt_sp", "plan"} <= set(steps)
    failed = {k: v[2][-2000:] for k, v in steps.items() if k not in EXTRA_STEPS and v[0] != 0}
    assert not failed, failed
    assert "resumed from iteration 2" in steps["resume_gpt_sp"][2]
    # the start-up line calls a RoPE + SwiGLU + RMSNorm GPT what its export is (issue 45: it said "GPT")
    assert re.search(r"^Llama \d+\.\d\dM parameters \|", steps["train_llama_sp"][2], re.M), steps["train_llama_sp"][2]
    assert re.search(r"^GPT \d+\.\d\dM parameters \|", steps["train_gpt_sp"][2], re.M)
    assert child["imported_extras"] == []  # the hook held: no extra was imported on any path


@pytest.mark.parametrize("step", sorted(EXTRA_STEPS))
def test_a_feature_whose_extra_is_missing_says_so_in_one_line(child, step):
    rc, _, err = child["steps"][step]
    package, extra = EXTRA_STEPS[step]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and package in lines[0] and extra in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("name, model_class", [("gpt_sp", "GPT2LMHeadModel"), ("gpt_bpe", "GPT2LMHeadModel"),
                                               ("llama_sp", "LlamaForCausalLM")])
def test_hf_export_gives_training_ids_and_generate_py_greedy_tokens(child, name, model_class):
    hf = child["hf"][name]
    assert hf["model_class"] == model_class
    assert hf["hf_ids"] == hf["training_ids"] and len(hf["training_ids"]) >= 2
    assert hf["hf_text"] == hf["generate_py_text"] and len(hf["hf_text"]) > len("The module")


def test_base_dependencies_declare_what_the_library_imports():
    """Every third-party package megatron_2bw/ and tools/ import is a base dependency, or one an extra declares
    (imported only where its feature is used), or apex (an optional kernel library found at run time)."""
    project = _pyproject()
    base = _names(project["dependencies"])
    extras = set().union(*(_names(v) for v in project["optional-dependencies"].values()))
    assert "protobuf" in base and not ({"matplotlib", "tensorboard", "wandb", "einops"} & base)
    imported = set()
    for root in ("megatron_2bw", "tools"):
        for top, _, files in os.walk(os.path.join(REPO, root)):
            for f in (f for f in files if f.endswith(".py")):
                with open(os.path.join(top, f), encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
                for n in ast.walk(tree):
                    if isinstance(n, ast.Import):
                        imported |= {a.name.split(".")[0] for a in n.names}
                    elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                        imported.add(n.module.split(".")[0])
    dists = md.packages_distributions()
    third = {m for m in imported if m not in sys.stdlib_module_names and m != "megatron_2bw" and m != "apex"}
    undeclared = {m: dists.get(m) for m in third
                  if not ({d.lower().replace("_", "-") for d in dists.get(m, [m])} & (base | extras))}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
