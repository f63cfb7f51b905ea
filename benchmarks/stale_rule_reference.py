"""What the 1-stale update rule costs by itself, in plain PyTorch, outside this project's engine.

``convergence.py`` finds 2BW's validation loss above Flush's at equal steps. This script asks
whether that gap belongs to the rule ``W(t+1) = W(t) - lr * grad f_t(W(t-1))`` rather than to
the engine: it trains a small causal transformer built from ``torch.nn`` only (its own
embedding, ``nn.TransformerEncoder``, tied head; nothing from ``megatron_2bw``), or with
``--model project`` this project's GPT layers (the engine's model, not its engine), with
``torch.optim.AdamW`` on the same demo corpus, once with the usual gradient and once with the
gradient taken on the previous weights (kept in a shadow copy), same seed, data order,
warm-up + cosine schedule and clipping, and reports both validation losses and their ratio.

    python benchmarks/stale_rule_reference.py --lr 1e-3 3e-4 --json FILE
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys

import common
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """Pre-LN causal transformer with a tied head (std 0.02 embeddings, as GPT)."""

    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.seq = seq
        self.emb, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        nn.init.normal_(self.emb.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, dropout=dropout, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(hidden)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos(torch.arange(self.seq))
        return self.ln(self.enc(h, mask=self.mask, is_causal=True)) @ self.emb.weight.T

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class ProjectLM(nn.Module):
    """This project's GPT layers (embedding, transformer layers, tied head, loss; its init and
    dropout), run as a plain module: the same model as the engine, trained by the loop below."""

    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, dropout: float, seed: int) -> None:
        super().__init__()
        from megatron_2bw.config import ModelConfig
        from megatron_2bw.models.groups import ModelGroups
        from megatron_2bw.models.spec import ModelSpec

        cfg = ModelConfig("gpt", layers, hidden, 4, seq, seq, vocab, hidden_dropout=dropout, attention_dropout=dropout)
        self.spec = ModelSpec(cfg, ModelGroups(), seed)
        self.layers = nn.ModuleList(self.spec.build(0, self.spec.num_items))
        self.loss_fn = self.spec.loss_fn()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        from megatron_2bw.models.spec import run_layers

        batch = self.spec.make_batch(tokens)
        return self.loss_fn(run_layers(list(self.layers), batch), batch)


def load_tokens(prefix: str) -> np.ndarray:
    """The indexed dataset's documents, concatenated (data reading is the only thing shared with the project)."""
    from megatron_2bw.data.indexed_dataset import IndexedDataset, dataset_exists

    if not dataset_exists(prefix):
        sys.exit(f"error: no indexed dataset at {prefix}; run scripts/demo.sh (or benchmarks/convergence.py) once")
    ds = IndexedDataset(prefix)
    return np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])


def train(tokens: np.ndarray, args, lr: float, stale: bool) -> dict:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    def batch(r):
        idx = r.integers(0, len(tokens) - args.seq - 1, args.batch)
        return torch.from_numpy(np.stack([tokens[i:i + args.seq + 1] for i in idx]))

    if args.model == "torch":
        model = TinyLM(args.vocab, args.seq, args.hidden, args.layers, args.dropout)
    else:
        model = ProjectLM(args.vocab, args.seq, args.hidden, args.layers, args.dropout, args.seed)
    shadow = copy.deepcopy(model)  # holds W(t-1) for the stale gradient
    params = list(model.parameters())  # decay matrices only, as the engine does
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.01},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr)
    losses = []
    for t in range(args.steps):
        warm = min(1.0, (t + 1) / max(args.warmup, 1))
        cos = 0.5 * (1 + math.cos(math.pi * t / args.steps))
        for g in opt.param_groups:
            g["lr"] = warm * (args.min_lr_ratio * lr + (1 - args.min_lr_ratio) * lr * cos)
        net = shadow if stale else model
        net.zero_grad()
        loss = net.loss(batch(rng))
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        if stale:
            shadow.load_state_dict(model.state_dict())  # W(t) is the next step's W(t-1); grads kept
            for p, q in zip(model.parameters(), shadow.parameters()):
                p.grad = q.grad
                q.grad = None
        opt.step()
        losses.append(loss.item())
    model.eval()
    r = np.random.default_rng(10_000 + args.seed)
    with torch.no_grad():
        valid = [model.loss(batch(r)).item() for _ in range(args.eval_batches)]
    return {"final_valid_loss": sum(valid) / len(valid), "final_train_loss": sum(losses[-20:]) / len(losses[-20:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("torch", "project"), default="torch",
                   help="torch: nn.TransformerEncoder, independent of the project; project: this project's GPT layers")
    p.add_argument("--data", default=os.path.join(common.ROOT, "demo_data", "demo_8000_text_document"))
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-3])
    p.add_argument("--eval-batches", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, 10 steps (a smoke run)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.steps, args.seq, args.eval_batches = 32, 1, 10, 16, 2
    torch.set_num_threads(1)
    tokens = load_tokens(args.data)
    if tokens.max() >= args.vocab:
        sys.exit(f"error: token id {tokens.max()} >= --vocab {args.vocab}")
    rows = []
    for lr in args.lr:
        plain, stale = train(tokens, args, lr, False), train(tokens, args, lr, True)
        ratio = stale["final_valid_loss"] / plain["final_valid_loss"]
        rows.append({"lr": lr, "plain": plain, "stale": stale, "valid_loss_ratio_stale_over_plain": ratio})
        print(f"lr {lr:g}: plain valid {plain['final_valid_loss']:.4f}, 1-stale valid {stale['final_valid_loss']:.4f}, "
              f"ratio {ratio:.4f}", flush=True)
    common.write_json(args.json, {"results": rows, "machine": common.machine_info(), "config": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
