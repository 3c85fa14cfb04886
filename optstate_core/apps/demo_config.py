"""The demo's settings (one training run) and what one run returns."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional


@dataclass
class DemoConfig:
    """One training run's settings; the defaults finish the demo in ~2 minutes on 2 CPU cores."""

    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.1
    clip: float = 1.0  # gradient-norm clipping (global; ``clip_mode`` for runs with gradient release); 0: off
    clip_mode: str = "auto"  # how +release runs clip: "auto", "previous" or "per_tensor" (wrap's clip_mode)
    release_bucket_bytes: Optional[int] = None  # +release runs: wrap(release_bucket_bytes=...); None: its default
    warmup_steps: int = 20
    eval_every: int = 25
    eval_batches: int = 8
    seed: int = 0
    device: str = "cpu"
    data: Optional[str] = None
    max_bytes: int = 4_000_000

    def validate(self) -> "DemoConfig":
        for name in ("steps", "batch_size", "seq_len", "d_model", "n_layers", "n_heads", "eval_every",
                     "eval_batches", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be a multiple of --n-heads ({self.n_heads})")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a number >= 0, got {self.weight_decay!r}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not (
                self.clip >= 0 and math.isfinite(self.clip)):
            raise ValueError(f"--clip must be a number >= 0 (0: no clipping), got {self.clip!r}")
        if self.clip_mode not in ("auto", "previous", "per_tensor"):
            raise ValueError(f"--clip-mode must be auto, previous or per_tensor, got {self.clip_mode!r}")
        b = self.release_bucket_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ValueError(f"--release-bucket-bytes must be a byte count >= 0 (0: one update per gradient), got {b!r}")
        return self


@dataclass
class RunResult:
    name: str
    preset: Optional[str]
    rows: List[dict]
    n_params: int
    state_bytes: int
    bits_per_param: float
    step_ms: float  # median training step (forward + backward + optimizer step)
    final_val_loss: float
    final_state: Optional[dict] = None  # the model's state_dict on the CPU (only when asked: keep_state=True)
