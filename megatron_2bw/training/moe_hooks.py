"""What the trainer does for a mixture-of-experts model beside the pipeline (``PipelineRank.before_forward``).

Before each forward of a chunk:

- the balancing losses' gradient scale of its MoE layers becomes the main loss's for that step, the step's loss
  scale over the microbatches and data ranks that average it (the executor's loss factor), so the injected
  gradient is right whatever the schedule;
- at the first forward of a new step, once per optimizer step, each router's expert bias moves by the tokens
  its experts took in the step before (``Router.update_expert_bias``): the counts of every weight version's copy
  of the layer, summed over the stage's data x context x tensor ranks, the new bias written into every copy.
  Every rank of a stage runs the same program, so this collective is at the same point on each. A step's
  forwards all come before the next step's first one under every schedule, so the counts are one step's;
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

LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def _moe_layers(mods: nn.Module) -> list[tuple[int, MoELayer]]:
    """(global layer index, layer) of every MoE MLP under ``mods``."""
    return [(m.index, m.moe) for m in mods.modules() if isinstance(m, MoEMLP)]


def stage_group(state) -> object | None:
    """The ranks of this rank's pipeline stage (data x context x tensor); every rank creates every stage's."""
    if state.t * state.w == 1:
        return None
    mine = None
    for pp in range(state.d):
        ranks = [pp * state.t * state.w + i for i in range(state.t * state.w)]
        g = dist.new_group(ranks, timeout=state.timeout)
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
        bias = any(layer.router.expert_bias is not None for _, layer in self.copies[0])
        self.group = stage_group(state) if bias else None
        self.bias = bias
        self.last_step = stage.step
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.calls: dict[int, int] = {}

    def __call__(self, layers: nn.ModuleList, step: int) -> None:
        if step > self.last_step:
            if self.bias:
                self.update_expert_bias()
            self.last_step = step
            if self.log_interval and step % self.log_interval == 0 and self.copies[0]:
                line = self.log_line(step)
                if line:
                    print(line, flush=True)
        scale = self.stage.updater.loss_scale(step) / self.norm
        for _, layer in _moe_layers(layers):
            layer.set_aux_loss_scale(scale)
        self._collect()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Every MoE layer's bias from the counts of all its copies, summed over the stage's ranks."""
        for i, (_, first) in enumerate(self.copies[0]):
            routers = [copies[i][1].router for copies in self.copies]
            counts = sum(r.local_tokens_per_expert for r in routers)
            first.router.local_tokens_per_expert.copy_(counts)
            first.router.update_expert_bias(self.group)
            for r in routers[1:]:
                r.expert_bias.copy_(first.router.expert_bias)
                r.local_tokens_per_expert.zero_()

    def _collect(self) -> None:
        """Add up the statistics of the calls made since the last collection (detached: no sync)."""
        for copies in self.copies:
            for index, layer in copies:
                st = layer.last_stats
                if st is None:
                    continue
                layer.last_stats = None
                acc = self.sums.setdefault(index, {})
                t = st.tokens_per_expert.float()
                vals = dict(st.losses)
                vals["max_over_mean"] = t.max() / t.mean().clamp_min(1e-9)
                vals["dropped"] = st.dropped.float() if st.dropped is not None else torch.zeros(())
                for k, v in vals.items():
                    acc[k] = acc[k] + v.float() if k in acc else v.float().clone()
                self.calls[index] = self.calls.get(index, 0) + 1

    def log_values(self) -> dict[str, float]:
        """This rank's MoE log values since the last call, per layer averaged over its calls (a loss that was
        not computed is left out), and each loss averaged over the layers as Megatron's line shows it. Local:
        no collective (a stage's layers are on its own ranks; the losses already count whole sequences)."""
        self._collect()
        out: dict[str, float] = {}
        for index in sorted(self.sums):
            acc, n = self.sums[index], self.calls[index]
            for k, v in acc.items():
                name = {"max_over_mean": "tokens_per_expert_max_over_mean", "dropped": "dropped_tokens"}.get(k, k)
                out[f"{name} layer {index}"] = float(v) / (1 if k == "dropped" else n)
        for k in LOSS_NAMES:
            per = [v for n, v in out.items() if n.startswith(f"{k} layer ")]
            if per:
                out[k] = sum(per) / len(per)
        self.sums, self.calls = {}, {}
        return out

    def log_line(self, iteration: int) -> str | None:
        """``moe: iteration N | name: value | ...`` for this rank's layers (None: nothing since the last)."""
        vals = self.log_values()
        if not vals:
            return None
        return f"moe: iteration {iteration} | " + " | ".join(f"{k}: {v:.6g}" for k, v in vals.items())
