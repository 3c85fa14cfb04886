"""The demo's model: a small byte-level causal transformer built from a config (nothing to download)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .demo_config import DemoConfig


# -- model ----------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_attn = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_mlp(x))))


class TinyLM(nn.Module):
    """Byte-level causal LM: token + learned position embeddings, blocks, tied output layer."""

    vocab_size = 256

    def __init__(self, d_model: int, n_layers: int, n_heads: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(self.vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_out = nn.LayerNorm(d_model)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    @classmethod
    def from_config(cls, cfg: DemoConfig) -> "TinyLM":
        return cls(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_out(h), self.embed.weight)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), batch[:, 1:].reshape(-1))
