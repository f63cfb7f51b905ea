"""Context-parallel attention at c = 2 against the dense core on the whole sequence (issue 36).

Each rank draws the same whole-sequence q, k, v (and mask), keeps its two chunks in the load-balanced
order, runs the context-parallel core and back-propagates a fixed random output gradient; its outputs
and its chunks' gradients of q, k and v must equal the dense core's (fp32, within 1e-5 of rounding):
causal (GPT), grouped-query heads (Llama), non-causal with a padding mask (BERT) and a document mask
(--reset-attention-mask), each with every communication type (p2p, all_gather, a2a). Documents also
travel as their ids ``[b, s]`` (what the trainer sends under context parallelism), each with the fused
kernel (``auto``: torch's CPU flash kernel, which returns the log-sum-exp) and the written-out core
(``unfused``), in tiles of 3 query rows so that every block is cut into several tiles and a partial one.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.context_parallel.group import CPGroup, positions_of, shard_batch
from megatron_2bw.models.attention_core import attention

B, S, HD = 2, 16, 8


def _inputs(heads: int, groups: int, mask_kind: str | None):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, heads, S, HD, generator=g, dtype=torch.float64).float()
    k = torch.randn(B, groups, S, HD, generator=g, dtype=torch.float64).float()
    v = torch.randn(B, groups, S, HD, generator=g, dtype=torch.float64).float()
    dout = torch.randn(B, heads, S, HD, generator=g)
    mask = None
    if mask_kind == "padding":  # BERT: the last keys of sequence 1 are padding
        pad = torch.ones(B, S, dtype=torch.bool)
        pad[1, -5:] = False
        mask = pad[:, None, None, :]
    elif mask_kind in ("documents", "document-ids"):  # GPT --reset-attention-mask: documents of 5, 6, 5 tokens
        doc = torch.tensor([[0] * 5 + [1] * 6 + [2] * 5, [0] * 2 + [1] * 14])
        mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril())[:, None]
        mask = doc if mask_kind == "document-ids" else mask
    return q, k, v, dout, mask


def _dense(heads, groups, causal, mask_kind, backend):
    q, k, v, dout, mask = _inputs(heads, groups, "documents" if mask_kind == "document-ids" else mask_kind)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(backend, q, k, v, mask, 0.0, causal and mask is None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_worker(heads, groups, causal, mask_kind, comm, backend):
    from megatron_2bw.context_parallel import blocks  # noqa: PLC0415
    from megatron_2bw.context_parallel.a2a import a2a_attention  # noqa: PLC0415
    from megatron_2bw.context_parallel.attention import all_gather_attention, ring_attention  # noqa: PLC0415
    from megatron_2bw.models.transformer import ParallelAttention  # noqa: PLC0415

    blocks.TILE_ROWS = 3  # several tiles per block (n = 4), the last one partial
    c, rank = dist.get_world_size(), dist.get_rank()
    cp = CPGroup(dist.new_group(list(range(c))), rank, c, comm, tuple(range(c)))
    q, k, v, dout, mask = _inputs(heads, groups, mask_kind)
    idx = positions_of(S, c, rank)
    batch = shard_batch({"tokens": torch.zeros(B, S, dtype=torch.long), **({} if mask is None else
                                                                         {"attention_mask": mask})}, cp)
    local = [x.index_select(2, idx).clone().requires_grad_() for x in (q, k, v)]
    m = batch.get("attention_mask")
    if comm == "p2p":
        out = ring_attention(cp, *local, m, 0.0, causal, backend)
    else:
        exchange = a2a_attention if comm == "a2a" else all_gather_attention
        out = exchange(cp, backend, partial(attention, backend), *local, m, 0.0, causal)
    out.backward(dout.index_select(2, idx))
    assert ParallelAttention is not None
    return idx, out.detach(), *(x.grad for x in local)


CASES = {  # id: (heads, key/value groups, causal, mask)
    "gpt": (4, 4, True, None),
    "llama-gqa": (4, 2, True, None),
    "bert-padding": (4, 4, False, "padding"),
    "gpt-documents": (4, 4, True, "documents"),
    "gpt-document-ids": (4, 4, True, "document-ids"),
    "llama-document-ids": (4, 2, True, "document-ids"),
}
BACKENDS = {"gpt-document-ids": ("auto", "unfused"), "llama-document-ids": ("auto", "unfused"),
            "bert-padding": ("auto", "unfused")}


def _backends(case: str) -> tuple[str, ...]:
    return BACKENDS.get(case, ("unfused",) if CASES[case][3] else ("auto",))


COMBOS = [(case, comm, backend) for case in CASES for comm in ("p2p", "all_gather", "a2a")
          for backend in _backends(case)]


def _all_cases_worker():
    """Every (case, communication type) on one set of processes (one spawn for the whole table)."""
    out = []
    for case, comm, backend in COMBOS:
        heads, groups, causal, mask_kind = CASES[case]
        out.append(_cp_worker(heads, groups, causal, mask_kind, comm, backend))
    return out


@pytest.fixture(scope="module")
def cp_runs():
    return run_workers(_all_cases_worker, 2, timeout=180)


@pytest.mark.parametrize("case, comm, backend", COMBOS)
def test_context_parallel_core_equals_dense(cp_runs, case, comm, backend):
    heads, groups, causal, mask_kind = CASES[case]
    ref = _dense(heads, groups, causal, mask_kind, "unfused" if mask_kind else "auto")
    k = COMBOS.index((case, comm, backend))
    for idx, *got in (rank[k] for rank in cp_runs):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            err = (a - b.index_select(2, idx)).abs().max().item()
            assert err < 1e-5, (case, comm, name, err)


def test_positions_balance_causal_work():
    """Rank r holds chunks r and 2c-1-r: every rank's causal work (keys seen per query) is the same."""
    for c in (2, 4):
        work = [int((positions_of(64, c, r) + 1).sum()) for r in range(c)]
        assert len(set(work)) == 1, work
        assert sorted(torch.cat([positions_of(64, c, r) for r in range(c)]).tolist()) == list(range(64))


def _dropout_worker(p):
    from megatron_2bw.context_parallel.ring import ring_attention  # noqa: PLC0415

    c, rank = dist.get_world_size(), dist.get_rank()
    cp = CPGroup(dist.new_group(list(range(c))), rank, c, "p2p", tuple(range(c)))
    q, k, v, dout, _ = _inputs(4, 2, None)
    idx = positions_of(S, c, rank)
    x = [t.index_select(2, idx).clone() for t in (q, k, v)]
    u = [torch.randn(t.shape, generator=torch.Generator().manual_seed(11 + rank)) for t in x]
    dout = dout.index_select(2, idx)

    def total(xs, grad=False):
        torch.manual_seed(5 + rank)  # the same dropout draws at every evaluation
        xs = [t.clone().requires_grad_(grad) for t in xs]
        f = (ring_attention(cp, *xs, None, p, True) * dout).sum()
        if grad:
            f.backward()
        out = f.detach().clone().double()
        dist.all_reduce(out)
        return out, [t.grad for t in xs] if grad else None

    _, grads = total(x, grad=True)
    along = torch.tensor(sum(float((g * d).sum()) for g, d in zip(grads, u)), dtype=torch.float64)
    dist.all_reduce(along)
    eps = 1e-2
    plus, _ = total([t + eps * d for t, d in zip(x, u)])
    minus, _ = total([t - eps * d for t, d in zip(x, u)])
    return float(along), float((plus - minus) / (2 * eps))


def test_ring_dropout_backward_replays_the_forwards_masks():
    """With attention dropout the ring's backward redraws each block's mask from its saved generator state:
    the gradient along a random direction equals the loss's central difference (fp32 blocks: 1e-3 relative;
    a mask not replayed is off by order one)."""
    along, numeric = run_workers(_dropout_worker, 2, 0.3, timeout=120)[0]
    assert abs(along - numeric) <= 1e-3 * max(1.0, abs(numeric)), (along, numeric)
