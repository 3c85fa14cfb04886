#!/usr/bin/env python3
"""Train a tiny causal language model with Hugging Face Accelerate and an optstate optimizer.

    python examples/accelerate_train.py --cpu                    # a few seconds on a laptop CPU
    python examples/accelerate_train.py --cpu --preset 4bit --accum 4 --save runs/ckpt
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu

The optimizer is an ordinary ``accelerator.prepare`` argument; ``optstate_accelerate.attach``
makes it follow gradient accumulation and log its metrics through ``accelerator.log``. At the
end it prints how much optimizer memory the compressed state saves against plain AdamW.
Data are synthetic (no downloads): sequences following a fixed random bigram table.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "integrations")]  # run from a checkout

import optstate_core as oc  # noqa: E402
import optstate_accelerate as osa  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402


class TinyLM(nn.Module):
    """Token + position embeddings, a few causal transformer layers, a tied output head."""

    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.T


def bigram_data(n: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``n`` sequences drawn from a random sparse bigram table (learnable structure)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, 4), generator=g)
    out = torch.empty(n, seq + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq):
        pick = torch.randint(0, 4, (n,), generator=g)
        out[:, t + 1] = table[out[:, t], pick]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size per process")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--preset", default="8bit", choices=sorted(oc.PRESETS), help="optstate preset")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--cpu", action="store_true", help="run on CPU even if an accelerator is present")
    p.add_argument("--log-every", type=int, default=10, help="log optstate metrics every N steps")
    p.add_argument("--save", default=None, help="accelerator.save_state() into this folder at the end")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "accum", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accum)
    if args.mixed_precision == "fp16" and accelerator.scaler is None:
        accelerator.print("note: Accelerate runs fp16 without autocast or GradScaler on this device")
    set_seed(args.seed)
    vocab, seq = 128, 32
    model = TinyLM(vocab=vocab, seq=seq)
    data = bigram_data(args.steps * args.accum * args.batch_size * accelerator.num_processes, seq, vocab, args.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(args.seed))
    # min_int8_elements=1024: this model is tiny; the default (4096) keeps small tensors in fp32.
    policy = oc.make_policy(args.preset, min_int8_elements=1024)
    optimizer = oc.wrap(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01), policy)
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    osa.attach(accelerator, optimizer, log_every=args.log_every)

    t0 = time.perf_counter()
    model.train()
    vopt = osa.unwrap_optimizer(optimizer)
    for (tokens,) in loader:
        with accelerator.accumulate(model):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and not optimizer.step_was_skipped:
            step = vopt.step_count
            if step % args.log_every == 0 or step == 1:
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.print(f"step {step:4d}  loss {mean:.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
    elapsed = time.perf_counter() - t0

    report = vopt.memory_report()
    plain = 2 * 4 * report["n_params"]  # AdamW's fp32 exp_avg + exp_avg_sq
    held = report["state_bytes"]
    accelerator.print(f"trained {vopt.step_count} steps in {elapsed:.1f} s on {accelerator.num_processes} "
                      f"process(es), {accelerator.device}, mixed precision {accelerator.mixed_precision}")
    accelerator.print(f"optimizer state: {held / 1024:.1f} KiB ({report['bits_per_param']:.1f} bits/param, "
                      f"preset {args.preset}) vs {plain / 1024:.1f} KiB for fp32 AdamW: "
                      f"saved {(plain - held) / 1024:.1f} KiB ({100 * (plain - held) / plain:.0f}%)")
    if args.save:
        accelerator.save_state(args.save)
        accelerator.print(f"saved the training state to {args.save}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
