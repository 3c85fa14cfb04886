"""Block helpers shared by the blockwise codecs: padding, finite absmax, power-of-two scales."""
from __future__ import annotations

import torch


def to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[rows, cols]`` -> ``[rows, n_blocks, block]``, zero-padding the last block of each row."""
    rows, cols = x.shape
    pad = -cols % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, (cols + pad) // block, block)  # no -1: a slice may have no rows


def finite_absmax(xb: torch.Tensor) -> torch.Tensor:
    """Per-block max of |x| over finite values only (NaN/inf never set a block's scale)."""
    a = xb.abs()
    # ``a < inf`` is ``isfinite(a)`` for magnitudes (false for inf and NaN), and vectorizes in compiled CPU code
    return torch.where(a < float("inf"), a, torch.zeros((), dtype=a.dtype, device=a.device)).amax(dim=-1)


def pow2_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``s`` with ``absmax / s`` in [0.5, 1), as float32.

    Computed from the float32 bits so the Triton kernels reproduce it exactly. Clamped to
    [2**-125, 2**127]; an all-zero block gets 2**-125.
    """
    bits = absmax.to(torch.float32).view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 126
    exp = exp.clamp(-125, 127)
    return ((exp + 127) << 23).to(torch.int32).view(torch.float32)


def expand_scales(scales: torch.Tensor, block: int, cols: int) -> torch.Tensor:
    """``[rows, n_blocks]`` -> ``[rows, cols]``: each block's scale repeated over its columns."""
    return scales.repeat_interleave(block, dim=1)[:, :cols]


def scale_blocks(x: torch.Tensor, factors: torch.Tensor, block: int) -> torch.Tensor:
    """``x * factor`` with one factor per block of ``x`` ([rows, cols]); no copy of the factors
    when the rows hold whole blocks."""
    rows, cols = x.shape
    if cols % block == 0:
        return (x.reshape(rows, cols // block, block) * factors.unsqueeze(-1)).reshape(rows, cols)
    return x * expand_scales(factors, block, cols)
