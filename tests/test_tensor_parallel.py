"""Tensor-parallel layers, loss and whole models at t = 2 and 4 against their dense counterparts."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiproc import run_workers
from pipeline_harness import matching_shard

from megatron_2bw.config.presets import get_preset
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.models.spec import ModelSpec, run_layers
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.group import TPGroup
from megatron_2bw.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_2bw.tensor_parallel.mappings import gather_from_tp

TOL = dict(rtol=1e-5, atol=1e-6)


def _tp_world() -> TPGroup:
    return TPGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def _matching_shard(dense: torch.Tensor, local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The slice of a dense tensor that this rank's shard holds (zero rows where the vocabulary is padded)."""
    return matching_shard(dense, local, tp.rank, tp.size)


def _column_errors(tp: TPGroup, one: TPGroup, x: torch.Tensor, errs: dict) -> None:
    """Column-parallel (gathered output or not) vs dense."""
    for gather in (True, False):
        col, ref = (ColumnParallelLinear(16, 24, g, seed=7, name="c", std=0.1, gather_output=gather) for g in (tp, one))
        with torch.no_grad():
            ref.bias.normal_(generator=torch.Generator().manual_seed(1))
            col.bias.copy_(_matching_shard(ref.bias, col.bias, tp))
        xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        ya, yb = col(xa), ref(xb)
        if not gather:
            ya = gather_from_tp(ya, tp)
        torch.testing.assert_close(ya, yb, **TOL)
        (ya * torch.arange(24.0)).sum().backward()
        (yb * torch.arange(24.0)).sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, **TOL)
        torch.testing.assert_close(col.weight.grad, _matching_shard(ref.weight.grad, col.weight, tp), **TOL)
        torch.testing.assert_close(col.bias.grad, _matching_shard(ref.bias.grad, col.bias, tp), **TOL)
        errs[f"column_gather={gather}"] = (ya - yb).abs().max().item()


def _row_and_embedding_errors(tp: TPGroup, one: TPGroup, errs: dict) -> int:
    """Row-parallel (input split along the last dim) and the vocab-parallel embedding vs dense; the padded vocab."""
    row, ref = (RowParallelLinear(24, 16, g, seed=8, name="r", std=0.1) for g in (tp, one))
    xin = torch.randn(3, 5, 24)
    xa = xin.chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    xb = xin.clone().requires_grad_()
    ya, yb = row(xa), ref(xb)
    torch.testing.assert_close(ya, yb, **TOL)
    (ya.square()).sum().backward()
    (yb.square()).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad.chunk(tp.size, -1)[tp.rank], **TOL)
    torch.testing.assert_close(row.weight.grad, _matching_shard(ref.weight.grad, row.weight, tp), **TOL)
    torch.testing.assert_close(row.bias.grad, ref.bias.grad, **TOL)
    errs["row"] = (ya - yb).abs().max().item()
    # Vocab-parallel embedding (vocab 300 padded to 128 * t).
    pad = 128 * tp.size * 3
    emb = VocabParallelEmbedding(300, pad, 8, tp, seed=9, name="e", std=0.5)
    ref = VocabParallelEmbedding(300, pad, 8, one, seed=9, name="e", std=0.5)
    ids = torch.randint(0, 300, (4, 7), generator=torch.Generator().manual_seed(3))
    ya, yb = emb(ids), ref(ids)
    torch.testing.assert_close(ya, yb, **TOL)
    (ya * 1.5).sum().backward()
    (yb * 1.5).sum().backward()
    torch.testing.assert_close(emb.weight.grad, _matching_shard(ref.weight.grad, emb.weight, tp), **TOL)
    errs["embedding"] = (ya - yb).abs().max().item()
    return pad


def _cross_entropy_error(tp: TPGroup, pad: int) -> float:
    """Vocab-parallel cross-entropy vs F.cross_entropy over the real vocabulary only."""
    vocab = 300
    full = torch.randn(6, 9, pad, generator=torch.Generator().manual_seed(4)) * 3
    target = torch.randint(0, vocab, (6, 9), generator=torch.Generator().manual_seed(5))
    local = full.chunk(tp.size, -1)[tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, vocab, tp)
    dense = full[..., :vocab].clone().requires_grad_()
    ref_loss = F.cross_entropy(dense.reshape(-1, vocab), target.reshape(-1), reduction="none").view(6, 9)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    w = torch.rand(6, 9, generator=torch.Generator().manual_seed(6))
    (loss * w).sum().backward()
    (ref_loss * w).sum().backward()
    ref_grad = torch.cat([dense.grad, torch.zeros(6, 9, pad - vocab)], -1)
    torch.testing.assert_close(local.grad, ref_grad.chunk(tp.size, -1)[tp.rank], **TOL)
    return (loss - ref_loss).abs().max().item()


def _layers_worker() -> dict:
    tp, one = _tp_world(), TPGroup()
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    errs: dict[str, float] = {}
    _column_errors(tp, one, x, errs)
    pad = _row_and_embedding_errors(tp, one, errs)
    errs["cross_entropy"] = _cross_entropy_error(tp, pad)
    return errs


def test_layers_match_dense_t2():
    for errs in run_workers(_layers_worker, 2):
        assert max(errs.values()) < 1e-5


def test_layers_match_dense_t4():
    for errs in run_workers(_layers_worker, 4):
        assert max(errs.values()) < 1e-5


def _model_outputs(kind: str, tp: TPGroup):
    cfg = get_preset(kind)
    spec = ModelSpec(cfg, ModelGroups(tp), seed=1234)
    layers = spec.build(0, spec.num_items)
    g = torch.Generator().manual_seed(11)
    s = cfg.seq_length
    if cfg.kind == "gpt":
        batch = spec.make_batch(torch.randint(0, cfg.vocab_size, (2, s + 1), generator=g))
    else:
        pad = torch.ones(2, s)
        pad[1, s - 3:] = 0
        batch = spec.make_batch(dict(
            tokens=torch.randint(0, cfg.vocab_size, (2, s), generator=g),
            token_types=(torch.arange(s) >= s // 2).long().expand(2, s),
            labels=torch.randint(0, cfg.vocab_size, (2, s), generator=g),
            loss_mask=(torch.rand(2, s, generator=g) < 0.3).float(),
            padding_mask=pad, sop_label=torch.tensor([0, 1]),
        ))
    out = run_layers(layers, batch)
    loss = spec.loss_fn()(out, batch)
    loss.backward()
    logits = out if cfg.kind == "gpt" else out[0]
    names = [(n, p) for i, layer in enumerate(layers) for n, p in layer.named_parameters(prefix=str(i))]
    return loss.detach(), gather_from_tp(logits.detach(), tp), names


def _model_worker(kind: str) -> float:
    tp = _tp_world()
    loss, logits, params = _model_outputs(kind, tp)
    ref_loss, ref_logits, ref_params = _model_outputs(kind, TPGroup())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    vocab = get_preset(kind).vocab_size
    torch.testing.assert_close(logits[..., :vocab], ref_logits[..., :vocab], rtol=1e-4, atol=1e-5)
    assert [n for n, _ in params] == [n for n, _ in ref_params]
    worst = 0.0
    for (name, p), (_, ref) in zip(params, ref_params):
        want = _matching_shard(ref.grad, p, tp)
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        worst = max(worst, (p.grad - want).abs().max().item())
    return worst


def test_gpt_and_bert_t2_match_t1():
    for kind in ("gpt-tiny", "bert-tiny"):
        assert max(run_workers(_model_worker, 2, kind)) < 1e-5
