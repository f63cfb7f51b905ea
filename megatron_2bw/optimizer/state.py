"""The one description of an optimizer's checkpointable state, read by every checkpoint format.

Each flat optimizer (and the :class:`~..pipeline.updater.Updater` around it) states its per-parameter
state once, in :meth:`state_spans`: a name (``exp_avg``, ``exp_avg_sq``, ``buf``) and the *live*
1-D tensors holding it, each placed at its first element in the optimizer's flat coordinates
(``numel`` elements: the stage's flat buffer, or this rank's shard of it). Elements no span covers
are zero and never read (Muon keeps Adam's second moment on the AdamW elements only). Scalars
(``steps``) come from :meth:`state_scalars`.

The torch format materializes each name as one whole flat tensor (:func:`whole`) and loads one
back span by span (:func:`load_whole`); the torch_dist format offers DCP the spans themselves and
reads straight into them, so no format keeps a second list of what an optimizer holds, and no
format reads into a temporary copy of the state (gpu-review-2 N10).
"""

from __future__ import annotations

import torch

Span = tuple[int, torch.Tensor]  # (first element in the state's flat coordinates, live 1-D tensor)


def whole(spans: list[Span], numel: int, copy: bool = False) -> torch.Tensor:
    """The whole ``numel``-element tensor: the live tensor itself when one span covers it all (unless
    ``copy``), else a new zero tensor with every span copied in."""
    if len(spans) == 1 and spans[0][0] == 0 and spans[0][1].numel() == numel:
        return spans[0][1].clone() if copy else spans[0][1]
    first = spans[0][1] if spans else None
    out = torch.zeros(numel, dtype=first.dtype if first is not None else torch.float32,
                      device=first.device if first is not None else "cpu")
    for start, t in spans:
        out[start:start + t.numel()].copy_(t)
    return out


def load_whole(spans: list[Span], full: torch.Tensor) -> None:
    """Copy each span's elements from the whole tensor ``full`` into the live tensors."""
    for start, t in spans:
        t.copy_(full[start:start + t.numel()])


def holes(spans: list[Span], numel: int) -> list[tuple[int, int]]:
    """The ``[a, b)`` ranges of ``[0, numel)`` no span covers (zeros that a whole tensor holds)."""
    out, prev = [], 0
    for start, t in sorted(spans, key=lambda s: s[0]):
        if start > prev:
            out.append((prev, start))
        prev = max(prev, start + t.numel())
    if prev < numel:
        out.append((prev, numel))
    return out


def span_bytes(spans: list[Span]) -> int:
    return sum(t.numel() * t.element_size() for _, t in spans)


class FlatState:
    """The state-dict methods every flat optimizer shares, derived from its :meth:`state_spans`.

    Subclasses set ``numel`` (the elements of each whole state tensor) and ``steps``."""

    numel: int
    steps: int

    def state_spans(self) -> dict[str, list[Span]]:
        """Every per-parameter state tensor, by name, as live spans (see the module docstring)."""
        raise NotImplementedError

    def state_scalars(self) -> dict:
        return {"steps": self.steps}

    def load_scalars(self, sd: dict) -> None:
        self.steps = int(sd["steps"])

    @property
    def state_bytes(self) -> int:
        return sum(span_bytes(s) for s in self.state_spans().values())

    def state_dict(self) -> dict:
        """Whole flat tensors (live ones where a single span covers the state) and the scalars."""
        return {**{k: whole(s, self.numel) for k, s in self.state_spans().items()}, **self.state_scalars()}

    def load_state_dict(self, sd: dict) -> None:
        for k, s in self.state_spans().items():
            load_whole(s, sd[k])
        self.load_scalars(sd)

    def snapshot(self) -> dict:
        """A copy of the live state (spans and scalars) for :meth:`restore_snapshot`: no whole-size temporaries."""
        return {"spans": {k: [t.clone() for _, t in s] for k, s in self.state_spans().items()},
                "scalars": dict(self.state_scalars())}

    def restore_snapshot(self, snap: dict) -> None:
        for k, s in self.state_spans().items():
            for (_, t), kept in zip(s, snap["spans"][k]):
                t.copy_(kept)
        self.load_scalars(snap["scalars"])


def fused_adamw_available() -> bool:
    """torch's fused AdamW kernel (CPU and CUDA) exists in this build."""
    return hasattr(torch, "_fused_adamw_")
