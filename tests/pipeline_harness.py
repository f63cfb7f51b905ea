"""Train a tiny model with the pipeline engine under any layout; shared by the engine tests.

``train_tiny`` runs in a single process (layout 1x1x1) or inside ``run_workers`` processes
(layout from the world size). Data: a fixed random token set; step t's global batch is samples
[t*B, (t+1)*B), replica j takes its contiguous B/w slice, cut into m microbatches; so every
layout sees the same global batches and the single-process run is the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.checkpoint.names import WORD
from megatron_2bw.config import OptimizerConfig, PipelineConfig
from megatron_2bw.config.axes import Axes
from megatron_2bw.config.presets import get_preset
from megatron_2bw.faults import FaultInjector
from megatron_2bw.models.gpt import DocumentMasks
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec
from megatron_2bw.parallel_state import ParallelState, build_state
from megatron_2bw.pipeline.build import build_stage
from megatron_2bw.pipeline.executor import PipelineRank
from megatron_2bw.pipeline.weights import GlobalNames
from megatron_2bw.schedule.schedules import get_schedule
from megatron_2bw.schedule.stages import chunk_ranges, stage_range
from megatron_2bw.tensor_parallel.random import RNGTracker


def matching_shard(dense: torch.Tensor, local: torch.Tensor, tp_rank: int, t: int) -> torch.Tensor:
    """The slice of a dense tensor that a tensor-parallel shard holds (zero-padding a vocab dim)."""
    for dim in range(dense.dim()):
        if dense.shape[dim] != local.shape[dim]:
            extra = local.shape[dim] * t - dense.shape[dim]
            if extra > 0:
                shape = list(dense.shape)
                shape[dim] = extra
                dense = torch.cat([dense, dense.new_zeros(shape)], dim)
            return dense.chunk(t, dim=dim)[tp_rank]
    return dense


def _dataset(cfg, n: int):
    """``n`` fixed random samples: GPT token rows ``[n, s+1]``, or a dict of BERT fields."""
    g = torch.Generator().manual_seed(99)
    if cfg.kind == "gpt":
        return torch.randint(0, cfg.vocab_size, (n, cfg.seq_length + 1), generator=g)
    s = cfg.seq_length
    return dict(
        tokens=torch.randint(0, cfg.vocab_size, (n, s), generator=g),
        token_types=(torch.arange(s) >= s // 2).long().expand(n, s),
        labels=torch.randint(0, cfg.vocab_size, (n, s), generator=g),
        loss_mask=(torch.rand(n, s, generator=g) < 0.3).float(),
        padding_mask=torch.ones(n, s), sop_label=torch.randint(0, 2, (n,), generator=g),
    )


def train_tiny(
    schedule: str, *, layout: tuple[int, int, int] | None = None, steps: int = 6, global_batch: int = 8,
    micro: int = 1, kind: str = "gpt-tiny", recompute: bool = False, dtype: str = "fp32", optimizer: str = "adam",
    lr: float = 1e-2, clip: float = 0.0, inject_inf: tuple[int, int] | None = None,
    segments: tuple[int, ...] | None = None, dropout: float = 0.0, weight_decay: float = 0.01,
    p2p_mode: str = "auto", compensation: str = "none", dc_lambda: float = 0.04, sgd_momentum: float = 0.0,
    reload: bool = False, distributed_optimizer: bool | None = None, sequence_parallel: bool = False,
    opt_extra: dict | None = None, ef_scale: float = 1.0, virtual_stages: int | None = None,
    num_layers: int | None = None, post_validation: bool = False, context: int = 1, cp_comm_type: str = "p2p",
    model_extra: dict | None = None, documents: bool = False,
) -> dict:
    """``reload``: between segments, move the stage's state_dict into a freshly built stage (a resume);
    ``distributed_optimizer`` None: OptimizerConfig's default (tests may patch ``OptimizerConfig``);
    ``opt_extra``: more ``OptimizerConfig`` fields (Muon's, the distributed optimizer); ``virtual_stages``:
    model chunks per rank (interleaved-1f1b), built as ``pretrain_gpt.py`` builds them; ``num_layers``
    overrides the preset's (d * v chunks need as many layers); ``context``: the context-parallel size (the
    world is t * d * w * context; ``w`` in ``layout`` is the data width); ``model_extra``: more model fields;
    ``documents``: GPT's --eod-mask-loss, --reset-position-ids and --reset-attention-mask with token 7 as the end
    of a document (every sixth token)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t, d, w = layout
        state = build_state(Axes(tensor=t, context=context, data=w, pipeline=d), torch.device("cpu"))
    else:
        state = ParallelState.single()
    t, d, w = state.t, state.d, state.data_width
    cfg = get_preset(kind, hidden_dropout=dropout, attention_dropout=dropout,
                     sequence_parallel=sequence_parallel and t > 1,
                     **({} if num_layers is None else {"num_layers": num_layers}), **(model_extra or {}))
    seed = 1234
    torch.manual_seed(seed)
    tracker = RNGTracker(seed, state.tp_rank)
    spec = ModelSpec(cfg, ModelGroups.of(state, cp_comm_type), seed, rng=tracker,
                     masks=DocumentMasks(7, True, True, True) if documents else None)
    m = global_batch // (micro * w)
    pipe = PipelineConfig(schedule, micro, m, recompute=recompute, p2p_mode=p2p_mode, compensation=compensation,
                          dc_lambda=dc_lambda, ef_scale=ef_scale, virtual_stages=virtual_stages if d > 1 else None,
                          post_validation=post_validation)
    opt = OptimizerConfig(optimizer, lr=lr, weight_decay=weight_decay, clip_grad=clip, dtype=dtype,
                          adam_beta2=0.99, initial_loss_scale=2.0**12, sgd_momentum=sgd_momentum,
                          **({} if distributed_optimizer is None
                             else {"use_distributed_optimizer": distributed_optimizer}),
                          **(opt_extra or {}))
    start, _ = stage_range(cfg.num_layers, d, state.pp_rank)
    names = GlobalNames(start, tied=WORD)  # the head's copy of the word embedding is named as the original
    build_layers = lambda: spec.build_stage(d, state.pp_rank)  # noqa: E731
    if pipe.chunks > 1:  # one layer list per chunk: virtual stages c*d + r of the d*v even ones
        place = get_schedule(schedule, virtual_stages).placement(d)
        ranges = chunk_ranges(cfg.num_layers, place.stages_of(state.pp_rank), place.num_stages)
        names = GlobalNames.of_chunks(ranges, tied=WORD)
        build_layers = lambda: spec.build_chunks(ranges)  # noqa: E731
    faults = FaultInjector(poison_grads=frozenset({inject_inf})) if inject_inf is not None else None
    def build() -> PipelineRank:
        return build_stage(build_layers, spec.loss_fn(), state, pipe, opt,
                             cfg.stage_activation_shape(micro, t, state.c), rng_tracker=tracker, names=names,
                            faults=faults)

    stage = build()
    data = _dataset(cfg, global_batch * steps)
    if documents:  # documents of 6 tokens, then a remainder, in every sample (inputs and labels)
        data[:, 5::6] = 7

    def get_batch(mb: int) -> dict:
        step, i = divmod(mb, m)
        lo = step * global_batch + state.data_rank * (global_batch // w) + i * micro
        sl = slice(lo, lo + micro)
        return spec.make_batch(data[sl] if cfg.kind == "gpt" else {k: v[sl] for k, v in data.items()})

    results = []
    for k, seg in enumerate(segments or (steps,)):
        if reload and k > 0:
            sd = stage.state_dict()
            stage = build()
            stage.load_state_dict(sd)
        results += stage.train(seg, get_batch, lambda step: lr)
    losses = [r.loss for r in results]
    keys = sorted(results[0].components or {}) if results else []
    comps = [[(r.components or {})[k] for k in keys] for r in results] if state.holds_loss else None
    if state.holds_loss and state.replicas > 1:  # mean over the weight replicas (context ranks hold the same loss)
        x = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(x, group=state.groups.dp)
        losses = (x / state.replicas).tolist()
        if keys:
            c = torch.tensor(comps, dtype=torch.float64)
            dist.all_reduce(c, group=state.groups.dp)
            comps = (c / state.replicas).tolist()
    params = {name: view.detach().float().clone() for name, view in stage.newest_state().items()}
    return {
        "coords": (state.tp_rank, state.dp_rank, state.pp_rank), "t": t, "last": state.holds_loss,
        "losses": losses if state.holds_loss else None, "params": params,
        # per step: the loss's named components (BERT: lm_loss, sop_loss), mean over replicas like "losses"
        "components": [dict(zip(keys, row)) for row in comps] if comps is not None and keys else None,
        "norms": [r.grad_norm for r in results], "skipped": [r.skipped for r in results],
        "scales": [r.loss_scale for r in results], "stats": stage.stats.as_dict(), "m": m,
        "speculated": stage.speculated, "rolled_back": stage.rolled_back,  # optimizer post-validation's counts
    }
