"""Kernel choice: torch's paths on CPU, apex only when forced on CUDA with apex, logged once."""

import logging

import pytest
import torch

from megatron_2bw.errors import ConfigError
from megatron_2bw.fused import Kernels, layer_norm, select_kernels
from megatron_2bw.models.groups import ModelGroups


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


# A FusedLayerNorm whose kernel was not built for this GPU: it constructs, and its forward raises as CUDA does.
_NO_KERNEL = ("import torch\n\nclass FusedLayerNorm(torch.nn.LayerNorm):\n    def forward(self, x):\n"
              "        raise RuntimeError('CUDA error: no kernel image is available for execution on the device\\n'\n"
              "                           'CUDA kernel errors might be asynchronously reported')\n")
# One whose kernel runs but computes something else (a mis-built extension): not chosen either.
_WRONG = ("import torch\n\nclass FusedLayerNorm(torch.nn.LayerNorm):\n    def forward(self, x):\n"
          "        return super().forward(x) * 1.01\n")


def _fake_apex(root, *, normalization: bool, cuda_ext: bool, layer: str | None = None) -> None:
    """An ``apex`` package on disk: bare (the unrelated PyPI apex), with a Python-only
    ``apex.normalization`` (apex built without --cuda_ext), or with a stand-in CUDA extension;
    ``layer``: the source of its ``fused_layer_norm`` module (default: torch's LayerNorm under apex's name)."""
    pkg = root / "apex"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if normalization:
        (pkg / "normalization").mkdir()
        (pkg / "normalization" / "__init__.py").write_text("from .fused_layer_norm import FusedLayerNorm\n")
        (pkg / "normalization" / "fused_layer_norm.py").write_text(
            layer or "import torch\n\nclass FusedLayerNorm(torch.nn.LayerNorm):\n    pass\n")
    if cuda_ext:
        (root / "fused_layer_norm_cuda.py").write_text("")


@pytest.fixture
def fake_cuda(monkeypatch):
    import sys

    import megatron_2bw.fused as fused

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fused, "_probe_device", lambda: torch.device("cpu"))  # the start-up probe's forward runs here
    yield monkeypatch
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.") or n == "fused_layer_norm_cuda"]:
        del sys.modules[name]


@pytest.mark.parametrize("normalization", [False, True], ids=["pypi-apex", "apex-without-cuda-ext"])
def test_an_apex_without_its_kernels_is_not_chosen_and_the_model_builds(fake_cuda, tmp_path, caplog, normalization):
    """Review C3: any package named apex used to switch the kernels under --fused-kernels auto."""
    from megatron_2bw.config.presets import get_preset
    from megatron_2bw.models.spec import ModelSpec

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
    layers = ModelSpec(get_preset("gpt-tiny"), ModelGroups(), 1, kernels=k).build_stage(1, 0)  # on the CPU
    norms = [m for layer in layers for m in layer.modules() if "Norm" in type(m).__name__]
    assert norms and all(type(m) is torch.nn.LayerNorm for m in norms)


def test_an_apex_with_its_kernels_is_chosen(fake_cuda, tmp_path):
    _fake_apex(tmp_path, normalization=True, cuda_ext=True)
    fake_cuda.syspath_prepend(str(tmp_path))
    k = select_kernels("auto", "cuda")
    assert k == Kernels(layer_norm="apex") and type(layer_norm(8, 1e-5, k)).__name__ == "FusedLayerNorm"
    assert select_kernels("auto", "cpu") == Kernels(layer_norm="torch")


@pytest.mark.parametrize("layer,why", [
    (_NO_KERNEL, "apex's fused layer norm fails on this GPU (RuntimeError: CUDA error: no kernel image is available "
                 "for execution on the device)"),
    (_WRONG, "apex's fused layer norm gives other values than torch's on this GPU")], ids=["raises", "wrong-values"])
def test_an_apex_whose_kernel_fails_at_start_up_falls_back_to_torch(fake_cuda, tmp_path, caplog, layer, why):
    """Review C3's residual: an apex built without the GPU's architecture imports, then failed at the first
    forward of the run. The start-up probe runs one tiny forward: torch's path, with the reason logged."""
    _fake_apex(tmp_path, normalization=True, cuda_ext=True, layer=layer)
    fake_cuda.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="megatron_2bw.fused"):
        k = select_kernels("auto", "cuda")
    assert k == Kernels(layer_norm="torch") and isinstance(layer_norm(8, 1e-5, k), torch.nn.LayerNorm)
    assert [r.getMessage() for r in caplog.records] == [f"fused kernels: layer_norm=torch (apex not used: {why})"]
    with pytest.raises(ConfigError, match="--fused-kernels apex needs CUDA and an importable apex"):
        select_kernels("apex", "cuda")


def test_the_probe_runs_on_this_process_gpu(monkeypatch):
    """The probe runs before ``set_device``: on LOCAL_RANK's GPU (wrapping as the trainer does), not GPU 0."""
    import megatron_2bw.fused as fused

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for local, want in (("0", 0), ("3", 3), ("5", 1)):
        monkeypatch.setenv("LOCAL_RANK", local)
        assert fused._probe_device() == torch.device("cuda", want)
    monkeypatch.delenv("LOCAL_RANK")
    assert fused._probe_device() == torch.device("cuda", 0)
