"""How a model's ordered layer list is cut into pipeline stages: the one split the model builder,
the memory model, the cost model and the simulator all use.

A model of L transformer layers is the list [embedding, layer 0 .. layer L-1, head] (L + 2 items).
Stage r of d holds a run of transformer layers, plus the embedding when it is the first stage and
the head when it is the last. Without an explicit split every stage holds L/d layers (Megatron's
balanced split); ``split`` gives each stage's layer count instead.

A split may give the first or the last stage no transformer layer (it still holds the embedding or
the head: Megatron's ``--account-for-embedding-in-pipeline-split`` does exactly that when L/d is
small), but never a middle stage: it would hold no parameters and do no work, only add a hop.
``None`` is the canonical form of the even split, so configs, checkpoints and commands that do not
ask for uneven stages look as they always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..errors import ConfigError

Split = tuple[int, ...] | None


@dataclass(frozen=True)
class StageSlice:
    """What stage ``r`` holds: transformer layers ``first_layer .. first_layer+num_layers-1``,
    and whether it holds the embedding and the head."""

    first_layer: int
    num_layers: int
    embedding: bool
    head: bool

    @property
    def range(self) -> tuple[int, int]:
        """Half-open range of list indices (embedding = 0, layer i = i + 1, head = L + 1)."""
        start = 0 if self.embedding else 1 + self.first_layer
        end = 1 + self.first_layer + self.num_layers + (1 if self.head else 0)
        return start, end


def format_split(split: Sequence[int]) -> str:
    """``5,3,3`` (the flag's spelling)."""
    return ",".join(str(int(n)) for n in split)


def parse_split(text: str) -> tuple[int, ...]:
    """``"5,3,3"`` (or ``"5 3 3"``) -> ``(5, 3, 3)``; a one-line error for anything else."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--pipeline-layer-split takes comma-separated layer counts like 5,3,3, "
                          f"got {text!r}") from None


def min_layers(r: int, d: int) -> int:
    """Fewest transformer layers stage ``r`` may hold: 0 on a stage with the embedding or head, else 1."""
    return 0 if r in (0, d - 1) else 1


def check_split(num_layers: int, d: int, split: Sequence[int]) -> tuple[int, ...]:
    """``split`` as a tuple, refused unless it has ``d`` counts summing to ``num_layers`` (see the module docstring)."""
    counts = tuple(int(n) for n in split)
    given = f"--pipeline-layer-split {format_split(counts)}"
    if len(counts) != d:
        raise ConfigError(f"{given} has {len(counts)} stages but --pipeline-model-parallel-size is {d}")
    if sum(counts) != num_layers:
        raise ConfigError(f"{given} sums to {sum(counts)} layers, not --num-layers {num_layers}")
    bad = [r for r, n in enumerate(counts) if n < min_layers(r, d)]
    if bad:
        r = bad[0]
        what = "a middle stage needs at least 1 layer" if 0 < r < d - 1 else "layer counts must be >= 0"
        raise ConfigError(f"{given}: stage {r} has {counts[r]} layers ({what})")
    return counts


def canonical_split(num_layers: int, d: int, split: Sequence[int] | None) -> Split:
    """A checked split, or ``None`` when it is the even split (or none was given)."""
    if split is None:
        return None
    counts = check_split(num_layers, d, split)
    return None if num_layers % d == 0 and counts == (num_layers // d,) * d else counts


def layers_per_stage(num_layers: int, d: int, split: Sequence[int] | None = None) -> tuple[int, ...]:
    """Transformer layers of each of the ``d`` stages."""
    if split is None:
        if num_layers % d:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {d} "
                              "(give --pipeline-layer-split for uneven stages)")
        return (num_layers // d,) * d
    return check_split(num_layers, d, split)


def stage_slice(num_layers: int, d: int, r: int, split: Sequence[int] | None = None) -> StageSlice:
    """What stage ``r`` of ``d`` holds."""
    if not 0 <= r < d:
        raise ConfigError(f"pipeline stage must be in 0..{d - 1}, got r={r}")
    return _slices(num_layers, d, None if split is None else tuple(int(n) for n in split))[r]


@lru_cache(maxsize=4096)
def _slices(num_layers: int, d: int, split: Split) -> tuple[StageSlice, ...]:
    """Every stage's slice (cached: the planner asks for each stage of thousands of candidates)."""
    counts = layers_per_stage(num_layers, d, split)
    firsts = [sum(counts[:r]) for r in range(d)]
    return tuple(StageSlice(firsts[r], counts[r], r == 0, r == d - 1) for r in range(d))


def stage_range(num_layers: int, d: int, r: int, split: Sequence[int] | None = None) -> tuple[int, int]:
    """Half-open range of list indices (embedding = 0, head = L + 1) held by stage r."""
    return stage_slice(num_layers, d, r, split).range


def megatron_split(num_layers: int, d: int, *, first: int | None = None, last: int | None = None,
                   account_for_embedding: bool = False, account_for_loss: bool = False) -> Split:
    """Megatron-core's uneven split, as ``TransformerConfig`` validates it.

    ``first``/``last`` (``--decoder-first/last-pipeline-num-layers``, each > 0) fix the edge stages
    and the remaining layers are spread evenly over the middle stages (a remainder is refused). The
    ``account_for_*`` switches count the embedding / the loss as one layer's worth: the
    ``L + e + l`` "layers" are cut evenly and the first (last) stage holds one transformer layer
    fewer. The two kinds do not mix. Returns ``None`` for the even split.
    """
    edges = {"--decoder-first-pipeline-num-layers": first, "--decoder-last-pipeline-num-layers": last}
    given = {k: v for k, v in edges.items() if v is not None}
    if given and (account_for_embedding or account_for_loss):
        raise ConfigError(f"{next(iter(given))} cannot be combined with --account-for-embedding-in-pipeline-split "
                          "or --account-for-loss-in-pipeline-split (as in Megatron)")
    if given:
        return _edge_split(num_layers, d, first, last, given)
    if not (account_for_embedding or account_for_loss):
        return None
    extra = int(account_for_embedding) + int(account_for_loss)
    total = num_layers + extra
    if total % d:
        raise ConfigError(f"--num-layers {num_layers} + {extra} (embedding/loss accounted as layers) = {total} "
                          f"is not divisible by --pipeline-model-parallel-size {d}")
    counts = [total // d] * d
    counts[0] -= int(account_for_embedding)
    counts[-1] -= int(account_for_loss)
    return canonical_split(num_layers, d, counts)


def _edge_split(num_layers: int, d: int, first: int | None, last: int | None, given: dict[str, int]) -> Split:
    for flag, n in given.items():
        if n <= 0:
            raise ConfigError(f"{flag} must be > 0, got {n}")
    if d == 1:
        raise ConfigError(f"{next(iter(given))} needs --pipeline-model-parallel-size > 1")
    middle = d - len(given)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or bool(rest) != bool(middle):
        raise ConfigError(f"--num-layers {num_layers} leaves {rest} layers for {middle} middle pipeline stages "
                          f"after {' and '.join(f'{k} {v}' for k, v in given.items())}")
    if middle and rest % middle:
        raise ConfigError(f"the {rest} middle layers are not divisible by the {middle} middle pipeline stages "
                          f"(--num-layers {num_layers}, {' and '.join(f'{k} {v}' for k, v in given.items())})")
    each = rest // middle if middle else 0
    counts = [each] * d
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return canonical_split(num_layers, d, counts)


SPLIT_FLAGS = ("--pipeline-layer-split", "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
               "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def split_flags_given(args: object) -> list[str]:
    """The stage-split flags given on a parsed command line (``--auto-plan`` chooses the split itself)."""
    return [f for f in SPLIT_FLAGS if getattr(args, f[2:].replace("-", "_"), None) not in (None, False)]


def split_from_args(args: object, num_layers: int) -> Split:
    """The per-stage layer counts the trainer's split flags ask for (``None``: even)."""
    d = args.pipeline_model_parallel_size
    given = split_flags_given(args)
    if args.pipeline_layer_split is not None:
        if len(given) > 1:
            raise ConfigError(f"--pipeline-layer-split cannot be combined with {' and '.join(given[1:])}")
        return canonical_split(num_layers, d, args.pipeline_layer_split)
    return megatron_split(num_layers, d, first=args.decoder_first_pipeline_num_layers,
                          last=args.decoder_last_pipeline_num_layers,
                          account_for_embedding=args.account_for_embedding_in_pipeline_split,
                          account_for_loss=args.account_for_loss_in_pipeline_split)


# ---- virtual stages (several model chunks per rank: interleaved schedules) ------------------------

VIRTUAL_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size")


def virtual_stages(num_layers: int, d: int, *, layers_per_virtual_stage: int | None = None,
                   virtual_size: int | None = None, split: Split = None) -> int | None:
    """Model chunks per rank from Megatron's flags (None when neither is given).

    ``--num-layers-per-virtual-pipeline-stage N`` gives v = L / d / N, ``--virtual-pipeline-model-parallel-size
    V`` gives v = V; they are mutually exclusive (as in Megatron), and the L layers must cut into d * v equal
    virtual stages (chunk c of rank r is virtual stage c * d + r: layers assigned round-robin)."""
    a, b = VIRTUAL_FLAGS
    if layers_per_virtual_stage is not None and virtual_size is not None:
        raise ConfigError(f"{a} and {b} are mutually exclusive (give one)")
    if layers_per_virtual_stage is None and virtual_size is None:
        return None
    if split is not None:
        raise ConfigError(f"{a if virtual_size is None else b} needs the even stage split, not uneven stages "
                          f"({' / '.join(SPLIT_FLAGS[:3])})")
    if num_layers % d:
        raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {d}")
    per_rank = num_layers // d
    if layers_per_virtual_stage is not None:
        n = layers_per_virtual_stage
        if n < 1 or per_rank % n:
            raise ConfigError(f"{a} {n} must divide the {per_rank} layers of each pipeline stage "
                              f"(--num-layers {num_layers} / --pipeline-model-parallel-size {d})")
        return per_rank // n
    v = virtual_size
    if v < 1 or per_rank % v:
        raise ConfigError(f"{b} {v} must divide the {per_rank} layers of each pipeline stage "
                          f"(--num-layers {num_layers} / --pipeline-model-parallel-size {d})")
    return v


def check_virtual_split(num_layers: int, d: int, chunks: int) -> None:
    """Refuse (one line) a model that does not cut into ``d * chunks`` equal virtual stages."""
    if num_layers % (d * chunks):
        raise ConfigError(f"--num-layers {num_layers} does not cut into {d} pipeline stages x {chunks} model chunks "
                          "of equal layers (--virtual-pipeline-model-parallel-size)")


def chunk_ranges(num_layers: int, stages: Sequence[int], num_stages: int) -> list[tuple[int, int]]:
    """Half-open layer-list ranges (embedding = 0, head = L + 1) of the virtual ``stages`` a rank holds (by
    chunk) when the model is cut evenly into ``num_stages`` virtual stages."""
    return [stage_range(num_layers, num_stages, s) for s in stages]
