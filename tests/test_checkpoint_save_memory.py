"""A checkpoint save copies no engine state on the stage's device (gpu-review C4, issue 21 item 4).

The bytes a save allocates are counted by a dispatch mode that sees every aten op: each output
tensor whose storage is new (not an alias of an input) is an allocation. On the CPU, where the
stage's device is the host, a save of the replicated state must allocate (almost) nothing, since
the payload is views of the live buffers; with the distributed optimizer, data-parallel rank 0 may
allocate the host tensors it gathers the fp32 state into and nothing more (no device-sized
``w``-fold receive buffers, no concatenation). Before the fix a save allocated 14-16 B/parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from multiproc import run_workers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_2bw.checkpoint import checkpointing as ck
from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import ParallelState, build_state
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.executor import PipelineRank
from megatron_2bw.pipeline.weights import GlobalNames
from megatron_2bw.pipeline.zero import ShardLayout, gather_full
from megatron_2bw.tensor_parallel.random import RNGTracker

CPU = torch.device("cpu")


class Allocations(TorchDispatchMode):
    """Bytes of every new storage an aten op returns, by op name (views and in-place results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                name = str(func.overloadpacket.__name__)
                self.by_op[name] = self.by_op.get(name, 0) + t.untyped_storage().nbytes()
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def _stage(state: ParallelState, dtype: str = "bf16", zero: bool = False) -> PipelineRank:
    cfg = get_preset("gpt-tiny")
    tracker = RNGTracker(7, 0)
    spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker)
    stage = build_stage(lambda: spec.build_stage(1, 0), spec.loss_fn(), state,
                          PipelineConfig("2bw", 1, 2),
                         OptimizerConfig("adam", lr=1e-2, dtype=dtype, use_distributed_optimizer=zero),
                          (1, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker, names=GlobalNames(0, tied=WORD))
    data = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    stage.train(2, lambda mb: spec.make_batch(data[mb % 8:mb % 8 + 1]), lambda t: 1e-2)
    stage.spec = spec
    return stage


def _payload(stage: PipelineRank) -> dict | None:
    cfg = {"model": stage.spec.cfg.__dict__, "optimizer": stage.opt.__dict__, "pipeline": {"layer_split": None}}
    return ck.payload(stage, iteration=2, tracker=stage.rng, consumed_samples=8, global_batch=4, config=cfg,
                      args={"micro_batch_size": 1})


def _state_bytes(stage: PipelineRank) -> int:
    u = stage.updater
    return stage.weights.weight_bytes + u.master_bytes + u.state_bytes


def test_a_save_allocates_no_copy_of_the_replicated_state():
    stage = _stage(ParallelState.single())
    with Allocations() as alloc:
        sd = _payload(stage)
    state = _state_bytes(stage)
    assert state > 500_000
    # before C4's fix: 16 B/param for 2BW bf16 (both versions, master, Adam moments cloned)
    assert alloc.total < 0.02 * state, (alloc.total, state, alloc.by_op)
    # the payload holds the live values, which the file then carries (CPU results identical)
    w, u = stage.weights, stage.updater
    named = sd["stage"]
    for name, view in w.state_views(u.master).items():
        assert named["master"][name].data_ptr() == view.data_ptr()
    newest = w.state_views(w.flat[w.slot(stage.step)])
    older = w.state_views(w.flat[w.slot(stage.step - 1)])
    assert all(torch.equal(named["older"][n], older[n]) for n in older)
    assert all(torch.equal(named["optimizer"]["exp_avg"][n], v) for n, v in w.state_views(u.optimizer.exp_avg).items())
    assert any(not torch.equal(newest[n], older[n]) for n in newest)


def test_a_snapshot_state_dict_still_copies():
    """``state_dict()`` (copy=True: reload in tests, the harness) keeps snapshot semantics."""
    stage = _stage(ParallelState.single(), dtype="fp32")
    sd = stage.state_dict()
    assert all(v.data_ptr() != f.data_ptr() for v, f in zip(sd["versions"], stage.weights.flat))
    assert sd["optimizer"]["exp_avg"].data_ptr() != stage.updater.optimizer.exp_avg.data_ptr()


def test_a_torch_format_resume_reads_the_file_in_place(tmp_path):
    """The file is memory-mapped and each state family is a view of it, copied once into the live
    buffers: a resume allocates no second copy of the state (before: the file in RAM, then every family
    concatenated into a new flat buffer, 2x the state). The restored state equals the saved one."""
    saved = _stage(ParallelState.single())
    state = ParallelState.single()
    ck.save(str(tmp_path), 2, state, lambda: _payload(saved))
    fresh = _stage(state)  # the same two steps: perturbed, so that the restore has to write every value
    for f in fresh.weights.flat:
        f.add_(1.0)
    sd = ck.load_rank_file(str(tmp_path), 2, 1, 1, 0, 0)
    path = ck.checkpoint_path(str(tmp_path), 2, 0, 0, 1)
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        assert path in f.read()  # the tensors are the file's pages
    with Allocations() as alloc:
        ck.restore(sd, fresh, fresh.rng, CPU)
    assert alloc.total < 0.02 * _state_bytes(saved), alloc.by_op
    assert all(torch.equal(a, b) for a, b in zip(fresh.weights.flat, saved.weights.flat))
    assert torch.equal(fresh.updater.master, saved.updater.master)
    assert torch.equal(fresh.updater.optimizer.exp_avg_sq, saved.updater.optimizer.exp_avg_sq)


def _zero_case() -> dict:
    rank, w = dist.get_rank(), dist.get_world_size()
    state = build_state(Axes(data=w), CPU)
    stage = _stage(state, zero=True)
    assert stage.updater.shard is not None
    reference = stage.updater.state_dict(everywhere=True)  # the all-gathered state, on every rank
    with Allocations() as alloc:
        sd = _payload(stage)
    out = {"rank": rank, "alloc": alloc.total, "by_op": alloc.by_op, "numel": stage.weights.numel,
           "state": _state_bytes(stage)}
    if sd is not None:
        w_ = stage.weights
        flat = lambda named: torch.cat([named[n].reshape(-1) for n in w_.global_names])  # noqa: E731
        st = sd["stage"]
        out["equal"] = (torch.equal(flat(st["master"]), reference["master"])
                        and all(torch.equal(flat(st["optimizer"][k]), reference["optimizer"][k])
                                for k in ("exp_avg", "exp_avg_sq")))
    # a gather in pieces smaller than a shard (several messages per rank) assembles the same tensor
    import megatron_2bw.pipeline.zero as zero

    zero.GATHER_CHUNK, chunk = 1000, zero.GATHER_CHUNK
    try:
        shard = stage.updater.optimizer.exp_avg_sq
        layout = ShardLayout(stage.weights.numel, w, state.dp_rank)
        small = gather_full(shard, layout, state.groups.dp, everywhere=False)
    finally:
        zero.GATHER_CHUNK = chunk
    if small is not None:
        out["chunked_equal"] = torch.equal(small, reference["optimizer"]["exp_avg_sq"])
    return out


def test_distributed_optimizer_gathers_into_host_memory_only():
    runs = run_workers(_zero_case, 2, timeout=300)
    first, other = runs
    n = first["numel"]
    gathered = 3 * 4 * n  # fp32 master + two Adam moments, whole, on data-parallel rank 0's host
    assert first["equal"] and first["chunked_equal"]
    # before the fix: w shard-sized receive buffers per state, a concatenation, clones of both versions
    assert first["alloc"] <= gathered + 0.02 * first["state"], (first["alloc"], gathered, first["by_op"])
    assert "cat" not in first["by_op"] and first["by_op"].get("clone", 0) < 65536, first["by_op"]  # (RNG states)
    assert other["alloc"] < 0.02 * other["state"], other["by_op"]


# ---- the planner's memory model counts a save ----------------------------------------------------
def test_memory_model_counts_the_save_buffer_and_refuses_a_plan_it_does_not_fit():
    """A save at a drained boundary: no activations, the distributed optimizer's gather buffer of
    min(shard, CKPT_GATHER_CHUNK) fp32 elements on data-parallel rank 0; replicated: nothing."""
    from dataclasses import replace

    from megatron_2bw.config import CKPT_GATHER_CHUNK
    from megatron_2bw.planner.layer_costs import BlockCost, MicrobatchCosts
    from megatron_2bw.planner.memory_model import Candidate, stage_memory

    big = MicrobatchCosts(  # 2 layers of 2**25 params per stage (d = 2), activations of 1 KB
        layer=BlockCost(1.0, 2.0, params=1 << 25, stash_bytes=1000, input_bytes=100, output_bytes=100),
        embedding=BlockCost(0.0, 0.0, params=0, stash_bytes=0, input_bytes=0, output_bytes=100),
        head=BlockCost(0.5, 1.0, params=0, stash_bytes=0, input_bytes=100, output_bytes=0),
    )
    base = Candidate(1, 2, 2, 1, 2, False, "2bw")
    whole, zero = stage_memory(big, base, 4, 0), stage_memory(big, replace(base, distributed_optimizer=True), 4, 0)
    assert whole.save == 0 and whole.total == whole.weights + whole.second_weights + whole.grads + whole.optimizer + \
        whole.activations + whole.workspace
    shard = -(-(2 << 25) // 2)
    assert zero.save == 4 * min(shard, CKPT_GATHER_CHUNK) == 64 * 2**20  # bounded: 64 MiB, not the state
    assert zero.save > zero.activations + zero.workspace  # here the save is the peak ...
    static = zero.weights + zero.second_weights + zero.grads + zero.optimizer
    assert zero.total == static + zero.save  # ... so a device of less than this refuses the plan
    small = stage_memory(big, replace(base, distributed_optimizer=True, data_parallel=1), 4, 0)
    assert small.save == 0  # w = 1: nothing to gather


def test_memory_model_counts_the_async_save_host_copy():
    """``--async-save``'s host buffers hold one copy of what the rank writes: the model's ``host_save``
    equals the staging buffers a real save allocates (bf16 2BW Adam: two versions, master, moments =
    16 B/param), is 1/w of that per replica, and stays out of the device total."""
    from dataclasses import replace

    from megatron_2bw.checkpoint import dist_checkpoint as dc
    from megatron_2bw.planner.layer_costs import BlockCost, MicrobatchCosts
    from megatron_2bw.planner.memory_model import Candidate, ParamBytes, async_save_host_bytes, stage_memory

    stage = _stage(ParallelState.single())
    writer = dc.AsyncWriter()
    writer.staging.stage(dc.save_chunks(stage, stage.spec.cfg))
    real = sum(b.numel() * b.element_size() for b in writer.staging.buffers.values())
    one = Candidate(1, 1, 1, 1, 2, False, "2bw", async_save=True)
    bf16 = ParamBytes.for_precision("bf16")
    assert async_save_host_bytes(stage.weights.numel, one, bf16) == real == 16 * stage.weights.numel

    costs = MicrobatchCosts(
        layer=BlockCost(1.0, 2.0, params=1 << 20, stash_bytes=1000, input_bytes=100, output_bytes=100),
        embedding=BlockCost(0.0, 0.0, params=0, stash_bytes=0, input_bytes=0, output_bytes=100),
        head=BlockCost(0.5, 1.0, params=0, stash_bytes=0, input_bytes=100, output_bytes=0))
    base = Candidate(1, 2, 2, 1, 2, False, "2bw", distributed_optimizer=True)
    plain, copy = stage_memory(costs, base, 4, 0, bf16), stage_memory(costs, replace(base, async_save=True), 4, 0, bf16)
    assert plain.host_save == 0 and copy.host_save == (2 << 20) // 2 * 16  # 2 layers per stage, w = 2
    assert copy.total == plain.total  # host memory: not the device's


def test_checkpoint_format_flags_are_validated():
    """``--ckpt-format`` takes Megatron's names; ``--async-save`` needs torch_dist and --save (one line each)."""
    import pytest

    from megatron_2bw.config import TrainingConfig
    from megatron_2bw.errors import ConfigError

    assert TrainingConfig(1, 1).ckpt_format == "torch"
    TrainingConfig(1, 1, save="s", ckpt_format="torch_dist", async_save=True)
    for kw, text in (({"ckpt_format": "zarr"}, "--ckpt-format must be one of torch, torch_dist"),
                     ({"save": "s", "async_save": True}, "--async-save needs --ckpt-format torch_dist"),
                     ({"ckpt_format": "torch_dist", "async_save": True}, "--async-save needs --save DIR")):
        with pytest.raises(ConfigError, match=text):
            TrainingConfig(1, 1, **kw)


def test_a_torch_dist_save_writes_items_of_bounded_size_and_resumes_bitwise(tmp_path, monkeypatch):
    """A save cuts every tensor into DCP items of at most ``MAX_CHUNK_BYTES`` (the reader loads each item
    it overlaps whole before copying it into place: this bounds a resume's read buffer), and a resume
    from those items gives back every state family bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_2bw.checkpoint import dist_checkpoint as dc
    from megatron_2bw.checkpoint.dist_checkpoint import shard_map

    limit = 4096
    monkeypatch.setattr(shard_map, "MAX_CHUNK_BYTES", limit)
    saved = _stage(ParallelState.single())
    cfg = {"model": saved.spec.cfg.__dict__, "optimizer": saved.opt.__dict__, "pipeline": {"layer_split": None}}
    common = dc.common_state(saved, iteration=2, config=cfg, args={}, consumed_samples=8, global_batch=4)
    path = dc.save(str(tmp_path), 2, saved, saved.rng, common)
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    items = [(c, m.properties.dtype) for m in md.values() if isinstance(m, TensorStorageMetadata) for c in m.chunks]
    sizes = [torch.Size(c.sizes).numel() * torch.empty((), dtype=dt).element_size() for c, dt in items]
    tensors = sum(isinstance(m, TensorStorageMetadata) for m in md.values())
    assert max(sizes) <= limit and len(items) > 2 * tensors, (max(sizes), len(items), tensors)
    assert sum(sizes) == _state_bytes(saved)  # every byte of the state, once

    fresh = _stage(ParallelState.single())
    for f in fresh.weights.flat:
        f.add_(1.0)
    fresh.updater.optimizer.exp_avg.add_(1.0)
    sd = dc.read_checkpoint(str(tmp_path), 2, 0, 1, (1, 1, 1, None))
    dc.restore(sd, fresh, fresh.rng, CPU)
    assert all(torch.equal(a, b) for a, b in zip(fresh.weights.flat, saved.weights.flat))
    assert torch.equal(fresh.updater.master, saved.updater.master)
    assert torch.equal(fresh.updater.optimizer.exp_avg, saved.updater.optimizer.exp_avg)
    assert torch.equal(fresh.updater.optimizer.exp_avg_sq, saved.updater.optimizer.exp_avg_sq)


def _bounded_d2_save(root: str) -> dict:
    """Rank r of d = 2 trains two steps and saves torch_dist in items of at most 2 KiB; returns its state
    by global name."""
    from megatron_2bw.checkpoint import dist_checkpoint as dc
    from megatron_2bw.checkpoint.dist_checkpoint import shard_map

    shard_map.MAX_CHUNK_BYTES = 2048
    state = build_state(Axes(pipeline=2), CPU)
    cfg = get_preset("gpt-tiny")
    tracker = RNGTracker(7, 0)
    spec = ModelSpec(cfg, ModelGroups(), 1234, rng=tracker)
    opt = OptimizerConfig("adam", lr=1e-2, dtype="bf16")
    stage = build_stage(lambda: spec.build_stage(2, state.pp_rank), spec.loss_fn(), state,
                          PipelineConfig("2bw", 1, 2), opt, (1, cfg.seq_length, cfg.hidden_size), rng_tracker=tracker,
                          names=GlobalNames(spec.stage_range(2, state.pp_rank)[0], tied=WORD))
    data = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    stage.train(2, lambda mb: spec.make_batch(data[mb % 8:mb % 8 + 1]), lambda t: 1e-2)
    conf = {"model": cfg.__dict__, "optimizer": opt.__dict__, "pipeline": {"layer_split": None}}
    dc.save(root, 2, stage, tracker, dc.common_state(stage, iteration=2, config=conf, args={}, consumed_samples=8,
                                                     global_batch=4))
    w, u = stage.weights, stage.updater
    return {"model": dict(w.state_views(w.flat[w.slot(stage.step)])), "master": dict(w.state_views(u.master)),
            "exp_avg_sq": dict(w.state_views(u.optimizer.exp_avg_sq))}


def test_bounded_items_reshard_on_load(tmp_path):
    """A d = 2 save cut into 2 KiB items resumes at d = 1 (load-time resharding): every parameter of the
    single stage equals the saved stages' values, so each piece sits at its global offset."""
    import torch.distributed.checkpoint as dcp

    from megatron_2bw.checkpoint import dist_checkpoint as dc

    stages = run_workers(_bounded_d2_save, 2, str(tmp_path), timeout=300)
    fresh = _stage(ParallelState.single())
    sd = dc.read_checkpoint(str(tmp_path), 2, 0, 1, (1, 1, 1, None))
    assert not sd["same_layout"]
    md = dcp.FileSystemReader(sd["path"]).read_metadata().state_dict_metadata
    for key in ("model", "master", "optimizer.exp_avg_sq"):  # bf16, fp32, fp32
        word = next(m for k, m in md.items() if k.startswith(key + "/") and "word" in k)
        size = word.properties.dtype.itemsize
        assert len(word.chunks) > 10 and max(torch.Size(c.sizes).numel() * size for c in word.chunks) <= 2048, key
    dc.restore(sd, fresh, fresh.rng, CPU)
    w, u = fresh.weights, fresh.updater
    got = {"model": w.state_views(w.flat[w.slot(fresh.step)]), "master": w.state_views(u.master),
           "exp_avg_sq": w.state_views(u.optimizer.exp_avg_sq)}
    names = set()
    for family, views in got.items():
        for saved in stages:
            for name, want in saved[family].items():
                assert torch.equal(views[name], want), (family, name)
                names.add(name)
    assert names == set(w.global_names)  # the two stages cover the whole model
