"""8-bit blockwise codec: a tiny float per element, a power-of-two scale per block.

Each block of ``block_size`` elements along a row shares a power-of-two scale ``s`` chosen so
the block's largest finite magnitude lands in [0.5, 1) after dividing by ``s`` (exact). Each
element then keeps an 8-bit "minifloat" code, which holds *relative* precision over a wide
range instead of the fixed absolute step of a linear map:

* signed states (momentum): sign + E4M3 magnitude with subnormals: values down to 2**-18 of
  the block scale, at most 1/16 relative rounding error above 2**-15;
* non-negative states (second moment): E5M3, 32 binades (2**-32 of the block scale). Code 0
  is an exact zero; a nonzero value is never stored as zero (it is raised to the smallest
  code), so ``m / sqrt(v)`` can never blow up from an underflowed ``v``.

Encoding uses only exact float multiplies and integer operations on float32 bits, so the
Triton kernels (``step/kernels/codec_ops.py``, used by every fused update) produce bit-identical
codes from identical inputs.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import Codec
from .kinds import StateKind
from .blocks import finite_absmax, pow2_scale, scale_blocks, to_blocks


class MinifloatMap:
    """An 8-bit code <-> value map in [-1, 1) (signed) or [0, 1) (unsigned)."""

    def __init__(self, signed: bool, exp_bits: int):
        self.signed = signed
        self.exp_bits = exp_bits
        self.man_bits = (7 if signed else 8) - exp_bits
        if self.man_bits < 1:
            raise ValueError(f"exp_bits={exp_bits} leaves no mantissa bits")
        self.bias = 1 << exp_bits  # value = 2**(e - bias) * (1 + f / 2**M)
        self.max_mag = (1 << (7 if signed else 8)) - 1
        self.shift = 23 - self.man_bits
        self.code_offset = (127 - self.bias) << self.man_bits
        self.sub_mult = 2.0 ** (self.bias - 1 + self.man_bits)  # signed subnormals: value = f / sub_mult
        self.normal_min = 2.0 ** (1 - self.bias)  # smallest normal magnitude

    def magnitude_values(self) -> torch.Tensor:
        m = torch.arange(self.max_mag + 1, dtype=torch.int64)
        e, f = m >> self.man_bits, m & ((1 << self.man_bits) - 1)
        normal = torch.ldexp(1 + f.double() / (1 << self.man_bits), (e - self.bias))
        if self.signed:
            return torch.where(e == 0, f.double() / self.sub_mult, normal).float()
        return torch.where(m == 0, torch.zeros((), dtype=torch.float64), normal).float()

    def lut(self) -> torch.Tensor:
        """256 float32 values indexed by code byte."""
        mags = self.magnitude_values()
        if not self.signed:
            return mags
        return torch.cat([mags, -mags])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of ``codes`` (uint8), bit for bit :meth:`lut`'s, by exact integer and
        float arithmetic (no table lookup and no bit reinterpretation, so compiled CPU code
        vectorizes it): a normal code is ``(2**M + f) * 2**e * 2**-(bias + M)``, a signed
        subnormal ``f * 2**(1 - bias - M)``, each product exact (few significant bits, no
        float32 subnormal). Needs ``code_offset >= 0`` (every map but the unsigned one with 7
        exponent bits, whose codes reach float32 subnormals: that one decodes through :meth:`lut`)."""
        c = codes.to(torch.int32)
        mag = c & 0x7F if self.signed else c
        e, f = mag >> self.man_bits, mag & ((1 << self.man_bits) - 1)
        # 2**e, exact, for e < 64: shifts below 2**15 times 2**16 / 2**32 factors
        pow_e = (1 << (e & 15)).to(torch.float32)
        for bit, factor in ((16, 2.0 ** 16), (32, 2.0 ** 32)):
            if (1 << self.exp_bits) > bit:
                pow_e = pow_e * torch.where((e & bit) != 0, factor, 1.0)
        normal = ((f + (1 << self.man_bits)).to(torch.float32) * pow_e) * 2.0 ** -(self.bias + self.man_bits)
        if self.signed:
            value = torch.where(e == 0, f.to(torch.float32) * (1.0 / self.sub_mult), normal)
            return torch.where(c > 0x7F, -value, value)
        return torch.where(c == 0, 0.0, normal)

    def encode(self, y: torch.Tensor, rbits: Optional[torch.Tensor]) -> torch.Tensor:
        """Codes (int32) for normalized finite-or-inf ``y`` (|y| < 1 for finite values).

        Round to nearest (or stochastically, from ``rbits``) on the code grid by adding to the
        float32 bits and shifting. Signed subnormals (|y| < 2**(1 - bias)) are shifted into the
        first normal binade by adding its lower bound, which maps the linear subnormal grid onto
        that binade's mantissa grid exactly, and one code binade is subtracted back.
        """
        if rbits is not None:
            half = rbits & ((1 << self.shift) - 1)
        else:
            half = 1 << (self.shift - 1)
        if self.signed:
            a = y.abs()
            a = torch.where(a != a, 0.0, a)  # NaN -> 0 (inf, like nan_to_num's FLT_MAX, takes the top code)
            small = a < self.normal_min
            t = torch.where(small, a + self.normal_min, a)
            mag = ((t.view(torch.int32) + half) >> self.shift) - self.code_offset
            mag = torch.where(small, mag - (1 << self.man_bits), mag).clamp_(0, self.max_mag)
            return torch.where((y < 0) & (mag > 0), mag | 0x80, mag)
        a = torch.where(y != y, 0.0, y).clamp_min(0)
        normal = ((a.view(torch.int32) + half) >> self.shift) - self.code_offset
        return torch.where(a > 0, normal.clamp_(1, self.max_mag), 0)


class Minifloat8Codec(Codec):
    """Blockwise 8-bit minifloat state (codec name ``"int8"``; default block 256, fp32 power-of-two
    scale per block). ``Int8Codec`` is the same class under its earlier name.

    ``signed=None`` picks the signed map for momentum-like states and the unsigned map for
    non-negative ones (the policy tells the codec which through :meth:`specialize`).
    """

    name = "int8"
    granularity = 256

    def __init__(self, block_size: int = 256, signed: Optional[bool] = None, stochastic_rounding: bool = False,
                 exp_bits: Optional[int] = None):
        if block_size <= 0 or 256 % block_size or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two dividing 256, got {block_size}")
        self.block_size = int(block_size)
        self.signed = signed
        self.stochastic_rounding = bool(stochastic_rounding)
        self.exp_bits = exp_bits
        self.map = MinifloatMap(signed is not False, exp_bits or (4 if signed is not False else 5))
        self._luts = {}

    def config(self):
        return {"name": self.name, "block_size": self.block_size, "signed": self.signed,
                "stochastic_rounding": self.stochastic_rounding, "exp_bits": self.exp_bits}

    def specialize(self, nonnegative):
        if self.signed is not None:
            return self
        variants = self.__dict__.setdefault("_variants", {})  # one per sign: building one computes its tables
        if nonnegative not in variants:
            variants[nonnegative] = type(self)(self.block_size, not nonnegative, self.stochastic_rounding, self.exp_bits)
        return variants[nonnegative]

    @property
    def kernel_form(self) -> Optional[StateKind]:
        """INT8 for blocks of 256 with the default map (the kernels' only int8 layout)."""
        return StateKind.INT8 if self.block_size == 256 and self.exp_bits is None else None

    def payload_layout(self, rows, cols, dtype=torch.float32):
        nb = -(-cols // self.block_size)
        return {"codes": ((rows, cols), torch.uint8, 1), "scales": ((rows, nb), torch.float32, self.block_size)}

    def lut(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._luts:
            self._luts[key] = self.map.lut().to(device)
        return self._luts[key]

    def encode_into(self, x, out, rounding=None):
        rows, cols = x.shape
        x = x.to(torch.float32)
        scales = pow2_scale(finite_absmax(to_blocks(x, self.block_size)))
        y = scale_blocks(x, 1.0 / scales, self.block_size)  # exact: power-of-two factor
        rbits = rounding.bits32(rows, cols, x.device) if (self.stochastic_rounding and rounding) else None
        out["codes"].copy_(self.map.encode(y.contiguous(), rbits))
        out["scales"].copy_(scales)

    def decode_into(self, payload, out):
        codes = payload["codes"]
        val = self.map.decode(codes) if self.map.code_offset >= 0 else self.lut(codes.device)[codes.long()]
        return out.copy_(scale_blocks(val, payload["scales"], self.block_size))

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_luts"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._luts = {}


#: the earlier name of :class:`Minifloat8Codec` (the format's name, ``"int8"``, is unchanged)
Int8Codec = Minifloat8Codec


class Int8MomentumCodec(Minifloat8Codec):
    """torch-optstate's name for the int8 codec; here blockwise, and safe for variance too."""
