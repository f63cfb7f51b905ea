"""A backward split in two, input gradient now and weight gradients later, from one autograd graph.

Zero-bubble schedules run BACKWARD_INPUT (I) as soon as the next stage's gradient arrives, so the
previous stage gets its gradient after the input-gradient GEMMs alone, and BACKWARD_WEIGHT (W) later,
where the pipeline would otherwise idle. Both halves come from the graph the forward (or, with stage
recomputation, I's re-run) built; nothing is computed twice. This is what torch's
``torch.distributed.pipelining._backward`` (``stage_backward_input`` / ``stage_backward_weight``) does:

- I finds, for every parameter, the nodes where its path joins the path from the stage input to the
  output (its *first-use* nodes: the GEMM a weight enters, the layer norm its scale enters), runs
  ``autograd.grad(output, input, retain_graph=True)`` with a pre-hook on each such node that keeps
  the gradient arriving there (``dY`` of the GEMM), and returns the input's gradient. The engine
  computes only the outputs of a node that lead to the input, so no weight GEMM runs in I; tensor
  parallelism's all-reduces sit on the input path and run here.
- W runs, per group of parameters sharing first-use nodes, ``autograd.grad`` from those nodes' edges
  with the kept gradients to the parameters' accumulators: only the weight side of each node (``dW =
  dY^T X``) runs, no input-gradient GEMM and no collective, and the graph is freed as it goes.

Custom autograd Functions that compute their input and weight gradients in one backward (the
sequence-parallel column GEMMs) read :func:`phase` and compute only the half asked for.

The first stage has no input gradient to send: its I does nothing and its W runs the whole backward
(torch does the same). Layer-level recomputation (``--recompute-granularity``, torch checkpoints)
re-runs its checkpointed forwards once per autograd pass: in I, and again in W for the regions whose
saved tensors W's nodes read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from ..tensor_parallel.backward_phase import in_phase as _in_phase  # noqa: F401 - phase re-exported
from .wgrad_fusion import fused_weight_grad


def accumulator(t: torch.Tensor) -> Node:
    """``t``'s grad_fn, or for a leaf its AccumulateGrad node (created on demand through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclass
class _Group:
    """Parameters (by accumulator node) whose gradients start at the same first-use nodes."""

    params: list[Node]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)
    # the nodes between the first-use nodes and the parameters (casts, transposes, views): with ``nodes``
    # what W runs, so the saved tensors W reads (``saved_release``)
    side: set[Node] = field(default_factory=set)


@dataclass
class DeferredWeightGrad:
    """What I keeps for W: the parameter groups with the gradients caught at their first-use nodes
    (which keep the rest of the graph alive), and the bytes of those gradients."""

    groups: list[_Group]

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for g in self.groups:
            for grads in g.grads:
                for t in grads or ():
                    if t is not None and t.untyped_storage().data_ptr() not in seen:
                        seen.add(t.untyped_storage().data_ptr())
                        total += t.untyped_storage().nbytes()
        return total


def _reverse_edges(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root`` -> the nodes that feed it gradients (its consumers)."""
    rev: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for fn, _ in node.next_functions:
            if fn is None:
                continue
            users = rev.get(fn)
            if users is None:
                rev[fn] = [node]
                queue.append(fn)
            else:
                users.append(node)
    return rev


def _groups(root: Node, input_node: Node, params: dict[Node, int]) -> list[_Group]:
    """Group the graph's parameters by the nodes where their paths join the input's path."""
    rev = _reverse_edges(root)
    on_input: set[Node] = {input_node}  # nodes whose result depends on the stage input
    queue = deque([input_node])
    while queue:
        for user in rev.get(queue.popleft(), ()):
            if user not in on_input:
                on_input.add(user)
                queue.append(user)
    by_node: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for acc in params:
        if acc not in rev:
            continue  # not used by this microbatch
        seen, joins, queue = {acc}, [], deque([acc])
        while queue:
            for user in rev[queue.popleft()]:
                if user in seen:
                    continue
                seen.add(user)
                if user in on_input:
                    joins.append(user)
                else:
                    queue.append(user)
        merged = {id(by_node[n]): by_node[n] for n in joins if n in by_node}
        side = seen.difference(joins)
        if not merged:
            group = _Group([acc], list(joins), side=side)
            groups.append(group)
        else:  # joins another parameter's group: one group (a node's weight and bias, a shared weight)
            group, *others = merged.values()
            group.params.append(acc)
            group.side |= side
            for other in others:
                group.params += other.params
                group.nodes += [n for n in other.nodes if n not in group.nodes]
                group.side |= other.side
                groups.remove(other)
            group.nodes += [n for n in joins if n not in group.nodes]
        for n in group.nodes:
            by_node[n] = group
    return groups


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, inp: torch.Tensor,
                   params: dict[Node, int]) -> tuple[torch.Tensor, DeferredWeightGrad]:
    """The gradient of ``output`` (a loss when ``grad_output`` is None) w.r.t. the leaf ``inp``, and
    what :func:`backward_weight` needs for the parameters (``params``: accumulator node -> index)."""
    groups = _groups(accumulator(output), accumulator(inp), params)
    handles = []
    try:
        for g in groups:
            g.grads = [None] * len(g.nodes)
            for i, node in enumerate(g.nodes):
                def keep(grad_outputs, g=g, i=i):
                    g.grads[i] = grad_outputs
                handles.append(node.register_prehook(keep))
        with _in_phase("input"):
            (dx,) = torch.autograd.grad(output, inp, grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return dx, DeferredWeightGrad(groups)


def take_groups(deferred: DeferredWeightGrad, indices: list[int], params: dict[Node, int]) -> DeferredWeightGrad:
    """Split off the groups holding any of the parameters ``indices`` (``params``: accumulator node -> index),
    to run their weight gradients now (the last stage's tied head weight, which the tied embedding's early
    reduction needs); ``deferred`` keeps the rest."""
    wanted = {acc for acc, i in params.items() if i in set(indices)}
    taken = [g for g in deferred.groups if wanted.intersection(g.params)]
    deferred.groups = [g for g in deferred.groups if not wanted.intersection(g.params)]
    return DeferredWeightGrad(taken)


def backward_weight(deferred: DeferredWeightGrad, params: list[torch.Tensor], index: dict[Node, int],
                    main_grads: bool) -> None:
    """Add the weight gradients I deferred into each parameter's ``.grad`` (or ``.main_grad``, fp32
    accumulation): what AccumulateGrad (or the main-grad hook) does in a whole backward. A group of one
    common node (a linear's GEMM, a norm's scale, a bias) is done by :mod:`.wgrad_fusion` in place."""
    for g in deferred.groups:
        if len(g.nodes) == 1:
            targets = {acc: params[index[acc]].main_grad if main_grads else params[index[acc]].grad for acc in g.params}
            if None not in targets.values() and fused_weight_grad(g.nodes[0], g.grads[0], set(g.params), targets):
                continue
        edges, grads = [], []
        for node, caught in zip(g.nodes, g.grads):
            for k, grad in enumerate(caught or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(grad)
        if not edges:
            continue
        handles = []
        if len(g.nodes) > 1:  # a node below another one of the group must not count its gradient twice
            handles = [node.register_prehook(lambda _, c=caught: c) for node, caught in zip(g.nodes, g.grads)]
        try:
            with _in_phase("weight"):
                dws = torch.autograd.grad(edges, [GradientEdge(acc, 0) for acc in g.params], grads,
                                          allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for acc, dw in zip(g.params, dws):
            if dw is None:
                continue
            p = params[index[acc]]
            if main_grads:
                p.main_grad.add_(dw)
            elif p.grad is None:
                p.grad = dw
            else:
                p.grad.add_(dw)
    deferred.groups = []  # frees the graph
