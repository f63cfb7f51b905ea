"""The reduction chain runs without the training loop's help.

Rank 0 waits in ``finish`` for a norm all-reduce that needs rank 1's part, while rank 1's loop is
blocked in a receive that rank 0 serves only after its update: the situation of a stage that
blocks in a transfer right after REDUCE_GRADS while its peer reaches APPLY_UPDATE. A chain
advanced by polling from the loop deadlocks here; the issued-at-once chain completes.
"""

import pytest
import torch
import torch.distributed as dist
from multiproc import run_workers

from megatron_2bw.pipeline.grad_reducer import GradReducer

pytestmark = pytest.mark.torch_floor

N = 1 << 21


def _blocked_peer(_):
    rank = dist.get_rank()
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # two replicas of a 2-stage pipeline
    model = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage, replica = rank % 2, rank // 2
    red = GradReducer(dp_group=dp[stage], embedding_group=None, model_group=model[replica], replicas=2,
                      shared_range=None, bucket_numel=N // 2, has_embedding_group=False)
    grad = torch.full((N,), float(rank + 1))  # large enough that its all-reduce is still running below
    red.start(0, grad, [grad])
    if stage == 1:  # blocked until stage 0 has finished its update
        buf = torch.empty(1)
        dist.recv(buf, src=rank - 1)
        sumsq = red.finish(0)
    else:
        sumsq = red.finish(0)
        dist.send(torch.ones(1), dst=rank + 1)
    return grad.unique().tolist(), float(sumsq)


def test_chain_completes_while_the_loop_is_blocked():
    out = run_workers(_blocked_peer, 4, None, timeout=60, pg_timeout=20)
    # stage 0 grads: 1 + 3 = 4 on both replicas; stage 1: 2 + 4 = 6; norm^2 = N*16 + N*36
    for rank, (grad, sumsq) in enumerate(out):
        assert grad == [4.0 if rank % 2 == 0 else 6.0]
        assert abs(sumsq / (N * 52) - 1) < 1e-5
