"""4-bit blockwise codec: codebook per element, fp32 absmax per block, two codes per byte.

* signed states (momentum): 15 symmetric levels ``0, +-(j/7)**p`` (default ``p = 2``);
* non-negative states (second moment): ``0`` and ``(j/15)**p`` for ``j = 1..15`` (default
  ``p = 4``, i.e. a square law in ``sqrt(v)``, spanning ~2e-5 of the block maximum). Code 0 is
  an exact zero and a nonzero value is never stored as zero (except in a block whose maximum is
  below ~2.9e-39, whose reciprocal overflows: such a block is stored as zeros); nearest is
  decided in the log domain (geometric midpoints), the domain in which ``sqrt(v)`` errors matter.

With stochastic rounding a value between levels ``l0 <= y < l1`` gets the upper code with
probability ``(y - l0) / (l1 - l0)`` from its 24 random bits ``u``. For the non-negative
integer-power levels that is decided in the level domain ``z = x * float32(15**p / absmax)``
(one multiply per element; level ``j`` is the integer ``j**p`` there) as
``u * (l1 - l0) < z - l0``, without a division, in the kernels and here alike (before 2026-11-26
on ``y = x / absmax`` against the levels ``j**p / 15**p``: the same codes up to float32 rounding
of the probability, decoded the same way).

Element ``2i`` of a row goes to the low nibble of byte ``i``, element ``2i + 1`` to the high
nibble. Encoding is ``bucketize(x * (1 / absmax))`` against fixed float32 midpoints; the Triton
kernel uses the same midpoints and the same rounded reciprocal, so codes are identical. With the
default (integer) powers every level and midpoint is an exact integer times one float32
constant, so the kernels decode and encode with a few arithmetic instructions and no table.
(Before 2026-11-23 the midpoints were float32 means of the rounded levels; the levels, hence
the decoding of stored codes, are unchanged, and the boundaries moved by at most an ulp.)
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from .base import Codec
from .kinds import StateKind
from .blocks import finite_absmax, scale_blocks, to_blocks


def int4_levels(signed: bool, power: float) -> torch.Tensor:
    """The sorted float32 levels (15 signed, 16 unsigned), normalized to max 1 (for an integer
    power: ``float32(j ** p) * float32(1 / n ** p)``, reproducible in any float32 arithmetic)."""
    n = 7 if signed else 15
    j = torch.arange(0 if not signed else 1, n + 1)
    if float(power).is_integer() and n ** power < 2 ** 24:
        mags = (j ** int(power)).float() * torch.tensor(1.0 / n ** power, dtype=torch.float32)
    else:
        mags = ((j.double() / n) ** power).float()
    if signed:
        return torch.cat([-mags.flip(0), torch.zeros(1), mags])
    return mags


def integer_power(signed: bool, power: float) -> int:
    """``power`` when the levels and midpoints are exact integers times one float32 constant
    (so the kernels compute them arithmetically, without tables), else 0: signed levels need
    ``2 * 7**p < 2**24``, non-negative ones an even ``p`` with ``15**p < 2**24``."""
    if not float(power).is_integer() or power < 1:
        return 0
    p = int(power)
    if signed:
        return p if 2 * 7 ** p < 2 ** 24 else 0
    return p if p % 2 == 0 and 15 ** p < 2 ** 24 else 0


def int4_scale(signed: bool, power: float) -> float:
    """float32(1 / n**p): the constant every level is an integer multiple of (integer powers)."""
    n = 7 if signed else 15
    return float(torch.tensor(1.0 / n ** power, dtype=torch.float32))


def int4_midpoints(levels: torch.Tensor, signed: bool, power: float = 0.0) -> torch.Tensor:
    """Decision boundaries: arithmetic means (signed), geometric means (non-negative; the first
    boundary is 0 so a positive value never rounds to zero).

    For an :func:`integer_power` both are one correctly rounded float32 product of an exact
    integer, ``(j**p + (j+1)**p) * (c / 2)`` and ``(j (j+1))**(p/2) * c`` with ``c = 1 / n**p``,
    which the kernels compute from ``j`` alone (no table read); otherwise float32 arithmetic
    on the levels."""
    p = integer_power(signed, power)
    if p:
        c = int4_scale(signed, power)
        j = torch.arange(0, 7 if signed else 15, dtype=torch.int64)
        ints = j ** p + (j + 1) ** p if signed else (j * (j + 1)) ** (p // 2)
        mags = ints.float() * torch.tensor(c * 0.5 if signed else c, dtype=torch.float32)
        return torch.cat([-mags.flip(0), mags]) if signed else mags
    if signed:
        return (levels[1:] + levels[:-1]) * 0.5
    return torch.sqrt(levels[1:] * levels[:-1])


def _ipow(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x ** n`` by repeated multiplies, squaring first for an even ``n`` (exact, in any order,
    for the small integers and half-integers the levels are made of; the kernels' ``ipow``)."""
    base, count = (x * x, n // 2) if n % 2 == 0 else (x, n)
    out = base
    for _ in range(count - 1):
        out = out * base
    return out


def _uniform(rbits: torch.Tensor) -> torch.Tensor:
    """The uniform float32 in [0, 1) of 24 of the rounding bits (the kernels' ``u``)."""
    return ((rbits >> 8) & 0xFFFFFF).to(torch.float32) * 2.0 ** -24


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte (uint8 ``[rows, cols]`` -> ``[rows, ceil(cols / 2)]``), element
    ``2i`` in the low nibble. Rows of a multiple of 8 codes are packed eight at a time through an
    int64 view of their bytes (little-endian) into an int32 word: shifts and masks that compiled CPU
    code vectorizes (int16 or strided arithmetic, e.g. ``codes[:, 0::2] | codes[:, 1::2] << 4``,
    would run as a scalar loop)."""
    rows, cols = codes.shape
    if cols % 8 == 0 and sys.byteorder == "little":
        word = codes.contiguous().view(torch.int64)  # bytes c0 .. c7 -> c0 | c1 << 8 | ... | c7 << 56
        packed = word & 0xF
        for k in range(1, 8):  # code k: bits 8k .. 8k+3 -> 4k .. 4k+3
            packed = packed | ((word >> (4 * k)) & (0xF << (4 * k)))
        return packed.to(torch.int32).view(torch.uint8)
    if cols % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: uint8 codes ``[rows, cols]`` from ``[rows, ceil(cols / 2)]``
    bytes. Rows of a multiple of 4 bytes are unpacked eight codes at a time (an int32 view of four
    bytes spread into the eight bytes of an int64), which compiled CPU code vectorizes; a
    ``stack`` of the two nibbles would run as a separate copy."""
    rows, half = packed.shape
    if half % 4 == 0 and sys.byteorder == "little":
        word = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        spread = word & 0xF
        for k in range(1, 8):  # code k: bits 4k .. 4k+3 -> 8k .. 8k+3
            spread = spread | ((word & (0xF << (4 * k))) << (4 * k))
        return spread.view(torch.uint8)[:, :cols]
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, 2 * half)[:, :cols]


def _divide_blocks(x: torch.Tensor, absmax: torch.Tensor, block: int, factor: float = 1.0) -> torch.Tensor:
    """``x * (factor / absmax)`` per block: one correctly rounded reciprocal per block (times
    ``factor``, a float32 product, when it is not 1), then IEEE multiplies (the kernel computes the
    same). A reciprocal that overflows (absmax below ~2.9e-39, i.e. 2**-128) is replaced by 0: such a
    block is stored as zeros (its scale kept), and every normalized value is finite with
    |y| <= factor up to rounding, which the kernels' fast path relies on (before 2026-11-23 its
    nonzero values were stored as +-1)."""
    inv = 1.0 / absmax
    inv = torch.where(torch.isinf(inv), torch.zeros_like(inv), inv)
    return scale_blocks(x, inv * factor if factor != 1.0 else inv, block)


class Int4Codec(Codec):
    """Blockwise 4-bit state (default block 128 with an fp32 absmax per block)."""

    name = "int4"
    granularity = 256

    def __init__(self, block_size: int = 128, signed: Optional[bool] = None, stochastic_rounding: bool = False,
                 power: Optional[float] = None):
        if block_size <= 1 or 256 % block_size or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 2 dividing 256, got {block_size}")
        self.block_size = int(block_size)
        self.signed = signed
        self.stochastic_rounding = bool(stochastic_rounding)
        self.power = power
        is_signed = signed is not False
        self.effective_power = float(power or (2.0 if is_signed else 4.0))
        self.levels = int4_levels(is_signed, self.effective_power)
        self.midpoints = int4_midpoints(self.levels, is_signed, self.effective_power)
        self.integer_power = integer_power(is_signed, self.effective_power)
        self._tables = {}

    def config(self):
        return {"name": self.name, "block_size": self.block_size, "signed": self.signed,
                "stochastic_rounding": self.stochastic_rounding, "power": self.power}

    def specialize(self, nonnegative):
        if self.signed is not None:
            return self
        variants = self.__dict__.setdefault("_variants", {})  # one per sign: building one computes its tables
        if nonnegative not in variants:
            variants[nonnegative] = type(self)(self.block_size, not nonnegative, self.stochastic_rounding, self.power)
        return variants[nonnegative]

    @property
    def is_signed(self) -> bool:
        return self.signed is not False

    @property
    def kernel_form(self) -> Optional[StateKind]:
        """INT4 for blocks of 128 (the kernels' only 4-bit layout)."""
        return StateKind.INT4 if self.block_size == 128 else None

    def kernel_constants(self):
        return len(self.levels), 1.0 / self.effective_power, self.integer_power

    def kernel_tables(self, device):
        return self.tables(device)

    def payload_layout(self, rows, cols, dtype=torch.float32):
        nb = -(-cols // self.block_size)
        return {"codes": ((rows, (cols + 1) // 2), torch.uint8, 2),
                "scales": ((rows, nb), torch.float32, self.block_size)}

    def tables(self, device):
        """(levels, midpoints padded with +inf to 16, 16-entry decode table) on ``device``."""
        key = str(device)
        if key not in self._tables:
            lut = torch.zeros(16)
            lut[: len(self.levels)] = self.levels
            if self.integer_power and self.is_signed:  # the kernels' arithmetic decode of code 15
                lut[15] = 8.0 ** self.integer_power * int4_scale(True, self.effective_power)
            mids = torch.full((16,), float("inf"))
            mids[: len(self.midpoints)] = self.midpoints
            self._tables[key] = (self.levels.to(device), mids.to(device), lut.to(device))
        return self._tables[key]

    def codes_of(self, y: torch.Tensor, rbits: Optional[torch.Tensor]) -> torch.Tensor:
        """Codes (int32) for normalized values ``y`` in [-1, 1] (finite) or +-inf; ``rbits``: the
        int32 rounding bits (:meth:`RoundingContext.bits32`) for stochastic rounding by the level
        table (the non-negative integer-power levels round stochastically in their level domain:
        :meth:`level_domain_codes`)."""
        y = torch.where(y != y, 0.0, y)  # NaN -> 0 (vectorizes where nan_to_num's isnan does not)
        y = y.clamp(-1.0, 1.0) if self.is_signed else y.clamp(0.0, 1.0)
        if rbits is None:
            if self.integer_power:
                return self._nearest(y)
            return torch.bucketize(y, self.midpoints.to(y.device), out_int32=True)
        levels = self.levels.to(y.device)
        lo = (torch.bucketize(y, levels, out_int32=True, right=True) - 1).clamp(0, len(levels) - 2)
        l0, l1 = levels[lo], levels[lo + 1]
        code = lo + (_uniform(rbits) < (y - l0) / (l1 - l0)).to(torch.int32)
        return code if self.is_signed else torch.where(y > 0, code.clamp_min(1), code)

    @property
    def level_domain(self) -> float:
        """``15**p`` for non-negative integer-power levels (level ``j`` is ``j**p`` in the domain
        ``x * (15**p / absmax)``, where they round stochastically), else 0."""
        return float(15 ** self.integer_power) if self.integer_power and not self.is_signed else 0.0

    def level_domain_codes(self, z: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
        """Stochastically rounded codes (int32) of ``z = x * float32(15**p / absmax)`` (in
        [0, 15**p] up to rounding; NaN -> 0) for the non-negative integer-power levels, as the
        kernels' ``encode_int4_unsigned_sr``: ``lo`` = the largest level ``j**p <= z`` (clamped to
        0..14), then ``lo + 1`` with probability ``(z - l0) / (l1 - l0)``, decided as
        ``u * (l1 - l0) < z - l0``; a positive value never gets code 0."""
        z = torch.where(z != z, 0.0, z).clamp(0.0, self.level_domain)
        lo, l0, l1 = self._bracket(z)
        code = lo + (_uniform(rbits) * (l1 - l0) < z - l0).to(torch.int32)
        return torch.where(z > 0, code.clamp_min(1), code)

    def _root(self, a: torch.Tensor) -> torch.Tensor:
        """``a ** (1 / p)`` for ``a >= 0``, approximately, as the kernels' ``int4_root``: the
        encoders only need the code it rounds to within one, and one exact comparison fixes it."""
        p = self.integer_power
        return a.sqrt() if p == 2 else a.sqrt().sqrt() if p == 4 else a.pow(1.0 / p)

    def _nearest(self, y: torch.Tensor) -> torch.Tensor:
        """``bucketize(y, midpoints)`` for clamped ``y`` (no NaN) and integer-power levels, by
        arithmetic as the kernels' ``encode_int4_signed`` / ``encode_int4_unsigned`` (no table
        search, so compiled CPU code vectorizes it): the rounded root-domain estimate is the code
        or one off, and one exact comparison with the float32 midpoint beside it decides (every
        midpoint is an exact integer times one float32 constant: :func:`int4_midpoints`)."""
        p, c = self.integer_power, int4_scale(self.is_signed, self.effective_power)
        if self.is_signed:  # est = round(7 + 7 sign(y) |y|**(1/p) + 1/2): the code or one above it
            est = torch.round(torch.copysign(self._root(y.abs()), y) * 7.0 + 7.5)
            w = est - 7.5  # the midpoint below est is sign(w) ((|w| - 1/2)**p + (|w| + 1/2)**p) c / 2
            aw = w.abs()
            mag = (w * w + 0.25) * c if p == 2 else (_ipow(aw - 0.5, p) + _ipow(aw + 0.5, p)) * (c * 0.5)
            return est.to(torch.int32) - (y <= torch.copysign(mag, w)).to(torch.int32)
        est = torch.round(self._root(y) * 15.0)  # the code or one below it
        bound = _ipow(est * est + est, p // 2) * c  # the midpoint above est
        code = est.to(torch.int32) + (y > bound).to(torch.int32)
        return torch.where(y > 0, code, 0)

    def _bracket(self, z: torch.Tensor):
        """``(lo, l0, l1)``: ``lo`` the largest level ``j**p <= z`` (clamped to 0..14) in the level
        domain ``z`` in [0, 15**p], and the integer levels ``lo**p``, ``(lo + 1)**p`` as float32,
        by arithmetic (as the kernels: no table search, no gather): ``floor(z ** (1/p))`` is ``lo``
        or one off, exact comparisons with the levels beside it decide."""
        p = self.integer_power

        def level(j):
            return _ipow(j, p)

        e0 = torch.floor(self._root(z)).clamp(max=14.0)
        la, lb = level(e0), level(e0 + 1.0)
        down = la > z
        up = (lb <= z) & (e0 < 14.0)
        lc = level(torch.where(down, e0 - 1.0, e0 + 2.0))
        l0 = torch.where(down, lc, torch.where(up, lb, la))
        l1 = torch.where(down, la, torch.where(up, lc, lb))
        return (e0 - down.to(e0.dtype) + up.to(e0.dtype)).to(torch.int32), l0, l1

    def encode_into(self, x, out, rounding=None):
        rows, cols = x.shape
        x = x.to(torch.float32)
        absmax = finite_absmax(to_blocks(x, self.block_size))
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        rbits = rounding.bits32(rows, cols, x.device) if (self.stochastic_rounding and rounding) else None
        if rbits is not None and self.level_domain:
            z = _divide_blocks(x, safe, self.block_size, self.level_domain)
            codes = self.level_domain_codes(z.contiguous(), rbits)
        else:
            codes = self.codes_of(_divide_blocks(x, safe, self.block_size).contiguous(), rbits)
        out["codes"].copy_(pack_nibbles(codes.to(torch.uint8)))
        out["scales"].copy_(absmax)

    def decode_into(self, payload, out):
        cols = out.shape[1]
        codes = unpack_nibbles(payload["codes"], cols)
        return out.copy_(scale_blocks(self.values_of(codes), payload["scales"], self.block_size))

    def values_of(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 levels of ``codes`` (integers 0..15), bit for bit the decode table's: for an
        :func:`integer_power` by arithmetic (``+-|j|**p`` times one float32 constant, no table
        lookup, so compiled CPU code vectorizes it), else by lookup."""
        if not self.integer_power:
            return self.tables(codes.device)[2][codes.long()]
        j = codes.to(torch.int32) - 7 if self.is_signed else codes.to(torch.int32)
        value = _ipow(j.abs(), self.integer_power).to(torch.float32) * int4_scale(self.is_signed, self.effective_power)
        return torch.where(j < 0, -value, value) if self.is_signed else value

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tables"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tables = {}
