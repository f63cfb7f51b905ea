"""Kernel choice: torch's paths on CPU, apex only when forced on CUDA with apex, logged once."""

import logging

import pytest
import torch

from megatron_2bw.errors import ConfigError
from megatron_2bw.fused import Kernels, layer_norm, select_kernels


def test_cpu_auto_uses_torch_paths_and_logs_the_choice(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_2bw.fused"):
        k = select_kernels("auto", "cpu")
    assert k == Kernels(layer_norm="torch")
    assert len(caplog.records) == 1  # one line per selection, whatever its wording
    assert isinstance(layer_norm(8, 1e-5, k), torch.nn.LayerNorm)


def test_forcing_apex_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="--fused-kernels apex needs CUDA"):
        select_kernels("apex", "cpu")
    with pytest.raises(ConfigError, match="must be auto, apex or torch"):
        select_kernels("fast", "cpu")
    assert select_kernels("torch", "cuda").layer_norm == "torch"
