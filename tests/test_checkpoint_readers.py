"""Every reader of a checkpoint verifies it as the trainer does (issue 19, item 6).

- a shard with 8 flipped bytes: ``tools/checkpoint_util.py`` (HF and Megatron savers, weights only) and
  ``tools/generate.py`` refuse it with one line (they exported and generated from it, exit 0, before);
- a format-3 checkpoint without its manifest: refused by the tools and by a resume;
- ``checkpoint_util`` with ``--save-dir`` equal to ``--load-dir`` (also through a symlink, or inside it):
  refused, the source unchanged;
- an ``iter_*`` folder without a complete shard (a kill during the first save) is not a checkpoint: a
  relaunch with ``--load`` = ``--save`` starts from scratch with a warning instead of refusing to start.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from ckpt_runs import _ckpt_data, one_rank_run, train  # noqa: F401
from e2e import REPO
from test_checkpoint_integrity import _tensor_data_offset
from test_save_guard import _digest

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint import manifest

UTIL, GEN = os.path.join(REPO, "tools", "checkpoint_util.py"), os.path.join(REPO, "tools", "generate.py")


def _errors(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


def _copy(one_rank_run, tmp_path) -> str:  # noqa: F811
    load = str(tmp_path / "ckpt")
    shutil.copytree(one_rank_run.save, load)
    return load


def _tool(path: str):
    """A tool's module, loaded by path (its ``main`` is the command line: one error line, exit status)."""
    spec = importlib.util.spec_from_file_location(f"tool_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Ran:
    """What a tool's ``main`` returned and printed on stderr (in-process: no interpreter start-up per call)."""

    def __init__(self, returncode: int, stderr: str) -> None:
        self.returncode, self.stderr = returncode, stderr

    def describe(self) -> str:
        return f"exit {self.returncode}\n{self.stderr[-4000:]}"


def _main(tool, argv: list[str], capsys) -> _Ran:
    capsys.readouterr()
    code = tool.main(argv)
    return _Ran(code, capsys.readouterr().err)


def _tools(load: str, tmp_path, tok: list[str], capsys) -> list:
    util, gen = _tool(UTIL), _tool(GEN)
    return [
        _main(util, ["--load-dir", load, "--save-dir", str(tmp_path / "hf"), "--saver", "hf", "--no-optimizer"],
              capsys),
        _main(util, ["--load-dir", load, "--save-dir", str(tmp_path / "meg"), "--saver", "megatron", "--no-optimizer"],
              capsys),
        _main(gen, ["--load", load, *tok, "--prompt", "The", "--max-new-tokens", "2", "--temperature", "0",
                    "--device", "cpu"], capsys),
    ]


def one_rank_run_tokenizer(load: str) -> list[str]:
    args = vars(ck.load_rank_file(load, 4, 1, 1, 0, 0)["args"])
    return ["--tokenizer-type", args["tokenizer_type"], "--tokenizer-model", args["tokenizer_model"]]


def test_flipped_bytes_are_refused_by_every_tool(one_rank_run, tmp_path, capsys):  # noqa: F811
    load = _copy(one_rank_run, tmp_path)
    tok = one_rank_run_tokenizer(one_rank_run.save)
    path = ck.checkpoint_path(load, 4, 0, 0, 1)
    start, size = _tensor_data_offset(path)
    with open(path, "r+b") as f:
        f.seek(start + size // 2)
        data = f.read(8)
        f.seek(start + size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    for res in _tools(load, tmp_path, tok, capsys):
        assert res.returncode == 2, res.describe()
        (line,) = _errors(res)
        assert f"checkpoint file {path} is corrupt: crc32" in line and "Traceback" not in res.stderr, line
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "meg")


def test_format_3_without_a_manifest_is_an_error(one_rank_run, tmp_path, capsys):  # noqa: F811
    load = _copy(one_rank_run, tmp_path)
    os.remove(os.path.join(ck.iteration_dir(load, 4), manifest.MANIFEST))
    want = f"checkpoint {ck.iteration_dir(load, 4)} has no manifest.json but its files are format 3"
    tok = one_rank_run_tokenizer(one_rank_run.save)
    for res in [*_tools(load, tmp_path, tok, capsys), train([*one_rank_run.args, "--load", load])]:
        assert res.returncode == 2, res.describe()
        (line,) = _errors(res)
        assert want in line, line


def test_checkpoint_util_never_writes_into_its_source(one_rank_run, tmp_path, capsys):  # noqa: F811
    load = _copy(one_rank_run, tmp_path)
    before = _digest(load)
    os.symlink(load, str(tmp_path / "link"))
    util = _tool(UTIL)
    for save in (load, str(tmp_path / "link"), os.path.join(load, "..", "ckpt"), os.path.join(load, "sub")):
        assert util.main(["--load-dir", load, "--save-dir", save, "--target-tensor-parallel-size", "1"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: --save-dir {save} is (or overlaps) --load-dir {load}") and \
            "checkpoint_util never writes into its source" in line, line
    assert _digest(load) == before


def test_an_iteration_folder_without_a_complete_shard_is_ignored(one_rank_run, tmp_path):  # noqa: F811
    save = str(tmp_path / "ckpt")
    shard = os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(shard))
    with open(f"{shard}.tmp.999999", "wb") as f:  # what a kill during the first save leaves
        f.write(b"\0" * 100)
    res = train([*one_rank_run.args, "--save", save, "--load", save, "--save-interval", "2"])
    assert res.returncode == 0, res.describe()
    assert f"ignoring iter_0000002 in {save}: no complete shard" in res.stderr
    assert ck.read_tracker(save) == 4 and manifest.verify(ck.iteration_dir(save, 2)) is not None


def test_another_layout_gets_the_reshard_hint_not_a_misplaced_shard(one_rank_run, tmp_path):  # noqa: F811
    """t1 d1 resumed as t2 (or d2): the folders overlap, but the manifest tells the layout first."""
    from megatron_2bw.errors import ConfigError

    for t, d in ((2, 1), (1, 2), (2, 2)):
        try:
            ck.load_rank_file(one_rank_run.save, 4, t, d, 0, 0)
        except ConfigError as e:
            line = str(e)
        assert line == (f"checkpoint {ck.iteration_dir(one_rank_run.save, 4)} was saved with layout t=1 d=1 (tensor x "
                        f"pipeline) but this run uses t={t} d={d}; reshard it with tools/checkpoint_util.py "
                        f"--target-tensor-parallel-size {t} --target-pipeline-parallel-size {d}"), line
