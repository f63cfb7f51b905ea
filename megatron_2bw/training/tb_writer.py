"""TensorBoard events (``--tensorboard-dir``) through ``torch.utils.tensorboard.SummaryWriter``.

The ``tensorboard`` package is an install extra (``pip install -e '.[tensorboard]'``);
asking for TensorBoard without it is a one-line error that names the extra, checked before
any process group exists (:func:`require_tensorboard`). Scalars are named
``<prefix>/<key>`` (``train/loss``, ``valid/ppl``) at the 1-based iteration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import ConfigError

INSTALL_HINT = "pip install -e '.[tensorboard]'"


def finite_scalars(values: Mapping[str, object]) -> dict[str, float]:
    """The finite int/float entries of ``values`` (a writer cannot plot None, NaN or a bool)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def require_tensorboard() -> None:
    """Raise a one-line ConfigError when ``tensorboard`` is not importable."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError(f"--tensorboard-dir needs the tensorboard package: {INSTALL_HINT}") from None


class TensorBoardWriter:
    """One event file directory; rank 0 (the rank that holds ``Metrics``) owns the only writer."""

    def __init__(self, log_dir: str) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, prefix: str, values: Mapping[str, object], step: int) -> None:
        for k, v in finite_scalars(values).items():
            self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(log_dir: str | None) -> TensorBoardWriter | None:
    """A writer for ``--tensorboard-dir``, or None when the flag is not given."""
    return TensorBoardWriter(log_dir) if log_dir else None


__all__ = ["INSTALL_HINT", "TensorBoardWriter", "finite_scalars", "open_tensorboard", "require_tensorboard"]
