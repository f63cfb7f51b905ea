"""A model with a layer feature no export format maps is refused by the Hugging Face and Megatron-Core savers
in one line (never written as another model), and still saved in the trainer's own layout."""

import pytest

from megatron_2bw.checkpoint.megatron_format import Exported
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.presets import get_preset
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.checkpoints import save_checkpoint
from megatron_2bw.export.model_io import build_full_model, global_state_dict


@pytest.fixture
def tiny():
    cfg = get_preset("gpt-tiny")
    return Exported(cfg, global_state_dict(build_full_model(cfg)), 3, {}, "fp32")


def test_every_feature_of_today_exports(tiny):
    assert tiny.cfg.beyond_exports() == ()


@pytest.mark.parametrize("saver", ["hf", "mcore"])
def test_a_feature_beyond_the_format_is_refused(tiny, saver, tmp_path, monkeypatch):
    monkeypatch.setattr(ModelConfig, "beyond_exports", lambda self: ("--some-new-block",))
    with pytest.raises(ConfigError, match=rf"^--saver {saver} cannot write a model with --some-new-block"):
        save_checkpoint(tiny, str(tmp_path / "out"), saver)
    assert not (tmp_path / "out").exists()
    save_checkpoint(tiny, str(tmp_path / "own"), "megatron")  # the trainer's layout holds any model
    assert (tmp_path / "own" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
