"""Process groups match the documented layout; bad layouts fail fast with one line."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.config import ParallelConfig
from megatron_2bw.errors import ConfigError
from megatron_2bw.parallel_state import Axes, build_state, distributed_env, is_peer_failure, layout_groups

# The worked example in parallel_state.py's docstring, written out independently.
DOCUMENTED_222 = {
    "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "data": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pipeline": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "model": [[0, 1, 4, 5], [2, 3, 6, 7]],
}


def test_layout_groups_pure():
    assert {k: sorted(v) for k, v in layout_groups(2, 2, 2).items()} == DOCUMENTED_222
    g = layout_groups(1, 4, 2)
    assert sorted(g["pipeline"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sorted(g["embedding"]) == [[0, 6], [1, 7]]
    # every group kind partitions the world
    for t, d, w in [(2, 4, 1), (4, 2, 2), (1, 1, 8), (8, 1, 1)]:
        for name, groups in layout_groups(t, d, w).items():
            if name == "embedding":
                continue
            assert sorted(r for grp in groups for r in grp) == list(range(t * d * w)), name


def _groups_worker():
    state = build_state(Axes(tensor=2, data=2, pipeline=2), torch.device("cpu"))
    mine = {
        "tensor": state.groups.tp, "data": state.groups.dp,
        "embedding": state.groups.embedding, "model": state.groups.model,
    }  # no pipeline group (nothing reduces over it: gpu-review-2 N14); its ranks are pipeline_ranks
    ranks = {k: dist.get_process_group_ranks(g) for k, g in mine.items()}
    ranks["pipeline"] = state.pipeline_ranks
    # a collective on each group sums exactly its members' ranks
    sums = {}
    for k, g in mine.items():
        x = torch.tensor([float(state.rank)])
        dist.all_reduce(x, group=g)
        sums[k] = x.item()
    return state.rank, (state.tp_rank, state.dp_rank, state.pp_rank), state.prev_rank, state.next_rank, ranks, sums


def test_groups_on_8_processes_match_documented_layout():
    for rank, coords, prev, nxt, ranks, sums in run_workers(_groups_worker, 8):
        for name, groups in DOCUMENTED_222.items():
            expected = next(g for g in groups if rank in g)
            assert sorted(ranks[name]) == expected, (rank, name)
            assert name == "pipeline" or sums[name] == sum(expected), (rank, name)
        tp_rank, dp_rank, pp_rank = coords
        assert rank == pp_rank * 4 + dp_rank * 2 + tp_rank
        assert (prev, nxt) == ((None, rank + 4) if pp_rank == 0 else (rank - 4, None))


def _embedding_group_worker() -> tuple[list[int] | None, list[int] | None, int]:
    """The embedding group with and without a tied embedding between ranks; the other groups alike."""
    made = []
    real = dist.new_group

    def counting(ranks, **kw):
        made.append(list(ranks))
        return real(ranks, **kw)

    dist.new_group = counting
    try:
        tied = build_state(Axes(pipeline=2), torch.device("cpu"))
        n_tied = len(made)
        apart = build_state(Axes(pipeline=2), torch.device("cpu"), tied_embedding=False)
    finally:
        dist.new_group = real
    ranks = dist.get_process_group_ranks(tied.groups.embedding) if tied.groups.embedding is not None else None
    return ranks, apart.groups.embedding, len(made) - 2 * n_tied


def test_no_embedding_group_where_no_tied_embedding_crosses_ranks():
    """Review 3 N14: the embedding group is a communicator of its own on NCCL; a V placement (first and last
    stage on rank 0) or an untied output layer sums nothing over it, so the run makes none."""
    for ranks, apart, fewer in run_workers(_embedding_group_worker, 2):
        assert ranks == [0, 1] and apart is None and fewer == -1  # one group fewer: the embedding's


@pytest.mark.parametrize(("flags", "tied"), [
    (["--pipeline-schedule", "2bw"], True),
    (["--pipeline-schedule", "flush"], True),
    (["--pipeline-schedule", "interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage", "1"], True),
    (["--pipeline-schedule", "zb-v"], False),  # the embedding and the head both on rank 0
    (["--pipeline-schedule", "2bw", "--untie-embeddings-and-output-weights"], False),
])
def test_the_run_says_whether_its_tied_embedding_crosses_ranks(flags, tied):
    from megatron_2bw.cli import build_config, parse_args

    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--lr", "1e-3", "--device", "cpu",
            "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "t.model",
            *flags]
    assert build_config(parse_args(argv, "gpt"), "gpt", 2).tied_across_ranks is tied
    if flags[1] not in ("2bw", "flush"):  # the others need two stages
        return
    one_stage = [a if a != "2" or argv[i - 1] != "--pipeline-model-parallel-size" else "1"
                 for i, a in enumerate(argv)]
    assert build_config(parse_args(one_stage, "gpt"), "gpt", 1).tied_across_ranks is False


def _peer_leaves_worker() -> tuple[str, bool] | None:
    """Rank 1 leaves the job; rank 0's receive from it fails: the error a rank sees when a peer dies."""
    if dist.get_rank() == 1:
        return None
    try:
        dist.recv(torch.zeros(4), src=1)
    except Exception as e:  # noqa: BLE001 - the backend's own error is what is classified
        return f"{type(e).__name__}: {e}", is_peer_failure(e)
    return "no error", False


def test_peer_failure_is_recognised_from_the_backends_real_error():
    (text, peer), _ = run_workers(_peer_leaves_worker, 2, timeout=120, pg_timeout=20)
    assert peer, text
    assert not is_peer_failure(ValueError("shape [2, 3] does not match [3, 2]"))


def test_bad_layout_refused_before_any_group():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by tensor-model-parallel-size 4"):
        ParallelConfig(4, 1).resolve(6)
    with pytest.raises(ConfigError, match="must be >= 1"):
        ParallelConfig(0, 1)
    assert ParallelConfig(2, 2).resolve(8).data == 2


def test_bad_layout_one_line_error_from_a_process():
    """Through the initializer: one line on stderr, non-zero exit, no process group started."""
    code = (
        "import sys\n"
        "from megatron_2bw.config import ParallelConfig\n"
        "from megatron_2bw.errors import ConfigError\n"
        "from megatron_2bw.parallel_state import initialize\n"
        "try:\n"
        "    initialize(ParallelConfig(2, 2))\n"
        "except ConfigError as e:\n"
        "    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n"
    )
    env = dict(os.environ, RANK="0", WORLD_SIZE="6", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: world size 6 is not divisible by tensor-model-parallel-size 2 x pipeline-model-parallel-size 2"
    ]


def test_slurm_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-09,12]")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the fallback parser
    env = distributed_env()
    assert env == {"rank": 5, "world_size": 16, "local_rank": 1, "master_addr": "gpu07", "master_port": 24242}


# ---- one GPU per local rank (review C7) and the subgroups' timeout (review L1) ---------------------
def test_two_local_ranks_on_one_gpu_are_refused_before_init(monkeypatch):
    from megatron_2bw import parallel_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device before the check"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("init_process_group reached"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun --nproc-per-node 2 on a 1-GPU machine
    with pytest.raises(ConfigError, match=r"^2 processes on this node but 1 visible CUDA device\(s\): two ranks "
                                          r"would share a GPU"):
        parallel_state.initialize(ParallelConfig(1, 2, 1), device="cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert parallel_state.cuda_device_index(0) == 0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # SLURM's own launch, --gpus-per-task=1: each task sees its one GPU
    assert parallel_state.cuda_device_index(3) == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert parallel_state.cuda_device_index(5) == 5


def _subgroup_timeout_worker() -> list[float | None]:
    """Rank 1 never joins; rank 0's collectives on a layout group and on the step-statistics group end
    after the run's timeout (2 s), not torch's default for new groups (30 min for gloo)."""
    import datetime
    import time

    from megatron_2bw.training.step_stats import StepReducer

    state = build_state(Axes(tensor=2), torch.device("cpu"), timeout=datetime.timedelta(seconds=2))
    groups = (state.groups.tp, StepReducer(state, ()).group)
    if state.rank == 1:
        time.sleep(6)  # past both of rank 0's timeouts
        return []
    waited = []
    for g in groups:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=g)
            waited.append(None)
        except RuntimeError:
            waited.append(time.monotonic() - t0)
    return waited


def test_subgroups_get_the_distributed_timeout():
    waited, _ = run_workers(_subgroup_timeout_worker, 2, timeout=90, pg_timeout=60)
    assert len(waited) == 2 and all(w is not None and 1.5 < w < 6 for w in waited), waited
