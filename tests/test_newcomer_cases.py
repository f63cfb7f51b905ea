"""The cases a new user hit (issue 45), each through the command line: one process, tiny models, 1-4 steps.

C13 (--finetune from another tokenizer's checkpoint), S06/S17 (unwritable metrics/TensorBoard paths found at
start-up), F02-F05 (a save on a full disk or past the file size limit: one line naming the file, exit 2, the
previous checkpoint kept), E01 (exports readable under umask 022), R13/Y06/K01 and --overwrite-save with
--load = --save (each says what it does), G05/G09 (generate's positions checked before printing), P19, P16,
D04 (a damaged .idx that stays consistent), and Megatron's --ckpt-step, per-split data paths, --kv-channels
and refused flags.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import struct

import numpy as np
import pytest
from e2e import PY, REPO, clean_env, read_metrics, run, shared_corpus, torchrun, train_losses
from test_offline_tools import tool

from megatron_2bw.cli import build_config, parse_args
from megatron_2bw.config import LRConfig
from megatron_2bw.errors import ConfigError, describe_save_failure
from megatron_2bw.export.outputs import staged_dir
from megatron_2bw.training.log_format import eta_line
from megatron_2bw.training.lr_schedule import lr_at

FILE_LIMIT = 100 * 1024  # bytes: below a tiny model's checkpoint file, above its metrics and logs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return shared_corpus(tmp_path_factory)


def trainer(corpus, save: str | None, iters: int, *extra: str, data: list[str] | None = None, limit: int | None = None,
            script: str = "pretrain_gpt.py"):
    """``pretrain_gpt.py`` on gpt-tiny in one process (``limit``: its RLIMIT_FSIZE)."""
    argv = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
            str(iters), "--lr", "1e-3", "--device", "cpu", "--log-interval", "1", "--eval-iters", "1",
            "--eval-interval", "100", *(data if data is not None else corpus.data_args()),
            *(["--save", save, "--load", save] if save else []), *extra]
    return run([PY, os.path.join(REPO, script), *argv], env=clean_env(PYTHONPATH=REPO), timeout=180, fsize=limit)


def errors(res) -> list[str]:
    return [x for x in res.stderr.splitlines() if x.startswith("error:")]


def one_error(res, *parts: str) -> str:
    """The run's only ``error:`` line (exit 2, no traceback), holding every one of ``parts``."""
    lines = errors(res)
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.output, res.describe()
    assert all(p in lines[0] for p in parts), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def base_ckpt(corpus, tmp_path_factory) -> str:
    """gpt-tiny trained 2 steps with the 512-piece tokenizer, a checkpoint at 2."""
    save = str(tmp_path_factory.mktemp("newcomer") / "base")
    res = trainer(corpus, save, 2)
    assert res.returncode == 0, res.describe()
    return save


def _copy(src: str, dst) -> str:
    shutil.copytree(src, str(dst))
    return str(dst)


# ---------------------------------------------------------------- C13
def test_finetune_from_another_tokenizer_is_refused_or_warned_and_the_load_is_logged(corpus, base_ckpt, tmp_path):
    """Another tokenizer of the same vocabulary size (512 pieces learnt from half the corpus): the shapes agree,
    the pieces do not."""
    with open(os.path.join(corpus.dir, "corpus.jsonl"), encoding="utf-8") as f:
        docs = f.readlines()
    half = tmp_path / "half.jsonl"
    half.write_text("".join(docs[: len(docs) // 2]))
    other = str(tmp_path / "other")
    assert tool("train_tokenizer").main(["--input", str(half), "--vocab-size", "512", "--model-prefix", other]) == 0
    prefix = str(tmp_path / "d")
    assert tool("preprocess_data").main(["--input", str(half), "--output-prefix", prefix, "--tokenizer-type",
                                         "SentencePieceTokenizer", "--tokenizer-model", other + ".model",
                                         "--append-eod"]) == 0
    data = ["--data-path", prefix + "_text_document", "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", other + ".model"]
    load = ["--load", base_ckpt, "--finetune"]
    refused = trainer(corpus, None, 1, *load, data=data)
    line = one_error(refused, "--finetune from", base_ckpt, "at iteration 2", "--finetune-ignore-tokenizer")
    names = re.findall(r"SentencePieceTokenizer, vocabulary 512, sha256 ([0-9a-f]{12})", line)
    assert len(names) == 2 and names[0] != names[1], line  # both tokenizers named
    accepted = trainer(corpus, None, 1, *load, "--finetune-ignore-tokenizer", data=data)
    assert accepted.returncode == 0, accepted.describe()
    warned = [x for x in accepted.stderr.splitlines() if "--finetune-ignore-tokenizer" in x]
    assert len(warned) == 1 and all(n in warned[0] for n in names), accepted.stderr
    assert f"successfully loaded checkpoint from {base_ckpt} at iteration 2: weights only" in accepted.stderr
    same = trainer(corpus, None, 1, *load)  # the checkpoint's own tokenizer: no warning
    assert same.returncode == 0 and "tokenizer" not in "".join(x for x in same.stderr.splitlines() if "warn" in x)


# ---------------------------------------------------------------- S06, S17, and torchrun
@pytest.mark.parametrize("case", ["metrics_dir", "tensorboard_under_file"])
@pytest.mark.parametrize("validate", [True, False])
def test_unwritable_outputs_are_refused_at_start_up(corpus, tmp_path, case, validate):
    (tmp_path / "afile").write_text("x")
    flag = (["--metrics-file", str(tmp_path)] if case == "metrics_dir"
            else ["--tensorboard-dir", str(tmp_path / "afile" / "tb")])
    res = trainer(corpus, None, 1, *flag, *(["--validate-only"] if validate else []))
    one_error(res, flag[0], "directory" if case == "metrics_dir" else "is under the file")
    assert "iteration" not in res.stderr  # refused before any step


def test_torchrun_start_up_errors_are_one_line_and_never_restarted(corpus, tmp_path):
    """A refused flag under plain torchrun: one ``error:`` line for both ranks, the documented status 140 (torchrun
    cannot be made to exit 2 by a worker; docs/training.md, Exit status), no traceback; a start-up error under
    ``--max-restarts 3`` is not retried."""
    refused = torchrun("pretrain_gpt.py", ["--model-preset", "gpt-tiny", "--lr", "1e-3", "--qk-layernorm"], nproc=2,
                       timeout=120, real=True)
    assert refused.returncode == -signal.SIGUSR2 and len(errors(refused)) == 1 and "Traceback" not in refused.output, \
        refused.describe()
    assert "Megatron flag not supported by megatron_2bw: --qk-layernorm" in errors(refused)[0]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=3",
           os.path.join(REPO, "pretrain_gpt.py"), "--model-preset", "gpt-tiny", "--micro-batch-size", "2",
           "--train-iters", "1", "--lr", "1e-3", "--device", "cpu", *corpus.data_args(),
           "--metrics-file", str(tmp_path)]
    res = run(cmd, timeout=120)
    assert len(errors(res)) == 1 and "--metrics-file" in errors(res)[0] and "restart" not in res.output.lower(), \
        res.describe()


# ---------------------------------------------------------------- F02-F05
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_save_past_the_disk_is_one_line_exit_2_and_keeps_the_previous_checkpoint(corpus, tmp_path, fmt):
    save = str(tmp_path / "ckpt")
    fmt_flags = ("--ckpt-format", fmt, "--save-interval", "2")
    first = trainer(corpus, save, 2, *fmt_flags)
    assert first.returncode == 0, first.describe()
    full = trainer(corpus, save, 4, *fmt_flags, limit=FILE_LIMIT)
    line = one_error(full, "iter_0000004", "File too large", "failed")
    assert (".distcp" if fmt == "torch_dist" else "model_optim_rng.pt") in line
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"
    again = trainer(corpus, save, 4, *fmt_flags, "--validate-only")  # the kept checkpoint resumes
    assert again.returncode == 0 and "resuming from iteration 2" in again.stdout, again.describe()


def test_an_export_past_the_disk_is_one_line_and_leaves_no_target(base_ckpt, tmp_path):
    out = str(tmp_path / "hf")
    cmd = [PY, os.path.join(REPO, "tools", "checkpoint_util.py"), "--load-dir", base_ckpt, "--save-dir", out,
           "--saver", "hf"]
    res = run(cmd, env=clean_env(PYTHONPATH=REPO), timeout=180, fsize=FILE_LIMIT)
    one_error(res, os.path.join(out, "model.safetensors"), "File too large")
    assert not os.path.exists(out) and os.listdir(tmp_path) == []  # no target, no temporary left


def test_no_space_left_is_named_with_the_file(tmp_path, monkeypatch):
    """ENOSPC itself (a real full disk cannot be made here): through the export's staging and from torch's zip
    writer, which hides the errno (``unexpected pos``) and is recognised from the disk's free space."""
    with pytest.raises(ConfigError, match=r"writing .*out/weights.bin failed: No space left on device \(ENOSPC\)"):
        with staged_dir(str(tmp_path / "out"), {"tool": "t"}) as tmp:
            with open(os.path.join(tmp, "weights.bin"), "wb") as f:
                f.write(b"x")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os.listdir(tmp_path) == []

    class Full:
        f_bavail, f_frsize = 3, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full)
    line = describe_save_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                                 "ck/iter_0000004/__0_0.distcp")
    assert line == "writing ck/iter_0000004/__0_0.distcp failed: No space left on device (ENOSPC; 12288 bytes free)"


# ---------------------------------------------------------------- E01
@pytest.mark.parametrize("saver", ["hf", "megatron"])
def test_exports_are_readable_under_umask_022(base_ckpt, tmp_path, saver):
    out = str(tmp_path / saver)
    res = run([PY, os.path.join(REPO, "tools", "checkpoint_util.py"), "--load-dir", base_ckpt, "--save-dir", out,
               "--saver", saver], umask=0o022, env=clean_env(PYTHONPATH=REPO), timeout=180)
    assert res.returncode == 0, res.describe()
    modes = {os.path.relpath(os.path.join(top, n), out): os.stat(os.path.join(top, n)).st_mode & 0o777
             for top, dirs, files in os.walk(out) for n in dirs + files}
    assert os.stat(out).st_mode & 0o777 == 0o755
    assert modes and all(m == (0o755 if os.path.isdir(os.path.join(out, p)) else 0o644)
                         for p, m in modes.items()), modes


# ---------------------------------------------------------------- R13, --overwrite-save with --load = --save
def test_a_resume_logs_changed_optimizer_settings_and_an_ignored_overwrite(corpus, base_ckpt, tmp_path):
    save = _copy(base_ckpt, tmp_path / "ck")
    res = trainer(corpus, save, 3, "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "0.5",
                  "--hidden-dropout", "0.05", "--overwrite-save")
    assert res.returncode == 0, res.describe()
    changed = [x for x in res.stderr.splitlines() if "applied from the first resumed step" in x]
    assert len(changed) == 1, res.stderr
    for part in ("--weight-decay 0.01 -> 0.1", "--adam-beta2 0.999 -> 0.95", "--clip-grad 1.0 -> 0.5",
                 "--hidden-dropout 0.0 -> 0.05"):
        assert part in changed[0], changed[0]
    ignored = [x for x in res.stderr.splitlines() if "--overwrite-save ignored" in x]
    assert len(ignored) == 1 and "resumes" in ignored[0] and "iteration 2" in ignored[0]
    assert f"successfully loaded checkpoint from {save} at iteration 2: full state" in res.stderr
    assert os.path.isdir(os.path.join(save, "iter_0000002"))  # kept, not cleared


# ---------------------------------------------------------------- Y06, K01
def test_yaml_with_one_flag_twice_is_refused(tmp_path):
    base = ["--model-preset", "gpt-tiny", "--lr", "1e-3"]
    for text, want in (("train_iters: 5\ntrain-iters: 7\n", "'train_iters' and 'train-iters' both set --train-iters"),
                       ("train_iters: 5\nlr: 1\ntrain_iters: 7\n",
                        "line 3: invalid YAML: key 'train_iters' given twice")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match=want):
            parse_args([*base, "--yaml-cfg", str(tmp_path / "c.yaml")], "gpt")


def test_train_tokenizer_says_when_it_made_fewer_pieces(corpus, tmp_path, capsys):
    import sentencepiece as spm

    prefix = str(tmp_path / "big")
    assert tool("train_tokenizer").main(["--input", os.path.join(corpus.dir, "corpus.jsonl"), "--vocab-size",
                                         "100000", "--model-prefix", prefix]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    n = spm.SentencePieceProcessor(model_file=prefix + ".model").get_piece_size()
    assert len(out) == 1 and f"({n} pieces, fewer than --vocab-size 100000" in out[0] and n < 100000


# ---------------------------------------------------------------- G05, G09
def test_generate_checks_positions_before_printing(base_ckpt, capsys):
    prompt = "The module returns " * 160  # ~3,000 characters, far past gpt-tiny's 16 positions
    assert tool("generate").main(["--load", base_ckpt, "--prompt", prompt, "--max-new-tokens", "4",
                                  "--temperature", "0", "--device", "cpu"]) == 2
    cap = capsys.readouterr()
    lines = [x for x in cap.err.splitlines() if x.strip()]
    assert cap.out == "" and len(lines) == 1 and "The module" not in lines[0] and len(lines[0]) < 300
    assert "more than the model's 16" in lines[0] and "--max-new-tokens 4" in lines[0]


# ---------------------------------------------------------------- P19, P16
def test_preprocess_names_a_directory_and_takes_null_tokenizer_vocab_size(tmp_path, capsys):
    pre = tool("preprocess_data").main
    assert pre(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "x"), "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "100"]) == 2
    assert f"--input {tmp_path} is a directory" in capsys.readouterr().err
    (tmp_path / "ids.jsonl").write_text(json.dumps({"text": "5 6 7"}) + "\n" + json.dumps({"text": "99 0"}) + "\n")
    assert pre(["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "100", "--append-eod"]) == 0
    ids = np.fromfile(tmp_path / "n_text_document.bin", dtype=np.uint16)
    assert ids.tolist() == [5, 6, 7, 100, 99, 0, 100]  # eod = vocabulary size, as Megatron's NullTokenizer


# ---------------------------------------------------------------- D04
def test_a_damaged_index_that_stays_consistent_is_refused(corpus, tmp_path):
    prefix = str(tmp_path / "copy_text_document")
    for ext in (".bin", ".idx", ".tokenizer.json"):
        shutil.copyfile(corpus.prefix + ext, prefix + ext)
    with open(prefix + ".idx", "r+b") as f:  # move one document boundary by one sequence: still rising, in range
        head = f.read(9 + 8 + 1 + 16)
        n, ndoc = struct.unpack_from("<QQ", head, 18)
        pos = 34 + 12 * n + 8 * 3
        f.seek(pos)
        (v,) = struct.unpack("<q", f.read(8))
        f.seek(pos)
        f.write(struct.pack("<q", v + 1))
    data = ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", corpus.model]
    one_error(trainer(corpus, None, 1, "--validate-only", data=data), prefix, "changed since tools/preprocess_data.py")


# ---------------------------------------------------------------- Megatron flags
def test_ckpt_step_loads_that_iteration(corpus, tmp_path):
    save = str(tmp_path / "ck")
    assert trainer(corpus, save, 2, "--save-interval", "1").returncode == 0
    res = trainer(corpus, save, 2, "--ckpt-step", "1", "--validate-only")
    assert res.returncode == 0 and "resuming from iteration 1" in res.stdout, res.describe()
    one_error(trainer(corpus, save, 2, "--ckpt-step", "5", "--validate-only"), "--ckpt-step 5", "(it holds 1, 2)")


def test_per_split_data_paths_train_on_that_data(corpus, tmp_path):
    """--train-data-path P trains on all of P: the same steps as --data-path P --split 100,0,0."""
    tok = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", corpus.model]
    runs = {}
    for name, data in (("split", ["--data-path", corpus.prefix, "--split", "100,0,0"]),
                       ("own", ["--train-data-path", corpus.prefix, "--valid-data-path", corpus.prefix])):
        metrics = str(tmp_path / f"{name}.jsonl")
        res = trainer(corpus, None, 2, "--metrics-file", metrics, data=[*data, *tok])
        assert res.returncode == 0, res.describe()
        runs[name] = train_losses(read_metrics(metrics))
    assert runs["own"] == runs["split"] and len(runs["own"]) == 2
    one_error(trainer(corpus, None, 1, "--validate-only", "--train-data-path", corpus.prefix),
              "not both")  # with the fixture's --data-path


def test_kv_channels_and_refused_megatron_flags():
    base = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--data-path", "x", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    build_config(parse_args([*base, "--kv-channels", "16"], "gpt"), "gpt", 1)  # 64 / 4 heads
    with pytest.raises(ConfigError, match="--kv-channels 32 is not --hidden-size 64 / --num-attention-heads 4"):
        build_config(parse_args([*base, "--kv-channels", "32"], "gpt"), "gpt", 1)
    for flag in ("--qk-layernorm", "--no-save-optim", "--tp-comm-overlap"):
        with pytest.raises(ConfigError, match=f"^Megatron flag not supported by megatron_2bw: {flag} "):
            parse_args([*base, flag], "gpt")


# ---------------------------------------------------------------- the docs' statements
def test_the_docs_eta_and_lr_statements_hold():
    with open(os.path.join(REPO, "docs", "training.md"), encoding="utf-8") as f:
        doc = f.read()
    assert "` [ETA] N of T iterations done | elapsed H:MM:SS | remaining H:MM:SS | R it/s`" in doc
    assert eta_line(4, 12, 0, 2.0) == " [ETA] 4 of 12 iterations done | elapsed 0:00:02 | remaining 0:00:04 | 2.00 it/s"
    cfg = LRConfig(lr=1e-3, min_lr=0.0, decay_style="cosine", warmup_iters=2, decay_iters=10)
    assert lr_at(cfg, 0) > 0 and lr_at(cfg, 9) == 0.0  # the first step never at 0; the last at --min-lr 0
    assert "with the default\n`--min-lr 0` that step runs at lr 0" in doc
