"""The microbatch provider's prefetch (gpu-review-2 P4): the next microbatch's host-to-device copies are issued
on a side stream, and the compute stream waits only for that batch's copy. On the CPU the stream calls go
through a recording stand-in (the ``CopyStreams`` seam); the batches handed out must equal the ones a provider
without prefetch hands out, bitwise, in every request order the executor makes."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from megatron_2bw.errors import ConfigError
from megatron_2bw.models.groups import ModelGroups
from megatron_2bw.training.data_iter import MicrobatchProvider, NoStreams


class Recording:
    """CopyStreams that records which samples were read on the side stream and which marks were handed over."""

    def __init__(self) -> None:
        self.side = False
        self.marks: list[int] = []  # the microbatch each mark was made for, in order
        self.handed: list[tuple[int, int]] = []  # (mark, tensors handed over)
        self.pending: int | None = None

    @contextlib.contextmanager
    def issuing(self):
        assert not self.side
        self.side = True
        try:
            yield
        finally:
            self.side = False

    def mark(self) -> object:
        assert self.side  # the event is recorded on the side stream, after the copies
        self.marks.append(self.pending)
        return len(self.marks) - 1

    def hand_over(self, mark: object, tensors: list[torch.Tensor]) -> None:
        assert not self.side
        self.handed.append((mark, len(tensors)))


class Samples(list):
    """A dataset that notes, for every sample read, whether it was read inside the side stream's context."""

    def __init__(self, n: int, s: int, streams: Recording | None) -> None:
        super().__init__({"tokens": (np.arange(s + 1) * 7 + 13 * i) % 97} for i in range(n))
        self.streams, self.reads = streams, []

    def __getitem__(self, i):
        self.reads.append((i, bool(self.streams and self.streams.side)))
        return super().__getitem__(i)


def _make_batch(tokens: torch.Tensor) -> dict:
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(tokens.shape[0], tokens.shape[1] - 1)}


def _provider(data, **kw) -> MicrobatchProvider:
    return MicrobatchProvider(data, _make_batch, global_batch=4, micro_batch=2, m=2, w=1, dp_rank=0,
                              device=torch.device("cpu"), vocab_size=97, **kw)


@pytest.mark.parametrize("order", [
    [0, 1, 2, 3, 4, 5, 6, 7],  # 1F1B, 2BW, Flush: one forward per microbatch, in order
    [0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5],  # interleaved: each chunk's forward asks again
    [0, 1, 2, 1, 2, 3, 6, 7],  # a re-run of earlier microbatches, then a jump (a later segment)
], ids=["in-order", "chunks", "rerun-jump"])
def test_prefetched_batches_equal_the_direct_ones(order):
    streams = Recording()
    data = Samples(16, 8, streams)
    direct, ahead = _provider(Samples(16, 8, None), prefetch=False), _provider(data, copy_streams=streams)
    orig_prefetch = ahead._prefetch

    def note(mb):
        streams.pending = mb
        return orig_prefetch(mb)

    ahead._prefetch = note
    served = []
    for mb in order:
        before = len(streams.handed)
        got, want = ahead(mb), direct(mb)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), mb
        if len(streams.handed) > before:  # taken from the prefetch: the mark made for this very microbatch
            mark, n = streams.handed[-1]
            assert streams.marks[mark] == mb and n == 3
            served.append(mb)
    # served ahead: exactly the requests for the microbatch after the highest one handed out so far
    assert served == [mb for i, mb in enumerate(order) if i > 0 and mb == max(order[:i]) + 1]
    assert ahead.served_ahead == len(served)
    # the side stream read the samples of the prefetched microbatches only (2 samples each)
    side = [i for i, on_side in data.reads if on_side]
    assert side == [j for mb in streams.marks for j in range(2 * mb, 2 * mb + 2)]


def test_no_prefetch_past_the_data_and_errors_only_when_asked():
    """The last microbatch prefetches nothing (no IndexError early); a bad token id in the prefetched microbatch
    is raised when that microbatch is asked for, not one microbatch early."""
    streams = Recording()
    data = Samples(8, 8, streams)
    data[5]["tokens"][3] = 600
    p = _provider(data, copy_streams=streams)
    p(0), p(1)
    with pytest.raises(ConfigError, match=r"samples \[4, 6\) of the data hold token id 600"):
        p(2)
    data[5]["tokens"][3] = 1
    p(2)
    assert p(3)["tokens"].shape == (2, 8) and p._ahead is None  # samples [8, 10) do not exist: nothing prefetched
    with pytest.raises(IndexError, match="microbatch 4 needs samples"):
        p(4)


def test_cpu_default_is_no_prefetch_and_prefetch_is_a_no_op_on_values():
    """On the CPU the provider does not prefetch unless asked; asked, it runs with no streams."""
    assert _provider(Samples(8, 8, None)).copies is None
    assert isinstance(_provider(Samples(8, 8, None), prefetch=True).copies, NoStreams)


def test_engine_losses_bitwise_with_prefetch():
    """2BW and Flush at d = 1 on a gpt-tiny stage fed by the provider: the same losses and norms with the
    prefetch on (the executor's own request order) as without, and the prefetch serves the microbatches."""
    from megatron_2bw.config import OptimizerConfig, PipelineConfig
    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.parallel_state import ParallelState
    from megatron_2bw.pipeline.build import build_stage

    cfg = get_preset("gpt-tiny")
    b, m, steps = 2, 2, 3
    data = [{"tokens": (np.arange(cfg.seq_length + 1) * (i + 3)) % cfg.vocab_size} for i in range(b * m * steps)]
    for schedule in ("2bw", "flush"):
        runs = []
        for prefetch in (False, True):
            spec = ModelSpec(cfg, ModelGroups(), 1234)
            stage = build_stage(functools.partial(spec.build_stage, 1, 0), spec.loss_fn(), ParallelState.single(),
                                PipelineConfig(schedule, b, m), OptimizerConfig("adam", lr=1e-3),
                                (b, cfg.seq_length, cfg.hidden_size))
            provider = MicrobatchProvider(data, spec.make_batch, global_batch=b * m, micro_batch=b, m=m, w=1,
                                          dp_rank=0, device=torch.device("cpu"), vocab_size=cfg.vocab_size,
                                          prefetch=prefetch)
            res = stage.train(steps, provider, lambda t: 1e-3)
            runs.append([(r.loss, r.grad_norm) for r in res])
            if prefetch:
                assert provider.served_ahead == m * steps - 1  # every microbatch after the first
        assert runs[0] == runs[1] and all(x is not None for x, _ in runs[0]), schedule


def test_side_stream_waits_for_its_event_and_records_the_compute_stream(monkeypatch):
    """SideStream's CUDA calls, with torch.cuda's stream objects stood in for: the copies run under the side
    stream, the event is recorded there, the compute stream waits for that event and every device tensor
    is recorded on the compute stream (so the allocator keeps its memory until the compute is done)."""
    from megatron_2bw.training import data_iter

    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            calls.append(("wait", self.name, event.on))

    class Event:
        def record(self, stream):
            self.on = stream.name
            calls.append(("record", stream.name))

    class Tensor:  # a device tensor as far as hand_over looks
        def __init__(self, kind):
            self.device = torch.device(kind)

        def record_stream(self, stream):
            calls.append(("record_stream", self.device.type, stream.name))

    compute = Stream("compute")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream(f"side:{device}"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(calls.append(("enter", s.name))))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: compute)
    dev = torch.device("cuda", 1)
    side = data_iter.SideStream(dev)
    with side.issuing():
        mark = side.mark()
    side.hand_over(mark, [Tensor("cuda"), Tensor("cpu"), Tensor("cuda")])
    assert calls == [("enter", "side:cuda:1"), ("record", "side:cuda:1"), ("wait", "compute", "side:cuda:1"),
                     ("record_stream", "cuda", "compute"), ("record_stream", "cuda", "compute")]
    # on a CUDA device the provider prefetches through a SideStream unless told not to
    p = MicrobatchProvider(Samples(8, 8, None), _make_batch, global_batch=4, micro_batch=2, m=2, w=1, dp_rank=0,
                           device=dev)
    assert isinstance(p.copies, data_iter.SideStream) and p.copies.stream.name == "side:cuda:1"
    assert MicrobatchProvider(Samples(8, 8, None), _make_batch, global_batch=4, micro_batch=2, m=2, w=1, dp_rank=0,
                              device=dev, prefetch=False).copies is None
