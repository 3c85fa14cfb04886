"""Fine-tune a tiny causal transformer with Lightning, optimizer state compressed by optstate.

Runs on CPU in well under a minute, offline (synthetic data, model built from a config):

    PYTHONPATH=.:integrations python examples/lightning_finetune.py [--preset 8bit] [--precision bf16-mixed]

1. "pretrains" the model briefly on one synthetic sequence task (plain AdamW);
2. fine-tunes copies of it on a second task, once with plain AdamW and once through
   ``OptStateCallback`` (gradient accumulation 2), and prints both losses and the optimizer
   memory each held between steps.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import lightning.pytorch as L
from torch.utils.data import DataLoader, TensorDataset

from optstate_lightning import OptStateCallback

VOCAB, SEQ = 96, 32


def task(n: int, shift: int, seed: int) -> TensorDataset:
    """Sequences where token t+1 = (token t * 5 + shift) mod VOCAB, from random starts."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n, SEQ + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        seqs[:, t + 1] = (seqs[:, t] * 5 + shift) % VOCAB
    return TensorDataset(seqs[:, :-1], seqs[:, 1:])


class TinyLM(L.LightningModule):
    def __init__(self, d_model: int = 64, layers: int = 2, lr: float = 3e-3):
        super().__init__()
        self.lr = lr
        self.embed = torch.nn.Embedding(VOCAB, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(SEQ, d_model))
        block = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers)
        self.head = torch.nn.Linear(d_model, VOCAB)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(SEQ)
        self.losses = []

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).float().reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def state_bytes(optimizer) -> int:
    """Bytes of tensor state a plain torch optimizer holds between steps."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v))


def fit(model, data, epochs, precision, callbacks=()):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, precision=precision,
                        accumulate_grad_batches=2, callbacks=list(callbacks), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)))
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="8bit", help="optstate preset (8bit, 4bit, bf16, offload, fp32)")
    parser.add_argument("--precision", default="bf16-mixed", help="Lightning precision (32-true, bf16-mixed)")
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs")
    parser.add_argument("--samples", type=int, default=256, help="sequences per task (16 per batch)")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()

    base = TinyLM()
    fit(base, task(args.samples, shift=1, seed=0), 2, args.precision)
    print(f"pretrained: loss {base.losses[0]:.3f} -> {base.losses[-1]:.3f}")

    finetune = task(args.samples, shift=7, seed=1)
    plain = copy.deepcopy(base)
    plain.losses = []
    plain_trainer = fit(plain, finetune, args.epochs, args.precision)
    plain_bytes = state_bytes(plain_trainer.optimizers[0])

    compact = copy.deepcopy(base)
    compact.losses = []
    callback = OptStateCallback(policy=args.preset)
    trainer = fit(compact, finetune, args.epochs, args.precision, [callback])
    report = trainer.optimizers[0].memory_report()

    n = report["n_params"]
    print(f"fine-tuned ({n:,} parameters, {args.precision}, accumulate_grad_batches=2):")
    print(f"  AdamW              loss {plain.losses[-1]:.3f}  optimizer state {plain_bytes / 2**20:.3f} MB "
          f"({8 * plain_bytes / n:.1f} bits/param)")
    print(f"  optstate {args.preset:<9} loss {compact.losses[-1]:.3f}  optimizer state "
          f"{report['state_bytes'] / 2**20:.3f} MB ({report['bits_per_param']:.1f} bits/param), "
          f"by codec {report['by_codec']}")
    print(f"  optimizer memory saved: {(plain_bytes - report['state_bytes']) / 2**20:.3f} MB "
          f"({100 * (1 - report['state_bytes'] / plain_bytes):.0f}%)")
    logged = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items() if k.startswith("optstate/")}
    print(f"  logged metrics: {logged}")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
