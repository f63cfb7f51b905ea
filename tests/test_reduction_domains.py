"""Parameters in two reduction domains (issue 41, item 1): the data group and its expert-data subgroup.

A test model of two layers, each with a dense matrix and bias (domain ``dp``: replicas over the whole data
group) and an expert matrix of E rows split over the expert axis (domain ``edp``: rank j of the data group
holds piece ``j % e``, reduced over the ranks with the same piece, Megatron-Core's folding of expert
parallelism inside the data group). One launch of four gloo processes runs every cell:

- d = 2, w = 2, e = 2, with and without the distributed optimizer, flush schedule, SGD with clipping active:
  each step's reduced gradient on every segment (this rank's shard of it when sharded), the global norm and
  the updated weights equal a reference computed here by hand from the named groups: every rank's own
  gradient by autograd on the unsharded model (float64), summed over the data group for the dense
  parameters and over the expert-data group for each expert piece, the norm counting every value once
  (each piece once, not once per replica). fp32 against float64: within 1e-6 relative.
- d = 2, w = 2, e = 2, 2BW and Adam, with and without the distributed optimizer: trained 1 step, saved in
  the torch_dist format, restored into a fresh stage, trained 2 more steps: losses and weights bitwise
  those of the uninterrupted 3 steps (the torch format at e > 1: tests/test_moe_checkpoint_torch.py).
- the distributed-optimizer checkpoint restored at d = 1, w = 4, e = 2 (another data width: the expert-data
  group is now two ranks, a real subgroup reduction): every rank's weights, master and Adam moments equal
  its piece of the checkpoint's global tensors, and one flush SGD step from there equals the hand reference.
- gpt-tiny at d = 2, w = 2 with its MLP parameters in a second domain that spans the data group (e = 1), with
  and without the distributed optimizer: two segments, each with its own optimizer (and shard); the losses
  equal the one-domain run's within 1e-6 (each segment is its own fused AdamW call, which moves the kernel's
  vector tail: the module docstring of test_distributed_optimizer.py), and a torch-format save and resume
  replays bitwise; zb-h2 with optimizer post-validation (every segment speculated, kept or rolled back) ends
  with the exact run's weights, bitwise.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from multiproc import run_workers
from torch import nn

from megatron_2bw.checkpoint import checkpointing as ckpt
from megatron_2bw.checkpoint import dist_checkpoint as dc
from megatron_2bw.checkpoint.dist_checkpoint.reader import read_whole
from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import EXPERT_DATA, ParallelState, build_state
from megatron_2bw.pipeline.build import build_stage, reductions
from megatron_2bw.pipeline.weights import GlobalNames, RankWeights
from megatron_2bw.schedule.stages import stage_range
from megatron_2bw.tensor_parallel import init as tp_init
from megatron_2bw.tensor_parallel.init import Init, parameter
from megatron_2bw.tensor_parallel.random import RNGTracker

H, E, LAYERS, SEED, B = 7, 4, 2, 5, 8  # hidden, experts (rows of an expert matrix), layers, init seed, global batch
CPU = torch.device("cpu")


class _Layer(nn.Module):
    """h = tanh(x W^T + b) (1 + sum(g)), plus an expert MLP on this rank's expert rows X: h + tanh(h X^T) X.
    A layer's dense parameters are 7 * 7 + 7 + 3 = 59 elements: the dense segment is padded under the
    distributed optimizer, so the expert segment starts after a gap."""

    def __init__(self, i: int, ep_rank: int, e: int) -> None:
        super().__init__()
        self.w = parameter(Init(f"{i}.w", SEED, (H, H), 0.4))
        self.b = parameter(Init(f"{i}.b", SEED, (H,), 0.1))
        self.g = parameter(Init(f"{i}.g", SEED, (3,), 0.1))
        self.x = parameter(Init(f"{i}.x", SEED, (E, H), 0.4, domain=EXPERT_DATA, expert=(0, ep_rank, e)))

    def forward(self, x, batch: dict) -> torch.Tensor:
        return _layer(batch["x"] if x is None else x, self.w, self.b, self.g, self.x)


def _layer(x, w, b, g, xe):
    h = torch.tanh(x @ w.T + b) * (1 + g.sum())
    return h + torch.tanh(h @ xe.T) @ xe


def _loss(out: torch.Tensor, batch: dict) -> torch.Tensor:
    return ((out - batch["y"]) ** 2).mean()


STEPS = 4  # samples for this many steps, the same tensors in every cell


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(B * STEPS, H, generator=g), torch.randn(B * STEPS, H, generator=g)


@dataclasses.dataclass
class _Run:
    stage: object
    get_batch: object
    m: int
    micro: int


def _toy(layout: tuple[int, int, int], e: int, schedule: str, opt: OptimizerConfig, steps: int) -> _Run:
    t, d, w = layout
    state = build_state(Axes(tensor=t, expert=e, data=w, pipeline=d), CPU)
    per = LAYERS // d
    first = state.pp_rank * per
    micro = 2
    m = B // (micro * w)
    stage = build_stage(lambda: [_Layer(first + i, state.ep_rank, e) for i in range(per)], _loss, state,
                        PipelineConfig(schedule, micro, m), opt, (micro, H), names=GlobalNames(first),
                        rng_tracker=RNGTracker(SEED, 0))
    xs, ys = _data()

    def get_batch(mb: int) -> dict:
        step, i = divmod(mb, m)
        lo = step * B + state.data_rank * (B // w) + i * micro
        return {"x": xs[lo:lo + micro], "y": ys[lo:lo + micro]}

    return _Run(stage, get_batch, m, micro)


# --------------------------------------------------------------------------- the hand reference
def _full_params() -> dict[str, torch.Tensor]:
    """Every global parameter, unsharded, in float64 (the layout-independent CPU initialization)."""
    out = {}
    for i in range(LAYERS):
        layer = _Layer(i, 0, 1)
        out.update({f"{i}.{k}": p.detach().double() for k, p in layer.named_parameters()})
    return out


def _reference_step(params: dict, step: int, w: int, e: int, m: int, micro: int, lr: float, clip: float):
    """(reduced full gradients, global norm, updated params) of one SGD step, by hand from the named groups."""
    xs, ys = _data()
    local = []
    for j in range(w):  # data rank j holds expert piece j % e
        k = j % e
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        total = 0.0
        for i in range(m):
            lo = step * B + j * (B // w) + i * micro
            x = xs[lo:lo + micro].double()
            for li in range(LAYERS):
                xe = leaves[f"{li}.x"].chunk(e, 0)[k]
                x = _layer(x, leaves[f"{li}.w"], leaves[f"{li}.b"], leaves[f"{li}.g"], xe)
            total = total + _loss(x, {"y": ys[lo:lo + micro].double()})
        grads = torch.autograd.grad(total / (m * w), list(leaves.values()))
        local.append(dict(zip(leaves, grads)))
    reduced = {}
    for n in params:
        if n.endswith(".x"):  # each piece summed over its expert-data group (the ranks j with j % e == k)
            pieces = [sum(local[j][n].chunk(e, 0)[k] for j in range(w) if j % e == k) for k in range(e)]
            reduced[n] = torch.cat(pieces, 0)
        else:  # over the whole data group
            reduced[n] = sum(g[n] for g in local)
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in reduced.values())))  # every value once
    mult = clip / (norm + 1e-6) if norm > clip else 1.0
    return reduced, norm, {n: p - lr * mult * reduced[n] for n, p in params.items()}


def _piece(stage, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a global tensor (the expert rows it holds)."""
    st = stage.state
    return full.chunk(st.e, 0)[st.ep_rank] if name.endswith(".x") else full


def _layout_of(stage, named_full: dict[str, torch.Tensor]) -> torch.Tensor:
    """A padded stage buffer holding this rank's pieces of ``named_full`` where the stage keeps them."""
    w = stage.weights
    out = torch.zeros(w.padded_numel, dtype=torch.float64)
    for name, o, n in zip(w.global_names, w.offsets, w.sizes):
        out[o:o + n] = _piece(stage, name, named_full[name]).reshape(-1)
    return out


def _captured(stage) -> list:
    """Record, at each update, every segment's reduced gradient (this rank's shard of it when sharded)."""
    upd, seen = stage.updater, []
    apply = upd.apply

    def recording(step, sumsq, lr, next_lr=None):
        buf = stage.weights.grad_buffer(step)
        seen.append([p.grad_of(buf).double().clone() for p in upd.parts])
        return apply(step, sumsq, lr, next_lr)

    upd.apply = recording
    return seen


def _part_expected(part, padded: torch.Tensor) -> torch.Tensor:
    piece = part.seg.of(padded, True)
    return part.shard.own(piece) if part.shard is not None else part.seg.of(padded)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _check_reference(run: _Run, params: dict, steps: int, w: int, e: int, lr: float, clip: float) -> dict:
    """Train ``steps`` flush SGD steps; the largest relative error of gradients, norms and weights."""
    seen = _captured(run.stage)
    results = run.stage.train(steps, run.get_batch, lambda s: lr)
    errs = {"grad": 0.0, "norm": 0.0, "weights": 0.0, "clipped": 0}
    first_step = run.stage.step - steps
    for s in range(steps):
        reduced, norm, params = _reference_step(params, first_step + s, w, e, run.m, run.micro, lr, clip)
        padded = _layout_of(run.stage, reduced)
        for part, got in zip(run.stage.updater.parts, seen[s]):
            errs["grad"] = max(errs["grad"], _rel(got, _part_expected(part, padded)))
        errs["norm"] = max(errs["norm"], abs(results[s].grad_norm - norm) / norm)
        errs["clipped"] += int(norm > clip)
    for name, view in run.stage.newest_state().items():
        errs["weights"] = max(errs["weights"], _rel(view.double(), _piece(run.stage, name, params[name])))
    errs["segments"] = [(p.seg.domain, p.seg.numel, p.shard is not None) for p in run.stage.updater.parts]
    errs["starts"] = [(p.seg.start, p.seg.padded) for p in run.stage.updater.parts]
    return errs


# --------------------------------------------------------------------------- the cells
def _sgd(distributed: bool, clip: float) -> OptimizerConfig:
    return OptimizerConfig("sgd", lr=0.2, weight_decay=0.0, clip_grad=clip, use_distributed_optimizer=distributed)


def _adam(distributed: bool) -> OptimizerConfig:
    return OptimizerConfig("adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, use_distributed_optimizer=distributed)


def _config(opt: OptimizerConfig) -> dict:
    return {"optimizer": dataclasses.asdict(opt), "pipeline": {"layer_split": None}}


def _resume_cell(root: str, distributed: bool) -> dict:
    """2BW Adam at d=2, w=2, e=2: 3 steps, against 1 step + torch_dist save + restore + 2 steps (bitwise)."""
    opt = _adam(distributed)
    whole = _toy((1, 2, 2), 2, "2bw", opt, 3)
    full = [r.loss for r in whole.stage.train(3, whole.get_batch, lambda s: 1e-2)]
    first = _toy((1, 2, 2), 2, "2bw", opt, 3)
    losses = [r.loss for r in first.stage.train(1, first.get_batch, lambda s: 1e-2)]
    common = dc.common_state(first.stage, iteration=1, config=_config(opt), args={}, consumed_samples=B,
                             global_batch=B)
    dc.save(root, 1, first.stage, first.stage.rng, common)
    again = _toy((1, 2, 2), 2, "2bw", opt, 3)
    st = again.stage.state
    dc.restore(dc.read_checkpoint(root, 1, st.rank, st.world_size, (1, 2, 2, None)), again.stage, again.stage.rng, CPU)
    losses += [r.loss for r in again.stage.train(2, again.get_batch, lambda s: 1e-2)]
    same = all(torch.equal(a, b) for a, b in zip(whole.stage.weights.flat, again.stage.weights.flat))
    return {"full": full, "resumed": losses, "weights_equal": same,
            "master_moments_equal": _same_state(whole.stage, again.stage)}


def _same_state(a, b) -> bool:
    sa, sb = a.updater.state_dict(), b.updater.state_dict()
    return all(torch.equal(sa["optimizer"][k], sb["optimizer"][k]) for k in ("exp_avg", "exp_avg_sq"))


def _reshard_cell(root: str) -> dict:
    """The distributed-optimizer checkpoint (d=2, w=2) restored at d=1, w=4, e=2; then a flush SGD step."""
    opt = _adam(True)
    run = _toy((1, 1, 4), 2, "flush", opt, 2)
    st = run.stage.state
    dc.restore(dc.read_checkpoint(root, 1, st.rank, st.world_size, (1, 1, 4, None)), run.stage, run.stage.rng, CPU)
    _, families = read_whole(os.path.join(root, "iter_0000001"))
    sd = run.stage.state_dict()  # every family gathered whole over each segment's group
    views = run.stage.weights.state_views
    worst = 0.0
    for name, t in views(sd["versions"][run.stage.weights.slot(run.stage.step)]).items():
        worst = max(worst, _rel(t, _piece(run.stage, name, families["model"][name])))
    for key in ("exp_avg", "exp_avg_sq"):
        for name, t in views(sd["optimizer"][key]).items():
            worst = max(worst, _rel(t, _piece(run.stage, name, families[f"optimizer.{key}"][name])))
    # one flush SGD step at the new width from the restored weights: the hand reference over the new groups
    sgd = _toy((1, 1, 4), 2, "flush", _sgd(True, 0.05), 2)
    with torch.no_grad():
        for f in sgd.stage.weights.flat:
            f.copy_(run.stage.weights.flat[run.stage.weights.slot(run.stage.step)])
    params = {n: t.double() for n, t in families["model"].items()}
    ref = _check_reference(sgd, params, 1, 4, 2, 0.2, 0.05)
    return {"restored_error": worst, "step": run.stage.step, "reference": ref}


def _mlp_in_edp(build):
    """``build`` with every MLP parameter declared in the expert-data domain (its Init's ``domain``)."""
    def built() -> list[nn.Module]:
        layers = build()
        for layer in layers:
            for name, p in layer.named_parameters():
                if ".mlp." in f".{name}." and getattr(p, "init", None) is not None:
                    p.init = dataclasses.replace(p.init, domain=EXPERT_DATA)
        return layers
    return built


def _gpt(two: bool, distributed: bool, schedule: str = "2bw", post_validation: bool = False) -> tuple:
    """gpt-tiny at d=2, w=2 (e=1), 2BW and Adam; ``two``: its MLP parameters in a second domain."""
    cfg = get_preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0)
    state = build_state(Axes(data=2, pipeline=2), CPU)
    tracker = RNGTracker(1234, 0)
    spec = ModelSpec(cfg, ModelGroups.of(state), 1234, rng=tracker)
    m = B // 2
    opt = OptimizerConfig("adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=distributed)
    start, _ = stage_range(cfg.num_layers, 2, state.pp_rank)
    build = lambda: spec.build_stage(2, state.pp_rank)
    pipe = PipelineConfig(schedule, 1, m, post_validation=post_validation)
    stage = build_stage(_mlp_in_edp(build) if two else build, spec.loss_fn(), state, pipe, opt,
                        cfg.stage_activation_shape(1, 1, 1), rng_tracker=tracker, names=GlobalNames(start, tied=WORD))
    data = torch.randint(0, cfg.vocab_size, (B * 4, cfg.seq_length + 1), generator=torch.Generator().manual_seed(9))

    def get_batch(mb: int) -> dict:
        step, i = divmod(mb, m)
        lo = step * B + state.data_rank * (B // 2) + i
        return spec.make_batch(data[lo:lo + 1])

    config = {"model": cfg.__dict__, "optimizer": opt.__dict__, "pipeline": {"layer_split": None}}
    return stage, get_batch, tracker, config


def _gpt_cell(root: str, distributed: bool) -> dict:
    """Two segments against one (the same losses within the fused AdamW's last bits), and a torch-format save
    after 1 step, restored into a fresh stage: 2 more steps replay the uninterrupted run bitwise."""
    lr = lambda s: 1e-3
    one, get_batch, _, _ = _gpt(False, distributed)
    ref = [r.loss for r in one.train(3, get_batch, lr)]
    two, get_batch, tracker, config = _gpt(True, distributed)
    full = [r.loss for r in two.train(3, get_batch, lr)]
    first, get_batch, tracker, config = _gpt(True, distributed)
    losses = [r.loss for r in first.train(1, get_batch, lr)]
    st = first.state
    ckpt.save(root, 1, st, lambda: ckpt.payload(first, iteration=1, tracker=tracker, consumed_samples=B,
                                                 global_batch=B, config=config, args={}))
    again, get_batch, tracker, _ = _gpt(True, distributed)
    ckpt.restore(ckpt.load_rank_file(root, 1, 1, 2, st.tp_rank, st.pp_rank), again, tracker, CPU)
    losses += [r.loss for r in again.train(2, get_batch, lr)]
    return {"one": ref, "two": full, "resumed": losses,
            "segments": [(s.domain, s.start, s.numel, s.padded) for s in two.weights.segments],
            "weights_equal": all(torch.equal(a, b) for a, b in zip(two.weights.flat, again.weights.flat))}


def _post_validation_cell() -> dict:
    """gpt-tiny in two segments, zb-h2 with optimizer post-validation (each segment's update speculated, then kept
    or rolled back) against the exact updates, with the distributed optimizer: the same weights, bitwise."""
    stages = []
    for pv in (False, True):
        stage, get_batch, _, _ = _gpt(True, True, "zb-h2", pv)
        stage.train(4, get_batch, lambda s: 1e-3)
        stages.append(stage)
    return {"speculated": stages[1].speculated,
            "equal": all(torch.equal(a, b) for a, b in zip(stages[0].weights.flat, stages[1].weights.flat))}


def _cells(root: str) -> dict:
    out = {"post_validation": _post_validation_cell()}
    for distributed in (False, True):
        run = _toy((1, 2, 2), 2, "flush", _sgd(distributed, 0.05), 2)
        out["reference", distributed] = _check_reference(run, _full_params(), 2, 2, 2, 0.2, 0.05)
    for distributed in (False, True):
        path = os.path.join(root, f"dist{int(distributed)}")
        out["resume", distributed] = _resume_cell(path, distributed)
    out["reshard"] = _reshard_cell(os.path.join(root, "dist1"))
    for distributed in (False, True):
        out["gpt", distributed] = _gpt_cell(os.path.join(root, f"gpt{int(distributed)}"), distributed)
    return out


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("domains"))
    return run_workers(_cells, 4, root, timeout=420)


@pytest.mark.parametrize("distributed", [False, True])
def test_gradients_norms_updates_equal_the_hand_reference(cells, distributed):
    for rank in cells:
        r = rank["reference", distributed]
        assert [d for d, _, _ in r["segments"]] == ["dp", "edp"]
        assert all(sharded == distributed for d, _, sharded in r["segments"] if d == "dp")
        assert r["clipped"] >= 1  # the norm reaches the update: clipping is active
        (_, dense), (expert, _) = r["starts"]
        assert expert == (60 if distributed else 59) and dense == expert  # padded to 2 shards: a gap of 1
        assert r["grad"] < 1e-6 and r["norm"] < 1e-6 and r["weights"] < 1e-6, r


@pytest.mark.parametrize("distributed", [False, True])
def test_torch_dist_resume_is_bitwise(cells, distributed):
    for rank in cells:
        r = rank["resume", distributed]
        if r["full"][0] is not None:
            assert r["resumed"] == r["full"]
        assert r["weights_equal"] and r["master_moments_equal"]


def test_resharded_to_another_data_width(cells):
    for rank in cells:
        r = rank["reshard"]
        assert r["step"] == 1 and r["restored_error"] == 0.0
        ref = r["reference"]
        assert ref["starts"][1][0] == 120 and ref["segments"][1] == ("edp", 28, True)  # 118 padded to 4 shards
        assert ref["grad"] < 1e-6 and ref["norm"] < 1e-6 and ref["weights"] < 1e-6, ref


@pytest.mark.parametrize("distributed", [False, True])
def test_two_segments_train_as_one_and_resume_in_the_torch_format(cells, distributed):
    for rank in cells:
        r = rank["gpt", distributed]
        (d0, s0, _, p0), (d1, s1, _, _) = r["segments"]
        assert (d0, d1, s0) == ("dp", "edp", 0) and s1 == p0 and p0 % (2 if distributed else 1) == 0
        assert r["weights_equal"]
        if r["one"][0] is None:
            continue
        assert r["resumed"] == r["two"]  # same-path replay: bitwise
        for a, b in zip(r["two"], r["one"]):
            assert abs(a - b) <= 1e-6 * abs(b), (r["two"], r["one"])


def test_post_validation_speculates_every_segment_bitwise(cells):
    for rank in cells:
        assert rank["post_validation"]["speculated"] >= 1 and rank["post_validation"]["equal"]


def test_one_domain_is_the_single_buffer():
    """Every parameter in the default domain: the store is the one flat buffer of before segments (fb23088), so
    the views and shard ranges every checkpoint format reads are those it wrote: one segment, the parameters
    back to back from 0 in the same order (decayed matrices first, otherwise as the modules list them), padded
    for the distributed optimizer to ceil(N / w) * w, and one reduction over the whole storage."""
    cfg = get_preset("gpt-tiny")
    spec = ModelSpec(cfg, ModelGroups(), 1234)
    w = RankWeights(lambda: spec.build_stage(2, 1), num_versions=2, dtype=torch.float32, device=CPU, shards=3)
    with tp_init.deferred():
        seen, named = set(), []
        for name, p in nn.ModuleList(spec.build_stage(2, 1)).named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p.numel(), p.dim()))
    named = sorted(named, key=lambda n: n[2] < 2)
    offsets = [sum(n for _, n, _ in named[:i]) for i in range(len(named) + 1)]
    assert w.names == [n for n, _, _ in named] and w.offsets == offsets and w.numel == offsets[-1]
    assert w.padded_numel == -(-w.numel // 3) * 3 and w.padded_numel > w.numel  # a tail to pad: 3 does not divide
    assert [(s.domain, s.start, s.numel, s.padded) for s in w.segments] == [("dp", 0, w.numel, w.padded_numel)]
    assert w.n_decay == sum(n for _, n, dim in named if dim >= 2)
    (red,) = reductions(w, ParallelState.single(), sharded=False)
    assert (red.lo, red.hi, red.shard, red.copies) == (0, None, None, None)
