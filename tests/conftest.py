import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


@pytest.fixture
def forked_bench_workers(monkeypatch):
    """The benchmarks' workers forked from the tests' preloaded server (``benchmarks/common.py``'s START_METHOD),
    not fresh interpreters: a smoke test checks a benchmark's JSON and arithmetic, not what a fresh process
    measures of itself, and saves a torch import per worker."""
    import multiprocessing as mp

    import common
    import multiproc

    mp.get_context("forkserver").set_forkserver_preload(list(multiproc.PRELOAD))  # if this starts the server
    monkeypatch.setattr(common, "START_METHOD", "forkserver")


@pytest.fixture(scope="session")
def study_data_dir(tmp_path_factory) -> str:
    """One --data-dir for the convergence studies' smoke runs (benchmarks/convergence.py --quick and
    convergence_moe.py, both a 0.3 MB corpus and a 500-piece tokenizer): the first builds it, the next reuses it
    (convergence_runs.ensure_data makes only what is missing), as the studies share demo_data/ outside the tests."""
    return str(tmp_path_factory.mktemp("study_data"))
