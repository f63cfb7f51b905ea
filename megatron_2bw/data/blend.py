"""Weighted blends of datasets: Megatron's ``--data-path W1 PREFIX1 W2 PREFIX2 ...``.

Sample ``i`` of a blend comes from the dataset whose achieved count lags its weight most:
the one minimizing ``(count_d + 1/2) / w_d``, lowest index on ties. That greedy rule is the
same as placing dataset ``d``'s ``k``-th sample at its ideal time ``(k + 1/2) / w_d`` and
merging all datasets by time, so the whole index is one vectorized sort, and every prefix of
the blend holds each dataset within about one sample of its weight share.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import ConfigError

_DATA_PATH_FORM = "give one PREFIX or pairs W1 PREFIX1 W2 PREFIX2 ..."


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """``[PREFIX]`` or ``[W1, P1, W2, P2, ...]`` -> (prefixes, weights normalized to sum 1)."""
    data_path = list(data_path)
    if not data_path:
        raise ConfigError(f"--data-path is empty; {_DATA_PATH_FORM}")
    if len(data_path) == 1:
        return data_path, [1.0]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path has {len(data_path)} entries, an odd number; {_DATA_PATH_FORM}")
    weights, prefixes = [], []
    for w, prefix in zip(data_path[0::2], data_path[1::2]):
        try:
            value = float(w)
        except ValueError:
            raise ConfigError(f"--data-path weight {w!r} is not a number; {_DATA_PATH_FORM}") from None
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--data-path weight {w!r} (for {prefix}) must be a positive number")
        weights.append(value)
        prefixes.append(prefix)
    total = sum(weights)
    if not math.isfinite(total):
        raise ConfigError(f"--data-path weights {' '.join(map(str, data_path[0::2]))} sum to more than the largest "
                          "float; give weights of a sensible size (fractions or percentages)")
    return prefixes, [w / total for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index within that dataset) for each of ``size`` blended samples."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(w > 0):
        raise ConfigError(f"blend weights must be positive, got {list(weights)}")
    w = w / w.sum()
    if size <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # Dataset d has floor(w_d * t + 1/2) events by time t, and the size-th event comes by
    # t = size + D/2, which bounds how many events each dataset needs.
    horizon = size + len(w) / 2
    counts = np.floor(w * horizon + 0.5).astype(np.int64) + 1
    ids = np.repeat(np.arange(len(w)), counts)
    ks = np.arange(ids.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    times = (ks + 0.5) / w[ids]
    order = np.lexsort((ids, times))[:size]
    return ids[order], ks[order]


class BlendedDataset:
    """Mixes ``datasets`` by ``weights`` over ``size`` samples, deterministically.

    ``datasets[d]`` may be None when the blend takes no sample from it (a tiny weight).
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ConfigError(f"{len(datasets)} datasets but {len(weights)} blend weights")
        self.datasets = list(datasets)
        self.size = size
        self.dataset_index, self.sample_index = blending_indices(weights, size)
        need = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, need)):
            have = 0 if ds is None else len(ds)
            if have < n:
                raise ConfigError(f"blend needs {n} samples from dataset {d} but it has {have}")
        self.samples_per_dataset = need

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
