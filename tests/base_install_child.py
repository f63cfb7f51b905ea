"""The user-facing paths of megatron_2bw in a process where the optional extras cannot be imported.

Run by tests/test_base_install.py as ``python base_install_child.py WORK_DIR CORPUS_JSONL``: a meta path finder
refuses the extras' packages (matplotlib, tensorboard, wandb, Megatron-Core, einops) before anything else is
imported, as if only the base dependencies of pyproject.toml were installed. In this one process it trains a
tokenizer, preprocesses, trains, resumes, reshards, exports with every ``--saver``, generates, plans, and loads
the HF exports with transformers alone; it writes what it saw to ``WORK_DIR/results.json`` for the test to judge.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys

REFUSED = ("matplotlib", "tensorboard", "wandb", "megatron", "einops", "tiktoken", "apex")


class RefuseExtras:
    """A meta path finder: importing an extra's package (or a module under it) fails as if not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"No module named {name!r} (refused: an optional extra)", name=name)
        return None


sys.meta_path.insert(0, RefuseExtras())
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The module"


def tool(name: str):
    spec = importlib.util.spec_from_file_location(f"base_install_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(main, argv: list[str]) -> tuple[int, str, str]:
    """(status, stdout, stderr) of a command line's ``main`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return int(rc or 0), out.getvalue(), err.getvalue()


def train(work: str, name: str, preset: str, data: list[str], iters: int, *extra: str) -> tuple[int, str, str]:
    from megatron_2bw.training.launch import main

    save = os.path.join(work, name)
    argv = ["--model-preset", preset, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
            str(iters), "--lr", "1e-3", "--device", "cpu", *data, "--save", save, "--load", save, "--log-interval",
            "1", "--eval-iters", "1", "--eval-interval", "100", *extra]
    return call(lambda a: main("gpt", a), argv)


def hf_check(hf_dir: str, tok, generated: str) -> dict:
    """transformers alone on an export: the training ids of the prompt, and its greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    ids = hf_tok(PROMPT, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eod,
                             pad_token_id=tok.eod)[0].tolist()
    if out and out[-1] == tok.eod:  # generate.py stops at the eod without printing it
        out = out[:-1]
    return {"hf_ids": ids, "training_ids": tok.tokenize(PROMPT), "hf_text": tok.detokenize(out),
            "generate_py_text": generated.rstrip("\n"), "model_class": type(model).__name__}


def run(work: str, corpus: str) -> dict:
    from megatron_2bw.data.tokenizers import build_tokenizer

    res: dict = {"steps": {}}
    step = res["steps"]
    sp = os.path.join(work, "tok")
    step["train_tokenizer"] = call(tool("train_tokenizer").main, ["--input", corpus, "--vocab-size", "400",
                                                                  "--model-prefix", sp])
    from tokenizers import ByteLevelBPETokenizer  # a GPT-2 BPE vocabulary of the same corpus

    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(work)
    toks = {"sp": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp + ".model"],
            "bpe": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(work, "vocab.json"),
                    "--merge-file", os.path.join(work, "merges.txt")]}
    pre = tool("preprocess_data").main
    for name, flags in toks.items():
        step[f"preprocess_{name}"] = call(pre, ["--input", corpus, "--output-prefix", os.path.join(work, name),
                                                *flags, "--append-eod"])
    data = {n: ["--data-path", os.path.join(work, f"{n}_text_document"), *f] for n, f in toks.items()}
    runs = {"gpt_sp": ("gpt-tiny", "sp"), "gpt_bpe": ("gpt-tiny", "bpe"), "llama_sp": ("llama-tiny", "sp")}
    for name, (preset, t) in runs.items():
        step[f"train_{name}"] = train(work, name, preset, data[t], 2)
    step["resume_gpt_sp"] = train(work, "gpt_sp", "gpt-tiny", data["sp"], 3)
    step["train_torch_dist"] = train(work, "gpt_dist", "gpt-tiny", data["sp"], 2, "--ckpt-format", "torch_dist")
    cu = tool("checkpoint_util").main
    gpt = os.path.join(work, "gpt_sp")
    step["reshard_t2"] = call(cu, ["--load-dir", gpt, "--save-dir", os.path.join(work, "gpt_t2"),
                                   "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1"])
    for saver in ("megatron", "mcore"):
        step[f"saver_{saver}"] = call(cu, ["--load-dir", gpt, "--save-dir", os.path.join(work, f"gpt_{saver}"),
                                           "--saver", saver])
    gen = tool("generate").main
    res["hf"] = {}
    for name, (_, t) in runs.items():
        hf_dir = os.path.join(work, f"{name}_hf")
        step[f"saver_hf_{name}"] = call(cu, ["--load-dir", os.path.join(work, name), "--save-dir", hf_dir,
                                             "--saver", "hf"])
        step[f"generate_{name}"] = call(gen, ["--load", os.path.join(work, name), "--prompt", PROMPT,
                                              "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"])
        tok = build_tokenizer("GPT2BPETokenizer", None, *data[t][5::2]) if t == "bpe" else \
            build_tokenizer("SentencePieceTokenizer", sp + ".model")
        if step[f"saver_hf_{name}"][0] == 0 and step[f"generate_{name}"][0] == 0:
            res["hf"][name] = hf_check(hf_dir, tok, step[f"generate_{name}"][1])
    step["plan"] = call(tool("plan").main, ["--model-preset", "gpt-tiny", "--num-gpus", "4", "--cluster",
                                            "aws-p3.16xlarge", "--global-batch-size", "16"])
    # the extras' features: one line each naming what to install
    step["simulate_png"] = call(tool("simulate").main, ["--model-preset", "gpt-tiny", "--cluster", "aws-p3.16xlarge",
                                                        "--schedule", "2bw", "--d", "2", "--m", "2", "--png",
                                                        os.path.join(work, "t.png")])
    step["tensorboard"] = train(work, "gpt_tb", "gpt-tiny", data["sp"], 1, "--tensorboard-dir",
                                os.path.join(work, "tb"), "--validate-only")
    step["wandb"] = train(work, "gpt_wb", "gpt-tiny", data["sp"], 1, "--wandb-project", "p", "--wandb-exp-name",
                          "e", "--validate-only")
    res["imported_extras"] = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED)
    return res


if __name__ == "__main__":
    work_dir, corpus_path = sys.argv[1], sys.argv[2]
    results = run(work_dir, corpus_path)
    with open(os.path.join(work_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
