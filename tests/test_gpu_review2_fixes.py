"""gpu-review-2 fixes checked on the CPU: N6 (single NCCL transfers as one-op batches), N13 (eager
communicators in the test workers), N14 (no pipeline group), and section 1's L1 residual (the
checkpoint's gloo group takes the run's timeout)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw import parallel_state as ps
from megatron_2bw.checkpoint.dist_checkpoint import collective
from megatron_2bw.config.axes import Axes
from megatron_2bw.local_workers import init_kwargs
from megatron_2bw.parallel_state import build_state, group_timeout, layout_groups
from megatron_2bw.pipeline import transport as tp
from megatron_2bw.pipeline import zero
from megatron_2bw.pipeline.zero import ShardLayout, gather_full
from megatron_2bw.schedule.actions import Action, Op


class _Done:
    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        self.waited = True
        return True


def test_single_transfers_go_out_as_one_op_batches_on_nccl(monkeypatch) -> None:
    """N6: evaluation's receives and sends through ``batch_isend_irecv`` (the world communicator), never
    a bare ``isend``/``irecv`` (a new two-rank communicator per pair)."""
    batches: list[list] = []
    monkeypatch.setattr(tp.dist, "P2POp", lambda fn, tensor, peer, tag=0: (fn, tensor, peer, tag))
    monkeypatch.setattr(tp.dist, "batch_isend_irecv", lambda ops: batches.append(ops) or [_Done()])
    def bare(*a, **k):
        raise AssertionError("a bare p2p op")

    def bare_recv(*a, **k):
        raise AssertionError("a bare p2p op")

    monkeypatch.setattr(tp.dist, "isend", bare)
    monkeypatch.setattr(tp.dist, "irecv", bare_recv)
    link = tp.Transport(0, 2, (3,), torch.float32, torch.device("cpu"), mode="grouped")
    assert not link.batch_single  # no process group: plain ops
    link.batch_single = True  # what an NCCL world sets
    got = link.recv(Action(Op.RECV_ACT, 0))
    link.send(Action(Op.SEND_ACT, 0), torch.ones(3))
    link.drain()
    assert got.shape == (3,)
    assert [(len(b), b[0][0], b[0][2], b[0][3]) for b in batches] == [(1, bare_recv, 0, 1), (1, bare, 2, 1)]


def _gather_nccl_path() -> dict:
    """The distributed optimizer's gather for a torch-format save, its NCCL branch run on gloo."""
    calls = []
    zero_gloo, send, recv = zero._gloo, dist.send, dist.recv
    zero._gloo = lambda group: False
    dist.send = lambda *a, **k: calls.append("send")
    dist.recv = lambda *a, **k: calls.append("recv")
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: calls.append(len(ops)) or batch(ops)
    zero.GATHER_CHUNK, chunk = 3, zero.GATHER_CHUNK
    try:
        rank = dist.get_rank()
        layout = ShardLayout(10, 2, rank)
        shard = torch.arange(layout.size, dtype=torch.float32) + 100 * rank
        out = gather_full(shard, layout, dist.group.WORLD, everywhere=False)
    finally:
        zero._gloo, dist.send, dist.recv = zero_gloo, send, recv
        dist.batch_isend_irecv, zero.GATHER_CHUNK = batch, chunk
    return {"out": out, "calls": calls, "size": layout.size}


def test_distributed_optimizer_save_gather_uses_one_op_batches() -> None:
    first, other = run_workers(_gather_nccl_path, 2, timeout=120)
    s = first["size"]
    expect = torch.cat([torch.arange(s, dtype=torch.float32), torch.arange(s, dtype=torch.float32) + 100])[:10]
    assert torch.equal(first["out"], expect) and other["out"] is None
    pieces = -(-s // 3)
    assert first["calls"] == [1] * pieces and other["calls"] == [1] * pieces  # no bare send / recv


def test_test_workers_make_nccl_communicators_eagerly() -> None:
    """N13: ``run_workers`` passes ``device_id`` on NCCL, as the trainer does."""
    assert init_kwargs("gloo", 1) == {}
    assert init_kwargs("nccl", 1) == {"device_id": torch.device("cuda", 1)}


def test_no_pipeline_group_and_every_group_takes_the_timeout(monkeypatch) -> None:
    """N14: nothing reduces over the pipeline ranks, so no communicator is made for them; L1: the groups
    made later (the checkpoint's gloo group) take --distributed-timeout-minutes too."""
    made: list[tuple[tuple[int, ...] | None, dict]] = []
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append((ranks and tuple(ranks), kw)) or "g")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collective, "_GROUP", [])
    monkeypatch.setattr(ps, "_TIMEOUT", [None])
    timeout = datetime.timedelta(minutes=3)
    st = build_state(Axes(tensor=2, data=2, pipeline=2), torch.device("cpu"), timeout=timeout)
    groups = layout_groups(2, 2, 2)
    expect = [tuple(r) for name in ("tensor", "data", "embedding", "model") for r in groups[name]]
    assert [m[0] for m in made] == expect and not hasattr(st, "pp_group")
    assert st.pipeline_ranks == [0, 4] and st.groups.model == "g"
    assert group_timeout() == timeout and all(kw["timeout"] == timeout for _, kw in made)
    made.clear()
    collective.checkpoint_group()
    assert made == [(None, {"backend": "gloo", "timeout": timeout})]


def test_fused_or_flash_attention_with_gqa_and_a_mask_or_fp32_is_refused_on_cuda(capsys) -> None:
    """N8: on CUDA only SDPA's flash kernel takes grouped key/value heads, and flash takes no mask and no
    fp32: ``fused``/``flash`` would fail at the first forward. Refused in one line at start-up."""
    from dataclasses import replace

    import pytest

    from megatron_2bw.cli import build_config, parse_args
    from megatron_2bw.errors import ConfigError

    base = ["--model-preset", "gpt-tiny", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
            "--device", "cpu", "--data-path", "d", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
            "t.model", "--group-query-attention", "--num-query-groups", "1"]

    def on_cuda(extra: list[str], dtype: str = "bf16"):
        cfg = build_config(parse_args([*base, *extra], "gpt"), "gpt", 1)  # the CPU accepts every one of these
        system = replace(cfg.system, device="cuda", backend="nccl")
        return replace(cfg, system=system, optimizer=replace(cfg.optimizer, dtype=dtype))

    with pytest.raises(ConfigError, match="--attention-backend fused with grouped-query attention and fp32"):
        on_cuda(["--attention-backend", "fused"], "fp32")
    with pytest.raises(ConfigError, match="--attention-backend flash in fp32 on CUDA"):
        on_cuda(["--attention-backend", "flash"], "fp32")
    with pytest.raises(ConfigError, match="fused with grouped-query attention and --reset-attention-mask's mask"):
        on_cuda(["--attention-backend", "fused", "--reset-attention-mask"])
    on_cuda(["--attention-backend", "fused"])  # bf16, no mask: flash takes it
    on_cuda(["--attention-backend", "unfused", "--reset-attention-mask"], "fp32")
    on_cuda(["--attention-backend", "auto"], "fp32")
    mha = base[:-3]
    cfg = build_config(parse_args([*mha, "--attention-backend", "fused", "--reset-attention-mask"], "gpt"), "gpt", 1)
    replace(cfg, system=replace(cfg.system, device="cuda", backend="nccl"))  # no GQA: the other kernels take it
    cfg = build_config(parse_args([*mha, "--attention-backend", "flash"], "gpt"), "gpt", 1)
    cuda = replace(cfg.system, device="cuda", backend="nccl")
    with pytest.raises(ConfigError, match="flash in fp32 on CUDA"):
        replace(cfg, system=cuda, optimizer=replace(cfg.optimizer, dtype="fp32"))
    replace(cfg, system=cuda, optimizer=replace(cfg.optimizer, dtype="bf16"))


def test_speculation_reuses_its_copies(monkeypatch) -> None:
    """N18: post-validation's copy of the master and the optimizer state goes into buffers kept from one
    speculated step to the next (the rollback results stay bitwise: tests/test_post_validation.py)."""
    import sys

    sys.path.insert(0, __import__("os").path.dirname(__file__))
    from pipeline_harness import train_tiny

    from megatron_2bw.pipeline import updater as up

    seen: list[list] = []  # the copies themselves (kept alive: fresh ones could not share an address)
    original = up.Updater.speculate

    def speculate(self, step: int, lr: float) -> None:
        original(self, step, lr)
        _, kept, snap = self._backup
        seen.append([kept, *(t for s in snap["spans"].values() for t in s)])

    monkeypatch.setattr(up.Updater, "speculate", speculate)
    out = train_tiny("zb-h2", steps=6, global_batch=4, lr=1e-3, post_validation=True)
    exact = train_tiny("zb-h2", steps=6, global_batch=4, lr=1e-3)
    assert len(seen) >= 3 and all(a is b for later in seen[1:] for a, b in zip(later, seen[0], strict=True))
    assert out["losses"] == exact["losses"]
