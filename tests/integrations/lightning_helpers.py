"""A small LightningModule and synthetic data for the Lightning tests (CPU, seeded, offline).

Module-level classes so that ``ddp_spawn`` workers can unpickle them.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import lightning.pytorch as L
from torch.utils.data import DataLoader, TensorDataset

N_IN, N_OUT = 32, 4


def regression_data(n: int = 64, seed: int = 0, noisy_odd: bool = False) -> TensorDataset:
    """``y = x @ W + noise``; with ``noisy_odd`` the odd samples get pure-noise targets (a rank that
    sees them under a DistributedSampler gets a loss that cannot improve)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_IN, generator=g)
    w = torch.randn(N_IN, N_OUT, generator=g)
    y = x @ w + 0.01 * torch.randn(n, N_OUT, generator=g)
    if noisy_odd:
        y[1::2] = 5 * torch.randn(n // 2, N_OUT, generator=g)
    return TensorDataset(x, y)


def loader(n: int = 64, batch_size: int = 8, seed: int = 0, **kw) -> DataLoader:
    return DataLoader(regression_data(n, seed, **kw), batch_size=batch_size, shuffle=False)


def trainer(**kw) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    defaults.update(kw)
    return L.Trainer(**defaults)


class Regressor(L.LightningModule):
    """MLP regressor; ``optimizer`` in {"adamw", "sgd"}; ``wrap`` (a callable) wraps the optimizer
    inside configure_optimizers; ``scheduler`` adds a per-step StepLR; ``manual`` switches to
    manual optimization; ``out_dir`` makes each rank write what it saw at the end of fit."""

    def __init__(self, seed: int = 0, hidden: int = 128, lr: float = 1e-2, optimizer: str = "adamw",
                 wrap=None, scheduler: bool = False, manual: bool = False, out_dir: Optional[str] = None):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(N_IN, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, N_OUT))
        self.lr, self.optimizer_name, self.wrap, self.use_scheduler = lr, optimizer, wrap, scheduler
        self.automatic_optimization = not manual
        self.out_dir = out_dir
        self.training_step_calls = 0
        self.losses = []           # per training batch (this rank), full (unnormalized) loss
        self.step_losses = []      # per optimizer step: mean loss of the window (this rank)
        self._window = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.training_step_calls += 1
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(float(loss.detach()))
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            sch = self.lr_schedulers()
            if sch is not None:
                sch.step()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._window.append(self.losses[-1])
        if not self.automatic_optimization or not self.trainer.fit_loop._should_accumulate():
            self.step_losses.append(sum(self._window) / len(self._window))
            self._window = []

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if self.wrap is not None:
            opt = self.wrap(opt)
        if not self.use_scheduler:
            return opt
        sch = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)  # on what is returned (Lightning checks)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}

    def on_fit_end(self):
        if self.out_dir is None:
            return
        cb = next((c for c in self.trainer.callbacks if type(c).__name__ == "OptStateCallback"), None)
        torch.save({"params": torch.cat([p.detach().reshape(-1) for p in self.parameters()]),
                    "step_losses": self.step_losses, "losses": self.losses,
                    "switch_steps": list(cb.switch_steps) if cb else None,
                    "step_count": self.trainer.optimizers[0].step_count,
                    "wrapped": type(self.trainer.optimizers[0]).__name__},
                   os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))
