"""The distributed optimizer (``--use-distributed-optimizer``, ZeRO-1) trains like the unsharded one.

Each case trains the same layout twice, without and with the distributed optimizer, and compares.
Sharded and unsharded runs are two code paths: each shard runs the unsharded elementwise update on
a slice, but torch's fused CPU AdamW computes the last (length mod vector width) elements of each
call with scalar code, and which elements fall in that tail depends on the shard boundaries and on
the CPU's vector width (AVX2, AVX-512, NEON, SVE). Those elements can differ in the last bit
(2**-24 relative) per step, so the comparisons are tolerances derived from that arithmetic, not
bitwise (bitwise equality is kept for same-path replays: resume, recomputation):
- fp32 at w=2 with clipping inactive, every schedule: losses within 1e-6 relative, weights within
  1e-6 of the stage's largest weight (a few last-bit differences per step over three Adam steps at
  lr 1e-3; a wrong shard offset or a missed element moves weights by about lr, 1e-3);
- clipping active: the same bounds (the global norm is summed in another order);
- bf16 (fp32 master sharded): the same bounds on the fp32 arithmetic, bf16 losses within 1e-6;
- fp32 at w=4 (a four-term reduce-scatter adds in another order than the all-reduce): weights within
  1e-5 (Adam divides by the root of tiny moments);
- per-rank bytes of master and optimizer state: ceil(N/w)-element shards, exactly.
An updater-level case at an N that w does not divide (padding, the decay prefix split across
ranks, an overflow skip, several buckets) uses integer gradients, whose sums are exact in any
order, and SGD's update has no vector tail, so the sharded SGD update equals the unsharded one
bitwise at w=4; Adam there within 1e-6 relative.
"""

from __future__ import annotations

import contextlib
import functools
import shutil

import ckpt_runs
import pipeline_harness
import pytest
import torch
import torch.distributed as dist
from ckpt_runs import _ckpt_data  # noqa: F401 - the autouse fixture that builds the corpus
from e2e import read_metrics, train_losses
from multiproc import run_workers

from megatron_2bw.checkpoint import checkpointing as ckpt
from megatron_2bw.config import OptimizerConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.parallel_state import build_state
from megatron_2bw.pipeline.grad_reducer import GradReducer
from megatron_2bw.pipeline.updater import Updater
from megatron_2bw.pipeline.weights import sized_weights
from megatron_2bw.pipeline.zero import ShardLayout

SCHEDULES = ("2bw", "flush", "gpipe")
KW = dict(steps=3, lr=1e-3)
DIST = "--use-distributed-optimizer"


@contextlib.contextmanager
def _distributed_optimizer(on: bool):
    """train_tiny builds its OptimizerConfig itself: give it the flag."""
    original = pipeline_harness.OptimizerConfig
    pipeline_harness.OptimizerConfig = functools.partial(original, use_distributed_optimizer=on)
    try:
        yield
    finally:
        pipeline_harness.OptimizerConfig = original


def _pair(schedule: str, layout, **kw) -> list[dict]:
    out = []
    for on in (False, True):
        with _distributed_optimizer(on):
            out.append(pipeline_harness.train_tiny(schedule, layout=layout, **{**KW, **kw}))
    return out


def _cases(_) -> dict:
    """One launch of four processes: d=2 w=2 (tied embedding across stages), t=2 d=1 w=2, d=1 w=4."""
    out = {}
    for s in SCHEDULES:
        out[(1, 2, 2), s] = _pair(s, (1, 2, 2), clip=1e3)
    out[(1, 2, 2), "clip"] = _pair("2bw", (1, 2, 2), clip=0.05)
    out[(1, 2, 2), "bf16"] = _pair("2bw", (1, 2, 2), clip=1e3, dtype="bf16")
    out[(1, 2, 2), "dc"] = _pair("2bw", (1, 2, 2), clip=1e3, compensation="dc", dc_lambda=1e4)
    out[(2, 1, 2), "flush"] = _pair("flush", (2, 1, 2), clip=1e3)
    out[(1, 1, 4), "2bw"] = _pair("2bw", (1, 1, 4), clip=1e3)
    out["updater"] = _updater_case()
    with _distributed_optimizer(True):  # drained after step 1, its state gathered, loaded into a new stage
        out["reload"] = pipeline_harness.train_tiny("2bw", layout=(1, 2, 2), clip=1e3, segments=(1, 2), reload=True,
                                                    **KW)
    return out


# --------------------------------------------------------------------------- updater-level, odd N
N_ODD, STEPS = 1001, 4


def _int_grad(step: int, rank: int) -> torch.Tensor:
    g = torch.randint(-64, 65, (N_ODD,), generator=torch.Generator().manual_seed(100 * step + rank)).float() / 256
    if step == 1 and rank == 2:
        g[7] = float("inf")  # step 1 overflows: skipped on every rank
    return g


def _run_updater(w: int, rank: int, group, optimizer: str) -> dict:
    """STEPS Adam updates of a two-version stand-in stage; ``group`` None: the unsharded reference."""
    weights = sized_weights(N_ODD, dtype=torch.float32, device=torch.device("cpu"), num_versions=2,
                            params_per_view=100, shards=w if group is not None else 1)
    init = torch.randn(N_ODD, generator=torch.Generator().manual_seed(7))
    for f in weights.flat:
        f.copy_(init)
    shard = ShardLayout(N_ODD, w, rank) if group is not None else None
    red = GradReducer(dp_group=group, embedding_group=None, model_group=None, replicas=w if group else 1,
                      shared_range=None, bucket_numel=4 * 64, has_embedding_group=False, shard=shard)
    opt = OptimizerConfig(optimizer, lr=1e-2, weight_decay=0.1, clip_grad=0.0, sgd_momentum=0.9)
    upd = Updater(weights, opt, "none", 0.0, reducer=red)
    skipped = []
    for t in range(STEPS):
        b = weights.grad_buffer(t)
        weights.grad_flat[b].copy_(_int_grad(t, rank) if group is not None else sum(_int_grad(t, r) for r in range(w)))
        red.start(t, weights.padded_grad[b], weights.norm_views[b])
        skipped.append(upd.apply(t, red.finish(t), 1e-2).skipped)
    red.wait_all()
    return {"newest": weights.flat[weights.slot(STEPS)].clone(), "older": weights.flat[weights.slot(STEPS - 1)].clone(),
            "state": upd.state_dict(), "skipped": skipped, "state_bytes": upd.state_bytes}


def _updater_case() -> dict:
    rank, w = dist.get_rank(), dist.get_world_size()
    state = build_state(Axes(data=w), torch.device("cpu"))
    return {o: {"sharded": _run_updater(w, state.dp_rank, state.groups.dp, o),
                "reference": _run_updater(w, rank, None, o)} for o in ("sgd", "adam")}


# --------------------------------------------------------------------------- checks
def _numel(run: dict) -> int:
    return sum(p.numel() for p in run["params"].values())


def _max_rel(a: dict, b: dict) -> float:
    """Largest weight difference relative to the largest weight of the stage."""
    diff = max((a["params"][k] - b["params"][k]).abs().max().item() for k in b["params"])
    return diff / max(v.abs().max().item() for v in b["params"].values())


# Bounds for sharded vs unsharded (module docstring): last-bit differences of the fused AdamW tail.
LOSS_REL, WEIGHT_REL = 1e-6, 1e-6


def _assert_same_update(plain: list[dict], zero: list[dict], what, weight_rel: float = WEIGHT_REL) -> None:
    """The sharded run against the unsharded one: the same skips, losses, norms and weights up to the
    rounding of the vector tail (module docstring)."""
    for p, z in zip(plain, zero):
        assert p["skipped"] == z["skipped"], what
        assert (p["losses"] is None) == (z["losses"] is None), what
        if p["losses"] is not None:
            assert len(p["losses"]) == len(z["losses"]), what
            assert max(abs(a - b) / abs(b) for a, b in zip(p["losses"], z["losses"])) <= LOSS_REL, \
                (what, p["losses"], z["losses"])
        assert p["params"].keys() == z["params"].keys()
        assert _max_rel(z, p) <= weight_rel, (what, _max_rel(z, p))
        for a, b in zip(p["norms"], z["norms"]):
            assert abs(a - b) <= 1e-6 * abs(a), (what, a, b)


def _assert_sharded_bytes(plain: list[dict], zero: list[dict], w: int, master: bool) -> None:
    """Optimizer state (Adam: two fp32 moments) and master: ceil(N/w) elements per rank."""
    for p, z in zip(plain, zero):
        n = _numel(p)
        s = -(-n // w)
        assert p["stats"]["optimizer_bytes"] == 8 * n and z["stats"]["optimizer_bytes"] == 8 * s
        weights_only = p["stats"]["weight_bytes"] - (4 * n if master else 0)
        assert z["stats"]["weight_bytes"] == weights_only + (4 * s if master else 0)


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers(_cases, 4, None, timeout=300)


def _split(runs: list[dict], key) -> tuple[list[dict], list[dict]]:
    return [o[key][0] for o in runs], [o[key][1] for o in runs]


def test_w2_fp32_equal_for_every_schedule_and_sharded_bytes(runs):
    for key in [(((1, 2, 2), s)) for s in SCHEDULES] + [((2, 1, 2), "flush")]:
        plain, zero = _split(runs, key)
        _assert_same_update(plain, zero, key)
        _assert_sharded_bytes(plain, zero, 2, master=False)


def test_w2_dc_compensation_equal(runs):
    """``--2bw-compensation dc`` corrects each shard with the own range of both versions: elementwise, so
    the same update (a lambda large enough that the correction changes the weights)."""
    plain, zero = _split(runs, ((1, 2, 2), "dc"))
    _assert_same_update(plain, zero, "dc")
    assert any(not torch.equal(p["params"][k], q["params"][k])
               for p, q in zip(plain, _split(runs, ((1, 2, 2), "2bw"))[0]) for k in p["params"])


def test_w2_bf16_sharded_master_equal(runs):
    """Each shard runs the unsharded fp32 master arithmetic, and the two-term sums are exact: the bounds
    of the vector tail only."""
    plain, zero = _split(runs, ((1, 2, 2), "bf16"))
    _assert_same_update(plain, zero, "bf16")
    _assert_sharded_bytes(plain, zero, 2, master=True)


def test_w2_clipping_active_within_1e_6(runs):
    """The global norm is summed in another order (shard by shard), so the clipping factor differs in the
    last bit: losses and weights (relative to the stage's largest weight) within 1e-6."""
    plain, zero = _split(runs, ((1, 2, 2), "clip"))
    for p, z in zip(plain, zero):
        if p["losses"] is not None:
            assert max(abs(a - b) / abs(b) for a, b in zip(p["losses"], z["losses"])) < 1e-6
        assert _max_rel(z, p) < 1e-6, _max_rel(z, p)
        assert any(n > 0.05 for n in p["norms"])  # clipping did act


def test_w4_within_summation_order(runs):
    """A four-term reduce-scatter adds in another order than the all-reduce: losses within 1e-6,
    weights within 1e-5 of the stage's largest weight (Adam divides by the root of tiny moments)."""
    plain, zero = _split(runs, ((1, 1, 4), "2bw"))
    _assert_sharded_bytes(plain, zero, 4, master=False)
    for p, z in zip(plain, zero):
        if p["losses"] is not None:
            assert max(abs(a - b) for a, b in zip(p["losses"], z["losses"])) < 1e-6
        assert _max_rel(z, p) < 1e-5, _max_rel(z, p)


def test_resume_into_sharded_stage(runs):
    """The gathered (unsharded) state of a sharded stage, loaded into a new sharded stage (each rank takes
    its shard), trains on like the uninterrupted unsharded run (the bounds of the vector tail)."""
    plain = [o[(1, 2, 2), "2bw"][0] for o in runs]
    _assert_same_update(plain, [o["reload"] for o in runs], "reload")


def test_padded_shards_and_overflow_skip(runs):
    s = -(-N_ODD // 4)
    for o in runs:
        for name, moments in (("sgd", 1), ("adam", 2)):
            got, ref = o["updater"][name]["sharded"], o["updater"][name]["reference"]
            assert got["skipped"] == ref["skipped"] == [False, True, False, False]
            tensors = [(got["newest"], ref["newest"]), (got["older"], ref["older"])]
            tensors += [(got["state"]["optimizer"][k], v) for k, v in ref["state"]["optimizer"].items()
                        if isinstance(v, torch.Tensor)]
            assert got["state"]["optimizer"]["steps"] == ref["state"]["optimizer"]["steps"] == STEPS - 1
            for a, b in tensors:
                assert torch.equal(a, b) if name == "sgd" else torch.allclose(a, b, rtol=1e-6, atol=0), name
            assert got["state_bytes"] == moments * 4 * s and ref["state_bytes"] == moments * 4 * N_ODD


# --------------------------------------------------------------------------- checkpoints across widths
def _engine_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint file's weights and engine state, by a flattened key."""
    sd = torch.load(path, map_location="cpu", weights_only=False)
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, torch.Tensor):
            out[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    walk("model", sd["model"])
    walk("stage", sd["stage"])
    return out


def _resume(saved: ckpt_runs.Saved, tmp_path, name: str, iteration: int, nproc: int, extra: tuple[str, ...]) -> dict:
    """Train on from ``saved``'s checkpoint at ``iteration`` to its end; the resumed run's losses."""
    load = str(tmp_path / name)
    shutil.copytree(ckpt.iteration_dir(saved.save, iteration), ckpt.iteration_dir(load, iteration))
    ckpt.write_tracker(load, iteration)
    metrics = str(tmp_path / f"{name}.jsonl")
    args = [*ckpt_runs.gpt_args(iters=4, schedule="2bw", extra=extra), "--load", load, "--metrics-file", metrics]
    res = ckpt_runs.train(args, nproc=nproc)
    assert res.returncode == 0, res.describe()
    return train_losses(read_metrics(metrics))


def test_checkpoint_loads_at_any_width_with_or_without_the_distributed_optimizer(tmp_path_factory, tmp_path):
    """A run with the distributed optimizer at w=2 trains and saves the same as one without it (the
    unsharded format: the same tensors, equal up to the fused AdamW tail's last bits, see the module
    docstring), and its checkpoint resumes at w=1 (where the flag is the unsharded optimizer).
    Loading an unsharded state into a sharded stage: ``test_resume_into_sharded_stage``."""
    zero = ckpt_runs._saved_run(tmp_path_factory, "zero_w2", ckpt_runs.gpt_args(iters=4, extra=(DIST,)), 2, 2)
    plain = ckpt_runs._saved_run(tmp_path_factory, "plain_w2", ckpt_runs.gpt_args(iters=4), 2, 2)
    straight, unsharded = train_losses(zero.metrics), train_losses(plain.metrics)
    assert sorted(straight) == sorted(unsharded) == [0, 1, 2, 3]
    assert all(abs(straight[k] - unsharded[k]) <= LOSS_REL * abs(unsharded[k]) for k in straight), (straight, unsharded)
    a = _engine_tensors(ckpt.checkpoint_path(zero.save, 2, 0, 0, 1))
    b = _engine_tensors(ckpt.checkpoint_path(plain.save, 2, 0, 0, 1))
    assert a.keys() == b.keys() and any("exp_avg" in k for k in a)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    # Adam's moments: exp_avg_sq of a near-zero gradient is tiny, so each tensor is compared against its
    # own largest magnitude (a misplaced shard differs by the tensor's scale, not its last bits)
    for k in a:
        if a[k].is_floating_point() and a[k].numel():
            scale = b[k].abs().max().item() or 1.0
            assert (a[k] - b[k]).abs().max().item() <= 1e-5 * scale, k
        else:
            assert torch.equal(a[k], b[k]), k
    # the sharded run's checkpoint at w=1: the same file as the plain one, so the same run as a plain
    # resume; against the w=2 run, only the order of the four microbatch gradients' sum differs
    one = _resume(zero, tmp_path, "zero_to_w1", 2, 1, (DIST,))
    assert sorted(one) == [2, 3] and all(abs(one[k] - straight[k]) < 1e-5 for k in one), (one, straight)
