"""The planner's table of block costs (``BlockCost`` per block, ``MicrobatchCosts`` per (t, b), ``LayerCosts``
per model) and its file form, the profile a profiler writes (``--profile FILE``). Where the numbers come from
(the analytic estimate, ``layer_costs.py``; a profile) is not this module's concern. Torch-free.

Profile JSON (``--profile FILE``), one entry per (tensor-parallel size, microbatch size) measured::

    {
      "format": "megatron_2bw-profile-v1",
      "source": "who measured what, where",
      "entries": [
        {"tensor_parallel": 1, "micro_batch_size": 4,
         "tied_params": 115909632,          # word-embedding params per GPU shared by embedding and head
         "layer":     {"forward_s": 0.0052, "backward_s": 0.0104, "params": 63713280,
                       "stash_bytes": 328204288, "input_bytes": 9437184, "output_bytes": 9437184,
                       "workspace_bytes": 328204288,
                       "tp_allreduce_forward_bytes": 0, "tp_allreduce_backward_bytes": 0},
         "embedding": {...same keys...},
         "head":      {...same keys...}}
      ]
    }

Per block: ``forward_s``/``backward_s`` are seconds for one microbatch on one GPU (a profiler at
``t > 1`` measures them including the tensor-parallel all-reduces and writes
``tp_allreduce_*_bytes = 0``); optional ``backward_weight_s`` (the weight-gradient GEMMs inside
``backward_s``, what a split backward's W runs; absent: half the backward) and
``weight_grad_stash_bytes`` (the gradients a split backward's input-gradient pass catches at the weight
GEMMs and norms for W; absent: the whole stash again) and ``weight_grad_input_bytes`` (what W reads of
the stash, kept after I frees the rest: the weight GEMMs' and norms' inputs; absent: the whole stash);
``params`` are parameters held by one GPU; ``stash_bytes`` what the forward keeps for the backward,
including the block's input; ``input_bytes``/``output_bytes`` the tensors crossing its boundaries;
``workspace_bytes`` the extra peak while it runs. The search only considers the (t, b) pairs a profile has.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError

PROFILE_FORMAT = "megatron_2bw-profile-v1"


@dataclass(frozen=True)
class BlockCost:
    """One block (a transformer layer, the embedding or the head) for one microbatch on one GPU."""

    forward_s: float
    backward_s: float
    params: int
    stash_bytes: int
    input_bytes: int
    output_bytes: int
    workspace_bytes: int = 0
    tp_allreduce_forward_bytes: int = 0
    tp_allreduce_backward_bytes: int = 0
    # the attention core (QK^T, softmax, dropout, times V) inside ``forward_s``/``stash_bytes``:
    # what selective recomputation re-runs and frees (0: unknown, e.g. a profile without it)
    core_forward_s: float = 0.0
    core_stash_bytes: int = 0
    # the weight-gradient GEMMs inside ``backward_s`` (what a split backward's W runs; the rest of the
    # backward, input-gradient GEMMs and every elementwise and attention kernel, is its I), and the
    # output gradients I catches at the weight GEMMs and norms for a deferred W (0: unknown, see
    # ``weight_grad_s`` / ``deferred_bytes``)
    backward_weight_s: float = 0.0
    weight_grad_stash_bytes: int = 0
    # what W reads of the stash, all a deferred microbatch keeps of it once I has freed the rest
    # (``pipeline/saved_release.py``; 0: unknown, the whole stash)
    weight_grad_input_bytes: int = 0

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if value < 0:
                raise ConfigError(f"block cost {key} must be >= 0, got {value}")

    @property
    def weight_grad_s(self) -> float:
        """Seconds of the weight-gradient half of the backward; a profile that does not state it gets half
        the backward (a linear layer's input- and weight-gradient GEMMs have the same FLOPs)."""
        return min(self.backward_weight_s, self.backward_s) if self.backward_weight_s else self.backward_s / 2

    @property
    def input_grad_s(self) -> float:
        """Seconds of the input-gradient half: the rest of the backward."""
        return self.backward_s - self.weight_grad_s

    @property
    def deferred_bytes(self) -> int:
        """The gradients a microbatch's I catches for its deferred W (kept until W, on top of whatever it
        keeps of its stash); a profile that does not state them gets the whole stash."""
        return self.weight_grad_stash_bytes or self.stash_bytes

    @property
    def weight_read_bytes(self) -> int:
        """What a deferred W reads of the stash (the rest is freed at I); unstated: the whole stash."""
        return self.weight_grad_input_bytes or self.stash_bytes


@dataclass(frozen=True)
class MoECosts:
    """What the expert-parallel size ``e`` (a candidate's, not the table's) changes of a layer with experts
    (``moe_costs.py``): one MoE layer's routed-expert parameters (all experts, whole: ``e`` ranks share them,
    ``expert_params / e`` each), one all-to-all's bytes per rank (tokens x top-k x hidden x dtype), its count
    per MoE layer and microbatch, the routed experts' forward and kept rows at a balanced load (what an uneven
    load stretches on the busiest rank), the share of the layers that are MoE layers, and the capacity."""

    num_experts: int
    expert_params: int
    alltoall_bytes: float
    alltoalls: int  # per MoE layer and microbatch: dispatch + combine forward and backward (4; 6 recomputed)
    forward_alltoalls: int  # of them, in a forward (2; with --moe-layer-recompute the backward re-runs 2 more)
    moe_share: float  # MoE layers per layer (--moe-layer-freq): the times are the layers' mean
    expert_forward_s: float  # the routed experts' GEMMs of one MoE layer, one microbatch, balanced
    routed_stash_bytes: int  # the rows an MoE layer keeps for the routed experts, balanced
    capacity: float | None = None  # --moe-expert-capacity-factor: an expert's tokens are cut at c x the mean
    padded: bool = False  # --moe-pad-expert-input-to-capacity: every expert gets exactly its capacity
    # the shared experts' forward GEMMs of one MoE layer and microbatch: the first linear (and the gate's), the second
    shared_forward_s: tuple[float, float] = (0.0, 0.0)
    shared_overlap: bool = False  # --moe-shared-expert-overlap: each half runs while an all-to-all travels


@dataclass(frozen=True)
class MicrobatchCosts:
    """The three block kinds at one (tensor-parallel size, microbatch size).

    ``tied_params``: word-embedding parameters (per GPU) that the embedding and the head share.
    With one stage they are one tensor; with several, the last stage holds a copy (counted in
    ``head.params``) whose gradient is all-reduced with the first stage's every step.
    """

    layer: BlockCost
    embedding: BlockCost
    head: BlockCost
    tied_params: int = 0
    # a model with experts (``moe_costs.py``): ``layer.params`` then excludes the routed experts, which a
    # candidate's expert-parallel size shares out; None for a dense model
    moe: MoECosts | None = None
    expert_parallel: int = 1  # the e these costs were resolved for (``moe_costs.for_experts``)
    alltoall_s: tuple[float, float] = (0.0, 0.0)  # (forward, backward) all-to-all seconds of a layer, inside its times


@dataclass(frozen=True)
class LayerCosts:
    """Costs per (t, b). ``source`` says where they came from, for the output.

    ``sequence_parallel``: the setting ``table`` was counted or measured with (the model's). ``sp_table``:
    where the search tries sequence parallelism as an axis, the same (t > 1, b) with it on (``table``
    then holds them with it off); empty otherwise. ``cp_table``: a rank's costs under context parallelism
    per ``(c, cp_comm_type, t, b, sequence_parallel)`` (``context_costs.context_table``; analytic only).
    """

    source: str
    table: Mapping[tuple[int, int], MicrobatchCosts]
    sequence_parallel: bool = False
    sp_table: Mapping[tuple[int, int], MicrobatchCosts] = field(default_factory=dict)
    cp_table: Mapping[tuple, MicrobatchCosts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.table:
            raise ConfigError(f"layer costs from {self.source} have no entries")

    def at(self, tensor_parallel: int, micro_batch_size: int, sequence_parallel: bool | None = None,
           context: tuple[int, str] | None = None) -> MicrobatchCosts | None:
        """The costs at (t, b); with ``sequence_parallel`` given, those of that setting (None where unknown).
        At t = 1 sequence parallelism changes nothing, so both settings read ``table``. ``context``: (c, comm)."""
        key = (tensor_parallel, micro_batch_size)
        if context is not None:
            sp = bool(sequence_parallel if sequence_parallel is not None else self.sequence_parallel)
            return self.cp_table.get((*context, *key, sp and tensor_parallel > 1))
        if sequence_parallel is None or tensor_parallel == 1 or sequence_parallel == self.sequence_parallel:
            return self.table.get(key)
        return self.sp_table.get(key) if sequence_parallel else None

    def tensor_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({t for t, _ in self.table}))

    def micro_batch_sizes(self, tensor_parallel: int) -> tuple[int, ...]:
        return tuple(sorted(b for t, b in self.table if t == tensor_parallel))

    def to_json(self) -> dict[str, Any]:
        """The profile schema of this module's docstring (what ``load_profile`` reads back)."""
        entries = []
        for (t, b), c in sorted(self.table.items()):
            entries.append({"tensor_parallel": t, "micro_batch_size": b, "tied_params": c.tied_params,
                            "layer": asdict(c.layer), "embedding": asdict(c.embedding), "head": asdict(c.head)})
        return {"format": PROFILE_FORMAT, "source": self.source, "entries": entries}


# ---- profiles -----------------------------------------------------------------------------------

def _block(data: Any, where: str) -> BlockCost:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected an object")
    required = ("forward_s", "backward_s", "params", "stash_bytes", "input_bytes", "output_bytes")
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    unknown = set(data) - set(BlockCost.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    try:
        return BlockCost(**{k: (float(v) if k.endswith("_s") else int(v)) for k, v in data.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def layer_costs_from_json(data: Any, source: str) -> LayerCosts:
    """Parse the profile schema (the module docstring); every problem is a one-line ``ConfigError``."""
    if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"profile {source}: expected a JSON object with \"format\": \"{PROFILE_FORMAT}\"")
    entries = data.get("entries")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"profile {source}: 'entries' must be a non-empty list")
    table: dict[tuple[int, int], MicrobatchCosts] = {}
    for i, entry in enumerate(entries):
        where = f"profile {source} entry {i}"
        try:
            t, b = int(entry["tensor_parallel"]), int(entry["micro_batch_size"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where}: needs integer tensor_parallel and micro_batch_size") from None
        if t < 1 or b < 1:
            raise ConfigError(f"{where}: tensor_parallel and micro_batch_size must be >= 1")
        if (t, b) in table:
            raise ConfigError(f"{where}: duplicate (tensor_parallel={t}, micro_batch_size={b})")
        table[(t, b)] = MicrobatchCosts(
            _block(entry.get("layer"), f"{where} layer"), _block(entry.get("embedding"), f"{where} embedding"),
            _block(entry.get("head"), f"{where} head"), tied_params=int(entry.get("tied_params", 0)),
        )
    label = data.get("source") or "unnamed"
    return LayerCosts(f"profile {source} ({label})", table)


def read_profile_json(path: str | Path) -> dict:
    """The JSON of a ``--profile FILE``; a missing or unreadable file is a one-line ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--profile file {str(path)!r} does not exist")
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--profile {str(path)!r} is not readable JSON: {exc}".replace("\n", " ")) from None


def load_profile(path: str) -> LayerCosts:
    """Read a ``--profile FILE``."""
    return layer_costs_from_json(read_profile_json(path), path)
