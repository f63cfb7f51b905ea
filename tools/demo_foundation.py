"""A few Adam steps of the tiny GPT on random tokens: a smoke demo of the model zoo."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_2bw.models.presets import get_preset  # noqa: E402
from megatron_2bw.models.spec import ModelSpec, run_layers  # noqa: E402
from megatron_2bw.tensor_parallel.group import TPGroup  # noqa: E402

cfg = get_preset("gpt-tiny")
spec = ModelSpec(cfg, TPGroup(), seed=1)
layers = spec.build(0, spec.num_items)
params = list({id(p): p for m in layers for p in m.parameters()}.values())
opt = torch.optim.AdamW(params, lr=3e-3)
data = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
for step in range(20):
    batch = spec.make_batch(data)
    loss = spec.loss_fn()(run_layers(layers, batch), batch)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step:2d} loss {loss.item():.4f}")
