"""Validated configuration dataclasses of one training run (model, layout, pipeline, optimizer, ...).

Every check happens where the object is built, so a bad layout is refused before any
process group or collective exists. The command-line flags that fill these fields are one
table in ``flags.py``; nothing here imports torch. One module a section: ``model``, ``parallel``
(layout and pipeline), ``optim`` (optimizer, precision, learning rate), ``run`` (length, data,
system, the whole run) and ``rules`` (the checks they share).
"""

from .model import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, ModelConfig, default_ffn_hidden_size
from .optim import (
    AUTO_COMPENSATION,
    COMPENSATIONS,
    DECAY_STYLES,
    DTYPES,
    MUON_ADJUST_LR_FNS,
    OPTIMIZERS,
    WSD_DECAY_STYLES,
    LRConfig,
    OptimizerConfig,
    fp32_grads_for,
    lr_by_samples,
    resolve_compensation,
)
from .parallel import CP_COMM_TYPES, P2P_MODES, ParallelConfig, PipelineConfig
from .rules import FP16_MAX, MAX_SEED
from .run import (
    ATTENTION_BACKENDS,
    CKPT_FORMATS,
    CKPT_GATHER_CHUNK,
    DataConfig,
    Layout,
    RunConfig,
    SystemConfig,
    TrainingConfig,
    layout_configs,
    train_iters_of,
)

__all__ = [
    "ATTENTION_BACKENDS", "AUTO_COMPENSATION", "CKPT_FORMATS", "CKPT_GATHER_CHUNK", "COMPENSATIONS", "DECAY_STYLES",
    "DTYPES", "FP16_MAX", "MAX_SEED", "MUON_ADJUST_LR_FNS", "NORMALIZATIONS", "OPTIMIZERS", "P2P_MODES",
    "POSITION_EMBEDDING_TYPES", "WSD_DECAY_STYLES", "DataConfig", "LRConfig", "Layout", "ModelConfig",
    "CP_COMM_TYPES", "OptimizerConfig", "ParallelConfig", "PipelineConfig", "RunConfig", "SystemConfig",
    "TrainingConfig",
    "default_ffn_hidden_size", "fp32_grads_for", "layout_configs", "lr_by_samples", "resolve_compensation",
    "train_iters_of",
]
