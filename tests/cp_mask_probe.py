"""``pretrain_gpt.py`` with a probe (torchrun runs this file with the trainer's flags): what a rank builds.

Records, on this rank, (1) the attention mask every call of the GPT mask builder returned and (2) the
largest tensor (elements, shape) any aten op produced (a ``TorchDispatchMode`` over the whole
run: the model's build, every step's forward and backward, the optimizer), then writes them as JSON to
``$CP_MASK_PROBE_OUT.<rank>``. Used by ``test_context_parallel_long.py``: no rank may build the whole
``[s, s]`` mask, nor any tensor as large as a ``[b, heads, n, n]`` block (n = s / 2c).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_2bw.models import gpt

SEEN = {"masks": [], "largest_numel": 0, "largest_shape": None}


class _Largest(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > SEEN["largest_numel"]:
                SEEN["largest_numel"], SEEN["largest_shape"] = t.numel(), list(t.shape)
        return out


_build = gpt.ltor_masks_and_position_ids


def _probed(tokens, opts):
    out = _build(tokens, opts)
    if "attention_mask" in out:
        SEEN["masks"].append(list(out["attention_mask"].shape))
    return out


gpt.ltor_masks_and_position_ids = _probed
if __name__ == "__main__":
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pretrain_gpt.py")
    sys.argv = [script, *sys.argv[1:]]
    try:
        with _Largest():
            runpy.run_path(script, run_name="__main__")
    finally:
        with open(f"{os.environ['CP_MASK_PROBE_OUT']}.{os.environ.get('RANK', '0')}", "w") as f:
            json.dump(SEEN, f)
