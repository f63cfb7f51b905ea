"""A checkpoint's per-stage layer split must match the run's: each shard holds its stage's layers."""

import pytest

from megatron_2bw.checkpoint.checkpointing import check_compatible
from megatron_2bw.errors import ConfigError

MODEL = {"num_layers": 4}


def _sd(split):
    return {"path": "ck/iter_0000002", "config": {"model": MODEL, "optimizer": {"optimizer": "adam", "dtype": "fp32"}},
            "layout": {"t": 1, "d": 2, "schedule": "2bw", "split": split}}


def test_equal_splits_load_and_an_explicit_even_split_equals_the_default():
    for saved, mine in ((None, None), ([2, 2], None), (None, (2, 2)), ([3, 1], (3, 1))):
        check_compatible(_sd(saved), MODEL, "2bw", {"optimizer": "adam", "dtype": "fp32"}, split=mine)


@pytest.mark.parametrize("weights_only", [False, True])
def test_another_split_is_refused_with_the_flag_to_pass(weights_only):
    with pytest.raises(ConfigError) as e:
        check_compatible(_sd([3, 1]), MODEL, "2bw", {"optimizer": "adam", "dtype": "fp32"}, split=None,
                         weights_only=weights_only)
    assert str(e.value) == ("checkpoint ck/iter_0000002 was saved with layers per stage 3,1 but this run uses 2,2: "
                            "pass --pipeline-layer-split 3,1")
