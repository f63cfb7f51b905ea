"""What the trainer does for a mixture-of-experts model beside the pipeline (``PipelineRank.before_forward``).

Before each forward of a chunk (the action: its step, microbatch and weight version):

- the balancing losses' gradient scale of its MoE layers becomes the main loss's for that step, the step's loss
  scale over the microbatches and data ranks that average it (the executor's loss factor), so the injected
  gradient is right whatever the schedule;
- the aux-loss-free expert bias is versioned like the weights: B(0) as built, and once per optimizer step
  ``B(s) = B(s-1) + rate * sign(mean - counts(s-1))`` from the tokens step s-1 sent to each expert (the counts of
  every weight version's copy of the layer, summed over the stage's data x context x tensor ranks; computed at
  the first forward of step s, when every forward of step s-1 has run under every schedule). A forward on
  weight version v routes with B(v), written into that version's copy of the router: under Flush v = s, under
  2BW v = s - 1, so a microbatch's forward, its recomputation and its backward route with one bias, as they
  run on one weight version (a version's copy is rewritten only when a new version enters its buffer, after
  every microbatch of the old one has finished). Token counts are taken once per microbatch (never in a
  replay); the warm-up forwards that optimizer post-validation discards and re-runs are counted once;
- the previous call's statistics are added up (detached tensors: no synchronisation) for the log; at the
  first forward of a step that ends a ``--log-interval``, the first data and tensor rank of each stage prints
  one ``moe:`` line of its layers (:meth:`MoEHooks.log_values`): Megatron's names per layer averaged over the
  calls, ``load_balancing_loss`` / ``seq_load_balancing_loss`` / ``z_loss`` (without their coefficients, as
  Megatron logs them, and averaged over the layers), the busiest expert's tokens over the mean and the
  assignments the capacity dropped. Not in the metrics file yet (that needs the stage statistics' reduction).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.moe_block import MoEMLP
from ..moe.layer import MoELayer
from ..moe.router import updated_expert_bias
from .moe_metrics import Sums, vector


def _moe_layers(mods: nn.Module) -> list[tuple[int, MoELayer]]:
    """(global layer index, layer) of every MoE MLP under ``mods``."""
    return [(m.index, m.moe) for m in mods.modules() if isinstance(m, MoEMLP)]


def stage_group(state) -> object | None:
    """The ranks of this rank's pipeline stage (data x context x tensor); every rank creates every stage's."""
    if state.t * state.replicas == 1:
        return None
    mine = None
    for pp in range(state.d):
        g = dist.new_group(state.axes.stage_ranks(pp), timeout=state.timeout)
        mine = g if pp == state.pp_rank else mine
    return mine


class MoEHooks:
    """The MoE side of one rank's training (module docstring); ``stage`` a PipelineRank."""

    def __init__(self, stage, state, num_layers: int, microbatches: int, log_interval: int | None = None) -> None:
        self.stage, self.state, self.num_layers = stage, state, num_layers
        # one line per --log-interval from the first data rank and tensor rank of each stage holding MoE layers
        self.log_interval = log_interval if state.dp_rank == 0 and state.tp_rank == 0 else None
        self.norm = microbatches * state.data_width
        self.copies = [_moe_layers(slot) for slot in stage.weights.slots]  # per weight version
        self.index_of = {id(m): i for c in self.copies for i, m in c}
        self.bias = any(layer.router.expert_bias is not None for _, layer in self.copies[0])
        self.group = stage_group(state) if self.bias else None
        self.last_step = stage.step
        # B(v) of each MoE layer (by global index) for the versions a forward may still run on
        self.history: dict[int, dict[int, torch.Tensor]] = {}
        if self.bias:
            self.history[stage.step] = {i: m.router.expert_bias.clone() for i, m in self.copies[0]}
            self._resume(getattr(stage, "moe_router_state", None) or {})
        self.first: tuple[int, int, int] | None = None  # (step, chunk, microbatch) of the step's first forward
        self.log_sums = Sums()  # since the last log line
        self.step_sums: dict[int, Sums] = {}  # by the step of the forwards that made them (the metrics file's)
        self._kept = Sums()  # the log's at the step's first forward
        self._step_of_pending = stage.step  # the step of the forward whose statistics are not collected yet

    def __call__(self, layers: nn.ModuleList, action) -> None:
        step, key = action.step, (action.step, action.chunk, action.mb)
        self._collect()  # the previous forward's statistics, of its step
        if self.first is None or step > self.first[0]:  # the step's first forward
            if step > self.last_step:  # (an evaluation or a save may have begun it)
                self.advance(step)
            self.first = key
            self._kept = self.log_sums.copy()
        elif key == self.first:  # post-validation re-runs the step's warm-up: what it counted is void
            self._discard_step(step)
        scale = self.stage.updater.loss_scale(step) / self.norm
        for _, layer in _moe_layers(layers):
            layer.set_aux_loss_scale(scale)
            if self.bias:
                self._route_with(layer, action.version)
        self._step_of_pending = step

    def advance(self, step: int) -> None:
        """Step ``step`` begins: B(step) from the counts of the step before, and the log line if it is due."""
        if self.bias:
            self.history[step] = self.updated_expert_bias()
            self.history = {v: b for v, b in self.history.items() if v >= step - 1}
        self.last_step = step
        if self.log_interval and step % self.log_interval == 0 and self.copies[0]:
            line = self.log_line(step)
            if line:
                print(line, flush=True)

    def _resume(self, loaded: dict[int, torch.Tensor]) -> None:
        """B(step) and B(step - 1) of the layers a checkpoint held them for (``[2, E]`` each: router_state.py)."""
        step = self.stage.step
        for i, _ in self.copies[0]:
            if i in loaded:
                self.history[step][i] = loaded[i][0].clone()
                if step > 0:
                    self.history.setdefault(step - 1, {})[i] = loaded[i][1].clone()
        if step > 0 and len(self.history.get(step - 1, {})) < len(self.copies[0]):  # none saved: as B(step)
            self.history[step - 1] = {i: b.clone() for i, b in self.history[step].items()}

    def before_save(self) -> None:
        """Hand the stage the router state a checkpoint after ``stage.step`` steps holds: B(step), B(step - 1)."""
        step = self.stage.step
        if step > self.last_step:
            self.advance(step)
        if self.bias:
            prev = self.history.get(step - 1, self.history[step])
            self.stage.moe_router_state = {i: torch.stack([b, prev[i]]) for i, b in self.history[step].items()}

    def before_evaluation(self) -> None:
        """An evaluation after ``stage.step`` steps runs on the newest weights W(step): with B(step) (its counts
        are complete at the drain before an evaluation; the step's first forward then finds it made)."""
        step = self.stage.step
        if step > self.last_step:
            self.advance(step)
        if self.bias:
            for _, layer in _moe_layers(self.stage.weights.layers(step)):
                self._route_with(layer, step)

    @torch.no_grad()
    def updated_expert_bias(self) -> dict[int, torch.Tensor]:
        """Every MoE layer's next bias from the counts of all its copies, summed over the stage's ranks (one
        collective for all layers); the counts restart."""
        firsts = self.copies[0]
        counts = torch.stack([sum(c[i][1].router.local_tokens_per_expert for c in self.copies)
                              for i in range(len(firsts))])
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        for copies in self.copies:
            for _, layer in copies:
                layer.router.local_tokens_per_expert.zero_()
        latest = self.history[max(self.history)]
        rate = firsts[0][1].router.cfg.moe_router_bias_update_rate
        return {index: updated_expert_bias(counts[i], latest[index], rate) for i, (index, _) in enumerate(firsts)}

    @torch.no_grad()
    def _route_with(self, layer: MoELayer, version: int) -> None:
        """Make ``layer``'s router (one weight version's copy) hold B(version); a copy only when it changes."""
        router = layer.router
        if getattr(router, "bias_version", None) != version:
            router.expert_bias.copy_(self.history[version][self.index_of[id(layer)]])
            router.bias_version = version

    def _discard_step(self, step: int) -> None:
        """The forwards of this step so far are re-run: forget their token counts and statistics."""
        for copies in self.copies:
            for _, layer in copies:
                layer.last_stats = None
                if layer.router.local_tokens_per_expert is not None:
                    layer.router.local_tokens_per_expert.zero_()
        self.log_sums = self._kept.copy()
        self.step_sums.pop(step, None)

    def _collect(self) -> None:
        """Add up the statistics of the calls made since the last collection (detached: no sync)."""
        for copies in self.copies:
            for index, layer in copies:
                st = layer.last_stats
                if st is None:
                    continue
                layer.last_stats = None
                t = st.tokens_per_expert.float()
                vals = dict(st.losses)
                vals["max_over_mean"] = t.max() / t.mean().clamp_min(1e-9)
                if st.dropped is not None:
                    vals["dropped"] = st.dropped.float()
                self.log_sums.add(index, vals)
                self.step_sums.setdefault(self._step_of_pending, Sums()).add(index, vals)

    def log_values(self) -> dict[str, float]:
        """This rank's MoE log values since the last call, per layer averaged over its calls (a loss that was
        not computed is left out), and each loss averaged over the layers as Megatron's line shows it. Local:
        no collective (a stage's layers are on its own ranks; the losses already count whole sequences)."""
        self._collect()
        return self.log_sums.take()

    def step_vector(self, step: int, names: list[str], due: bool) -> list[float]:
        """This rank's part of step ``step``'s summed MoE vector (moe_metrics.py). At a step whose record is
        logged (``due``): the statistics of the forwards of the steps since the last such step (at a step's update
        every forward of it has run, on every stage and under every schedule); elsewhere zeros, read from nothing,
        so no step but a logged one waits for the device."""
        self._collect()
        if not due:
            return [0.0] * len(names)
        window = Sums()
        for s in sorted(k for k in self.step_sums if k <= step):
            window.merge(self.step_sums.pop(s))
        return vector(names, window.take(), 1.0 / self.state.replicas if self.state.tp_rank == 0 else 0.0)

    def log_line(self, iteration: int) -> str | None:
        """``moe: iteration N | name: value | ...`` for this rank's layers (None: nothing since the last)."""
        vals = self.log_values()
        if not vals:
            return None
        return f"moe: iteration {iteration} | " + " | ".join(f"{k}: {v:.6g}" for k, v in vals.items())
