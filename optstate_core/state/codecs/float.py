"""Float codecs: identity ("fp32"), bf16 and block-scaled fp16."""
from __future__ import annotations

import torch

from .base import Codec
from .kinds import StateKind
from .blocks import finite_absmax, pow2_scale, scale_blocks, to_blocks
from .rounding import RoundingContext


class FP32Codec(Codec):
    """Identity: the state is kept exactly as the optimizer made it (its own dtype)."""

    name = "fp32"
    lossless = True
    kernel_form = StateKind.FP32

    def payload_layout(self, rows, cols, dtype=torch.float32):
        return {"data": ((rows, cols), dtype, 1)}

    def encode_into(self, x, out, rounding=None):
        out["data"].copy_(x)

    def decode_into(self, payload, out):
        return out.copy_(payload["data"])


IdentityCodec = FP32Codec


def _stochastic_bf16(x: torch.Tensor, rounding: RoundingContext) -> torch.Tensor:
    """bf16 with stochastic rounding: add 16 random bits below the kept mantissa, truncate."""
    rows, cols = x.shape
    bits = x.view(torch.int32).to(torch.int64)
    noise = rounding.bits(rows, cols, x.device) & 0xFFFF
    rounded = ((bits + noise) & ~0xFFFF).to(torch.int32).view(torch.float32)
    keep = ~torch.isfinite(x)  # NaN/inf keep their bits
    return torch.where(keep, x, rounded).to(torch.bfloat16)


class BF16Codec(Codec):
    """bfloat16 storage (fp32 range, 8-bit mantissa); optional stochastic rounding."""

    name = "bf16"
    kernel_form = StateKind.BF16

    def __init__(self, stochastic_rounding: bool = False):
        self.stochastic_rounding = bool(stochastic_rounding)

    def config(self):
        return {"name": self.name, "stochastic_rounding": self.stochastic_rounding}

    def payload_layout(self, rows, cols, dtype=torch.float32):
        return {"data": ((rows, cols), torch.bfloat16, 1)}

    def encode_into(self, x, out, rounding=None):
        x = x.to(torch.float32)
        if self.stochastic_rounding and rounding is not None:
            out["data"].copy_(_stochastic_bf16(x.contiguous(), rounding))
        else:
            out["data"].copy_(x)

    def decode_into(self, payload, out):
        return out.copy_(payload["data"])


FP16_TOP = 2.0 ** 15  # a block's largest |value| is stored in [2**14, 2**15)
FP16_MIN_SUBNORMAL = 2.0 ** -24
FP16_MAX = 65504.0


class FP16Codec(Codec):
    """float16 storage with a power-of-two scale per block of ``block_size``.

    Plain fp16 flushes typical second-moment values (~1e-10) to zero, after which Adam's update
    explodes. Here each block is scaled so its largest value sits near the top of the fp16
    range (exact: the scale is a power of two), which leaves ~2**-39 of dynamic range below
    the block maximum; for non-negative states a nonzero value is never stored as zero.
    """

    name = "fp16"
    granularity = 256

    def __init__(self, block_size: int = 256, stochastic_rounding: bool = False, nonnegative: bool = False):
        if block_size <= 0 or 256 % block_size:
            raise ValueError(f"block_size must divide 256, got {block_size}")
        self.block_size = int(block_size)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.nonnegative = bool(nonnegative)

    def config(self):
        return {"name": self.name, "block_size": self.block_size,
                "stochastic_rounding": self.stochastic_rounding, "nonnegative": self.nonnegative}

    def specialize(self, nonnegative):
        if nonnegative == self.nonnegative:
            return self
        return FP16Codec(self.block_size, self.stochastic_rounding, nonnegative)

    def payload_layout(self, rows, cols, dtype=torch.float32):
        nb = -(-cols // self.block_size)
        return {"data": ((rows, cols), torch.float16, 1), "scales": ((rows, nb), torch.float32, self.block_size)}

    def encode_into(self, x, out, rounding=None):
        rows, cols = x.shape
        x = x.to(torch.float32)
        scales = pow2_scale(finite_absmax(to_blocks(x, self.block_size))) / FP16_TOP
        y = scale_blocks(x, 1.0 / scales, self.block_size)  # exact: power-of-two factor
        y = torch.nan_to_num(y, nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)  # as the int codecs: no NaN/inf codes
        if self.stochastic_rounding and rounding is not None:
            y = _stochastic_fp16(y, rounding)
        data = y.to(torch.float16)
        if self.nonnegative:
            data = torch.where((data == 0) & (y > 0), torch.tensor(FP16_MIN_SUBNORMAL, dtype=torch.float16,
                                                                    device=x.device), data)
        out["scales"].copy_(scales)
        out["data"].copy_(data)

    def decode_into(self, payload, out):
        return out.copy_(scale_blocks(payload["data"].to(torch.float32), payload["scales"], self.block_size))


def _stochastic_fp16(y: torch.Tensor, rounding: RoundingContext) -> torch.Tensor:
    """Round fp32 ``y`` (|y| < 2**15) onto the fp16 grid stochastically; returns fp32 on the grid."""
    rows, cols = y.shape
    a = y.abs()
    _, exp = torch.frexp(a)  # a = m * 2**exp, m in [0.5, 1)
    ulp_exp = torch.clamp(exp - 1, min=-14) - 10  # fp16 ulp at |y| (subnormals share 2**-24)
    u = ((rounding.bits32(rows, cols, y.device) >> 8) & 0xFFFFFF).to(torch.float32) * 2.0 ** -24
    q = torch.ldexp(torch.floor(torch.ldexp(a, -ulp_exp) + u), ulp_exp)
    return torch.where(torch.isfinite(y), torch.copysign(q, y), y)
