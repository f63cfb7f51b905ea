"""The precision recipe of a run's GEMMs, resolved once from the precision flags (``--fp16``/``--bf16``).

Every forward and weight-gradient GEMM of the model goes through ``tensor_parallel/gemm.py``, which takes a
:class:`Precision`. Today's three recipes run torch's GEMM in the operands' own dtype (``gemm="native"``)
and keep no scale state. A scaled recipe (FP8, current or delayed scaling) is one more ``GEMM_KINDS`` entry,
its kernel in ``gemm.py`` and its scale state in each layer's ``GemmState`` (saved by the checkpoint
formats through ``gemm.gemm_state_dict``). Torch-free, like the rest of ``config/``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .optim import DTYPES

GEMM_KINDS = ("native",)  # how the GEMM runs: "native" = torch's GEMM in the operands' dtype


@dataclass(frozen=True)
class Precision:
    """One GEMM recipe: its name, the dtype weights and activations are held in, and the GEMM kind."""

    name: str
    dtype: str  # fp32 / bf16 / fp16: the weights' and activations' dtype (OptimizerConfig.dtype)
    gemm: str = "native"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"precision recipe {self.name!r}: dtype must be one of {', '.join(DTYPES)}, "
                              f"got {self.dtype!r}")
        if self.gemm not in GEMM_KINDS:
            raise ConfigError(f"precision recipe {self.name!r}: GEMM kind must be one of {', '.join(GEMM_KINDS)}, "
                              f"got {self.gemm!r}")

    @property
    def scaled(self) -> bool:
        """Whether the GEMM operands carry scales (an FP8 recipe): then each linear layer keeps scale state."""
        return self.gemm != "native"


RECIPES: dict[str, Precision] = {d: Precision(d, d) for d in DTYPES}


def precision_of(dtype: str) -> Precision:
    """The recipe of a run trained in ``dtype`` (``OptimizerConfig.dtype``, from --fp16/--bf16)."""
    if dtype not in RECIPES:
        raise ConfigError(f"precision must be one of {', '.join(RECIPES)}, got {dtype!r}")
    return RECIPES[dtype]
