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


def _fake_apex(root, *, normalization: bool, cuda_ext: bool) -> None:
    """An ``apex`` package on disk: bare (the unrelated PyPI apex), with a Python-only
    ``apex.normalization`` (apex built without --cuda_ext), or with a stand-in CUDA extension."""
    pkg = root / "apex"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if normalization:
        (pkg / "normalization").mkdir()
        (pkg / "normalization" / "__init__.py").write_text("from .fused_layer_norm import FusedLayerNorm\n")
        (pkg / "normalization" / "fused_layer_norm.py").write_text(
            "import torch\n\nclass FusedLayerNorm(torch.nn.LayerNorm):\n    pass\n")
    if cuda_ext:
        (root / "fused_layer_norm_cuda.py").write_text("")


@pytest.fixture
def fake_cuda(monkeypatch):
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield monkeypatch
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.") or n == "fused_layer_norm_cuda"]:
        del sys.modules[name]


@pytest.mark.parametrize("normalization", [False, True], ids=["pypi-apex", "apex-without-cuda-ext"])
def test_an_apex_without_its_kernels_is_not_chosen_and_the_model_builds(fake_cuda, tmp_path, caplog, normalization):
    """Review C3: any package named apex used to switch the kernels under --fused-kernels auto."""
    from megatron_2bw.models.presets import get_preset
    from megatron_2bw.models.spec import ModelSpec
    from megatron_2bw.tensor_parallel.group import TPGroup

    _fake_apex(tmp_path, normalization=normalization, cuda_ext=False)
    fake_cuda.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="megatron_2bw.fused"):
        k = select_kernels("auto", "cuda")
    assert k == Kernels(layer_norm="torch")
    missing, absent = (("fused_layer_norm_cuda",) * 2 if normalization
                       else ("apex.normalization.fused_layer_norm", "apex.normalization"))
    assert [r.getMessage() for r in caplog.records] == [
        f"fused kernels: layer_norm=torch (apex not used: apex is installed but {missing} does not import "
        f"(ModuleNotFoundError: No module named '{absent}'))"]
    with pytest.raises(ConfigError, match=f"--fused-kernels apex needs CUDA and an importable apex .*{missing}"):
        select_kernels("apex", "cuda")
    layers = ModelSpec(get_preset("gpt-tiny"), TPGroup(), 1, kernels=k).build_stage(1, 0)  # on the CPU
    norms = [m for layer in layers for m in layer.modules() if "Norm" in type(m).__name__]
    assert norms and all(type(m) is torch.nn.LayerNorm for m in norms)


def test_an_apex_with_its_kernels_is_chosen(fake_cuda, tmp_path):
    _fake_apex(tmp_path, normalization=True, cuda_ext=True)
    fake_cuda.syspath_prepend(str(tmp_path))
    k = select_kernels("auto", "cuda")
    assert k == Kernels(layer_norm="apex") and type(layer_norm(8, 1e-5, k)).__name__ == "FusedLayerNorm"
    assert select_kernels("auto", "cpu") == Kernels(layer_norm="torch")
