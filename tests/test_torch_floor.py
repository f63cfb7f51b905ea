"""What moves between torch releases, exercised directly (``pytest -m torch_floor`` on the lowest torch the
project declares; docs/gpu.md): DCP's private planner helpers (``_create_read_items``,
``narrow_tensor_by_index``, ``create_read_items_for_chunk_list``), ``FileSystemWriter(overwrite=)``, and SDPA's
``enable_gqa`` under every ``--attention-backend`` (gpu-review-2 N16)."""

from __future__ import annotations

import pytest
import torch

from megatron_2bw.checkpoint.dist_checkpoint import shard_map
from megatron_2bw.checkpoint.dist_checkpoint.files import COMMON
from megatron_2bw.checkpoint.dist_checkpoint.reader import read_whole
from megatron_2bw.checkpoint.dist_checkpoint.shard_map import Chunk
from megatron_2bw.checkpoint.dist_checkpoint.writer import write_and_publish
from megatron_2bw.models.attention_core import attention, unfused_attention

pytestmark = pytest.mark.torch_floor


def test_dcp_round_trip_of_chunks_at_offsets_in_bounded_items(tmp_path, monkeypatch) -> None:
    """Two ranks' halves of one tensor and a whole one, cut into items of at most 1 KiB, written through the
    project's planners into an existing folder (overwrite) and read back whole: every byte where it was."""
    monkeypatch.setattr(shard_map, "MAX_CHUNK_BYTES", 1024)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(64, 24, generator=g)
    other = torch.randn(300, dtype=torch.float64, generator=g).to(torch.bfloat16)
    chunks = [Chunk("model/w", (0, 0), (64, 24), full[:40]), Chunk("model/w", (40, 0), (64, 24), full[40:]),
              Chunk("optimizer/v", (0,), (300,), other)]
    common = {"iteration": 3, "note": "objects go through _create_read_items"}
    path = write_and_publish(str(tmp_path), 3, chunks, {COMMON: common}, None)
    got_common, families = read_whole(path)
    assert got_common == common
    assert torch.equal(families["model"]["w"], full) and torch.equal(families["optimizer"]["v"], other)


@pytest.mark.parametrize("backend", ("auto", "fused", "flash", "unfused"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_grouped_query_attention_matches_expanded_heads(backend: str, dtype: torch.dtype) -> None:
    """SDPA with ``enable_gqa`` (8 query heads on 2 key/value heads) against the same attention with each
    key/value head repeated for its query heads, forward and input gradients."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 16, 8, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 16, 8, generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(2, 2, 16, 8, generator=g).to(dtype).requires_grad_(True)
    out = attention(backend, q, k, v, None, 0.0, True)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = unfused_attention(qr, kr.repeat_interleave(4, dim=1), vr.repeat_interleave(4, dim=1), None, 0.0, True)
    ref.square().sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert torch.allclose(got.double(), want, atol=tol * 10, rtol=tol * 10)
