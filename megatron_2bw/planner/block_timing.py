"""Time and size one microbatch through a chain of blocks the way a pipeline stage runs it.

The chain is the embedding, a few distinct transformer layers and the head with the loss. Each
repetition runs the forward block after block, then the backward in reverse, each block timed on
its own (the blocks are cut apart with ``detach``, so a block's backward is exactly its own), then
the forward again under ``torch.no_grad`` (what a stage's first forward costs with recomputation),
then once more with the backward split as zero-bubble schedules run it (``pipeline.split_backward``:
I, the input gradient, then W, the weight gradients, each timed), which also gives the bytes I keeps
for W: the gradients it caught, and what W reads of the stash once I has freed the rest.
Running distinct blocks in sequence keeps a block from finding its weights and buffers still in
cache from its own previous repetition, which a block timed alone in a loop would.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..pipeline.accounting import SavedBytes
from ..pipeline.saved_release import BoxedSaves, release_unread
from ..pipeline.split_backward import accumulator, backward_input, backward_weight
from .layer_costs import BlockCost


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means the current device: CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a host clock brackets it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Each parameter of ``modules`` once (tied weights shared between blocks count once)."""
    return list(nn.ModuleList(modules).parameters())


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 0


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


@dataclass(frozen=True)
class BlockMeasurement:
    """Everything measured for one block at one microbatch size (times in seconds, sizes in bytes)."""

    forward_s: float
    backward_s: float
    forward_nograd_s: float
    params: int
    stash_bytes: int
    input_bytes: int
    output_bytes: int
    workspace_bytes: int
    workspace_measured: bool
    forward_samples: tuple[float, ...] = ()
    backward_samples: tuple[float, ...] = ()
    # the split backward: I (input gradient) and W (weight gradients) timed apart, and what I keeps for
    # W beyond the stash (0 where not measured; the embedding's I is empty: W is its whole backward)
    backward_input_s: float = 0.0
    backward_weight_s: float = 0.0
    weight_grad_stash_bytes: int = 0
    weight_grad_input_bytes: int = 0  # what W reads of the stash (the rest is freed at I)

    def block_cost(self) -> BlockCost:
        """The planner's view of the block (``layer_costs.BlockCost``); a profiler at ``t > 1`` times
        the tensor-parallel all-reduces inside ``forward_s``/``backward_s``, so none are added. The
        weight-gradient share is W's share of the measured I + W, applied to the whole backward: the
        split's own overhead (I + W exceeds a whole backward on the CPU) is in ``extras``, not priced."""
        split = self.backward_input_s + self.backward_weight_s
        # the share first: with no I (the embedding) it is exactly 1, so W is exactly the whole backward
        weight = self.backward_s * (self.backward_weight_s / split) if split > 0 else 0.0
        return BlockCost(forward_s=self.forward_s, backward_s=self.backward_s, params=self.params,
                         stash_bytes=self.stash_bytes, input_bytes=self.input_bytes, output_bytes=self.output_bytes,
                         workspace_bytes=self.workspace_bytes, backward_weight_s=weight,
                         weight_grad_stash_bytes=self.weight_grad_stash_bytes,
                         weight_grad_input_bytes=self.weight_grad_input_bytes)

    @property
    def recompute_stash_bytes(self) -> int:
        """What the block keeps per microbatch with recomputation: its input (token ids are batch data)."""
        return self.input_bytes

    def extras(self) -> dict[str, Any]:
        return {"forward_nograd_s": self.forward_nograd_s, "recompute_stash_bytes": self.recompute_stash_bytes,
                "workspace_measured": self.workspace_measured,
                "forward_samples_s": list(self.forward_samples), "backward_samples_s": list(self.backward_samples),
                "backward_input_s": self.backward_input_s, "backward_weight_s": self.backward_weight_s}


class _Samples:
    """Per-block timing samples and the last measured sizes."""

    def __init__(self) -> None:
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.nograd: list[float] = []
        self.bwd_i: list[float] = []
        self.bwd_w: list[float] = []
        self.stash = self.input = self.output = 0
        self.workspace = 0
        self.kept = 0
        self.read = 0

    def result(self, params: int, workspace_measured: bool) -> BlockMeasurement:
        return BlockMeasurement(
            forward_s=median(self.fwd), backward_s=median(self.bwd), forward_nograd_s=median(self.nograd),
            params=params, stash_bytes=self.stash, input_bytes=self.input, output_bytes=self.output,
            workspace_bytes=int(self.workspace) if workspace_measured else self.stash,
            workspace_measured=workspace_measured, forward_samples=tuple(self.fwd), backward_samples=tuple(self.bwd),
            backward_input_s=median(self.bwd_i), backward_weight_s=median(self.bwd_w),
            weight_grad_stash_bytes=self.kept, weight_grad_input_bytes=self.read,
        )


class _Chain:
    """One chain of blocks, one batch, and the samples of its three block kinds."""

    def __init__(self, emb: nn.Module, layers: Sequence[nn.Module], head: nn.Module, loss_fn: Callable,
                 batch: dict, device: torch.device) -> None:
        self.emb, self.layers, self.head = emb, layers, head
        self.loss_fn, self.batch, self.device = loss_fn, batch, device
        self.cuda = device.type == "cuda"
        self.emb_s, self.lay_s, self.head_s = _Samples(), _Samples(), _Samples()
        excl_params = _storages(unique_params([emb, *layers, head]))
        # the embedding's stash leaves out the token ids: the memory model counts them as its input
        self.emb_saver = SavedBytes(excl_params | _storages(batch.values()))
        self.saver = SavedBytes(excl_params)

    def _fwd(self, samples: _Samples, fn: Callable, saver: SavedBytes, record: bool):
        synchronize(self.device)
        t0 = time.perf_counter()
        with saver.measure():
            out = fn()
        synchronize(self.device)
        if record:
            samples.fwd.append(time.perf_counter() - t0)
        samples.stash = saver.bytes
        return out

    def _bwd(self, samples: _Samples, outs, grads, record: bool) -> None:
        synchronize(self.device)
        if self.cuda:
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        torch.autograd.backward(outs, grads)
        synchronize(self.device)
        if record:
            samples.bwd.append(time.perf_counter() - t0)
        if self.cuda:  # what the backward needs on top of everything allocated before it
            samples.workspace = max(samples.workspace, torch.cuda.max_memory_allocated(self.device) - before)

    def train_pass(self, rec: bool) -> None:
        """Forward block by block, then each block's own backward in reverse order."""
        batch = self.batch
        h = self._fwd(self.emb_s, lambda: self.emb(None, batch), self.emb_saver, rec)
        self.emb_s.input, self.emb_s.output = _nbytes(batch["tokens"]), _nbytes(h)
        inputs, outputs = [], []
        x = h.detach().requires_grad_(True)
        for layer in self.layers:
            inputs.append(x)
            out = self._fwd(self.lay_s, partial(layer, x, batch), self.saver, rec)
            self.lay_s.input, self.lay_s.output = _nbytes(x), _nbytes(out)
            outputs.append(out)
            x = out.detach().requires_grad_(True)
        loss = self._fwd(self.head_s, lambda: self.loss_fn(self.head(x, batch), batch), self.saver, rec)
        self.head_s.input, self.head_s.output = _nbytes(x), 0
        self._bwd(self.head_s, (loss,), None, rec)
        grad = x.grad
        for j in reversed(range(len(self.layers))):
            self._bwd(self.lay_s, (outputs[j],), (grad,), rec)
            grad = inputs[j].grad
        self._bwd(self.emb_s, (h,), (grad,), rec)

    def _split(self, samples: _Samples, block: nn.Module, out: torch.Tensor, grad: torch.Tensor | None,
               x: torch.Tensor, boxes: list, rec: bool) -> torch.Tensor:
        """``block``'s backward as a zero-bubble stage runs it: I (which frees what W will not read), then
        W, each timed; returns I's gradient."""
        params = list(block.parameters())
        index = {accumulator(p): i for i, p in enumerate(params)}
        synchronize(self.device)
        t0 = time.perf_counter()
        dx, deferred = backward_input(out, grad, x, index)
        samples.read = release_unread(boxes, deferred, self.saver.exclude)
        synchronize(self.device)
        t1 = time.perf_counter()
        samples.kept = deferred.nbytes
        backward_weight(deferred, params, index, main_grads=False)
        synchronize(self.device)
        if rec:
            samples.bwd_i.append(t1 - t0)
            samples.bwd_w.append(time.perf_counter() - t1)
        return dx

    def split_pass(self, rec: bool) -> None:
        """Forward block by block, then each block's I and W in reverse order (the embedding has no input
        gradient: its W is its whole backward, and what waits for it is the gradient of its output)."""
        batch = self.batch
        h = self.emb(None, batch)
        inputs, outputs, boxes = [], [], []
        x = h.detach().requires_grad_(True)
        saves = BoxedSaves(self.saver.exclude)
        for layer in self.layers:
            inputs.append(x)
            with saves.measure():
                outputs.append(layer(x, batch))
            boxes.append(saves.boxes)
            x = outputs[-1].detach().requires_grad_(True)
        with saves.measure():
            loss = self.loss_fn(self.head(x, batch), batch)
        grad = self._split(self.head_s, self.head, loss, None, x, saves.boxes, rec)
        for j in reversed(range(len(self.layers))):
            grad = self._split(self.lay_s, self.layers[j], outputs[j], grad, inputs[j], boxes[j], rec)
        synchronize(self.device)
        t0 = time.perf_counter()
        torch.autograd.backward((h,), (grad,))
        synchronize(self.device)
        if rec:
            self.emb_s.bwd_w.append(time.perf_counter() - t0)
        self.emb_s.kept = _nbytes(grad)
        self.emb_s.read = self.emb_s.input  # the token ids its gradient scatters by (the first stage frees nothing)

    @torch.no_grad()
    def nograd_pass(self, rec: bool) -> None:
        """The forward without autograd, each block timed on its own."""
        batch, dev = self.batch, self.device
        synchronize(dev)
        t0 = time.perf_counter()
        y = self.emb(None, batch)
        synchronize(dev)
        t1 = time.perf_counter()
        lay_times = []
        for layer in self.layers:
            ta = time.perf_counter()
            y = layer(y, batch)
            synchronize(dev)
            lay_times.append(time.perf_counter() - ta)
        t2 = time.perf_counter()
        self.loss_fn(self.head(y, batch), batch)
        synchronize(dev)
        t3 = time.perf_counter()
        if rec:
            self.emb_s.nograd.append(t1 - t0)
            self.lay_s.nograd.extend(lay_times)
            self.head_s.nograd.append(t3 - t2)

    def results(self) -> tuple[BlockMeasurement, BlockMeasurement, BlockMeasurement]:
        count = lambda mods: sum(p.numel() for p in unique_params(mods))  # noqa: E731
        return (self.emb_s.result(count([self.emb]), self.cuda),
                self.lay_s.result(count([self.layers[0]]), self.cuda),
                self.head_s.result(count([self.head]), self.cuda))


def measure_chain(
    emb: nn.Module, layers: Sequence[nn.Module], head: nn.Module, loss_fn: Callable, batch: dict,
    device: torch.device, *, warmup: int = 2, reps: int = 5,
) -> tuple[BlockMeasurement, BlockMeasurement, BlockMeasurement]:
    """Time and size the embedding, ``len(layers)`` distinct transformer layers and the head with
    the loss over ``warmup`` untimed and ``reps`` timed repetitions (see the module docstring).
    Per transformer layer: the median over the layers and the repetitions. Also: the forward
    without autograd, the split backward's I and W, and on CUDA each backward's peak above what was
    allocated before it."""
    chain = _Chain(emb, layers, head, loss_fn, batch, device)
    for i in range(warmup + reps):
        chain.train_pass(i >= warmup)
        chain.nograd_pass(i >= warmup)
        chain.split_pass(i >= warmup)
    for p in unique_params([emb, *layers, head]):
        p.grad = None  # the next microbatch size starts from the same memory
    return chain.results()
