"""Moves of encoded payloads between host and device, with byte accounting.

On CPU every move is a plain copy. (The CUDA copy-stream pipeline builds on this module.)
"""
from __future__ import annotations

from typing import Dict

import torch


class Transfers:
    """Copies payload tensors between tiers and counts the bytes moved in each direction."""

    def __init__(self):
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def reset(self) -> None:
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def fetch(self, payload: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
        """The payload on ``device`` (views returned unchanged when already there)."""
        out = {}
        for key, t in payload.items():
            if t.device == device:
                out[key] = t
            else:
                out[key] = t.to(device, non_blocking=t.is_pinned())
                if device.type != "cpu":
                    self.h2d_bytes += t.numel() * t.element_size()
        return out

    def put(self, src: Dict[str, torch.Tensor], dst: Dict[str, torch.Tensor]) -> None:
        """Copy ``src`` payload tensors into the (possibly host) ``dst`` views."""
        for key, t in src.items():
            d = dst[key]
            if d.device != t.device and t.device.type != "cpu":
                self.d2h_bytes += t.numel() * t.element_size()
            d.copy_(t)
