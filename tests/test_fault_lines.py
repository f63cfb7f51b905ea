"""One clear line, not a traceback or a wrong diagnosis, for the faults of issue 19's fault round (item 6):
a blend-weight sum that overflows, lone surrogates in JSONL, a missing shard in ``checkpoint_util``; and the
warnings for ``--eval-iters`` that repeats the validation set and ``--eval-interval`` changed on resume."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
from ckpt_runs import _ckpt_data, one_rank_run, train  # noqa: F401
from e2e import REPO

from megatron_2bw.data.blend import parse_data_path
from megatron_2bw.data.preprocess import read_jsonl
from megatron_2bw.errors import ConfigError

UTIL = os.path.join(REPO, "tools", "checkpoint_util.py")


def test_blend_weights_that_overflow():
    with pytest.raises(ConfigError, match=r"--data-path weights 1e308 1e308 sum to more than the largest float"):
        parse_data_path(["1e308", "a", "1e308", "b"])
    assert parse_data_path(["1e300", "a", "3e300", "b"])[1] == [0.25, 0.75]


def test_lone_surrogate_in_jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "half \\ud800 a pair"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{path}:2: key 'text' holds a lone surrogate \\ud800 at character 5"):
        list(read_jsonl(str(path), ("text",)))
    path.write_text('{"text": "a pair \\ud83d\\ude00 is fine"}\n', encoding="utf-8")
    assert [t["text"] for _, _, t in read_jsonl(str(path), ("text",))] == ["a pair \U0001F600 is fine"]


def test_missing_shard_in_checkpoint_util(one_rank_run, tmp_path, capsys):  # noqa: F811
    spec = importlib.util.spec_from_file_location("tool_checkpoint_util", UTIL)
    util = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(util)
    meg = str(tmp_path / "meg")
    assert util.main(["--load-dir", one_rank_run.save, "--save-dir", meg, "--saver", "megatron", "--no-optimizer",
                      "--target-tensor-parallel-size", "2"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    idir = os.path.join(meg, "iter_0000004")
    shutil.rmtree(os.path.join(idir, "mp_rank_01"))
    assert util.main(["--load-dir", meg, "--save-dir", str(tmp_path / "hf"), "--saver", "hf"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: checkpoint {idir} was written with t=2 d=1 but "
                    f"{os.path.join(idir, 'mp_rank_01', 'model_optim_rng.pt')} is missing: copy it back or use a "
                    "complete checkpoint"), line


def test_eval_warnings(one_rank_run, tmp_path):  # noqa: F811
    load = str(tmp_path / "ckpt")
    shutil.copytree(one_rank_run.save, load)
    res = train([*one_rank_run.args, "--load", load, "--eval-interval", "500", "--eval-iters", "400",
                 "--validate-only"])
    assert res.returncode == 0, res.describe()
    assert "--eval-interval 1000 -> 500 on resume: the evaluations use other validation samples" in res.stderr
    assert "--eval-iters 400 x --global-batch-size 4 = 1600 samples per evaluation, more than the " in res.stderr
    quiet = train([*one_rank_run.args, "--load", load, "--validate-only"])
    assert quiet.returncode == 0 and "--eval-" not in quiet.stderr, quiet.describe()


def test_every_batch_is_checked_against_the_vocabulary():
    """Start-up scans only 64 windows of a large corpus; a stray id elsewhere is one line when its batch comes."""
    import numpy as np
    import torch

    from megatron_2bw.training.data_iter import MicrobatchProvider

    data = [{"tokens": np.full(9, 7, dtype=np.int64)} for _ in range(8)]
    data[5]["tokens"][3] = 600  # beyond a 512-piece vocabulary
    provider = MicrobatchProvider(data, lambda t: {"tokens": t}, global_batch=4, micro_batch=2, m=2, w=1, dp_rank=0,
                                  device=torch.device("cpu"), vocab_size=512)
    assert provider(0)["tokens"].shape == (2, 9) and provider(1)["tokens"].shape == (2, 9)
    with pytest.raises(ConfigError, match=r"samples \[4, 6\) of the data hold token id 600 but the tokenizer's "
                                          r"vocabulary has 512 entries"):
        provider(2)
    data[5]["tokens"][3] = -1
    with pytest.raises(ConfigError, match="hold token id -1"):
        provider(2)


def test_rendezvous_port_in_use_is_one_line(one_rank_run, tmp_path):  # noqa: F811
    import socket

    from e2e import PY, clean_env, run

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        res = run([PY, os.path.join(REPO, "pretrain_gpt.py"), *one_rank_run.args, "--pipeline-model-parallel-size",
                   "2", "--stall-timeout-s", "0"], env=env, timeout=120)
    assert res.returncode == 1, res.describe()
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert errors == [f"error: rank 0: cannot start the process group: the rendezvous address 127.0.0.1:{port} is "
                      "already in use (another job or a leftover process on that port?): choose another MASTER_PORT"], \
        res.describe()
    assert "Traceback" not in res.stderr
