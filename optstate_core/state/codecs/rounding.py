"""Counter-based random bits for stochastic rounding.

A stochastic rounding decision for element ``i`` of a state at optimizer step ``t`` is a pure
function of ``(seed, t, i)``: reproducible, identical on every rank and after a checkpoint
resume, and with no random buffer to store. The same arithmetic runs in the Triton kernels
(``optstate_core.step.kernels``); all products stay below 2**63 so the torch version can use int64.
"""
from __future__ import annotations

import zlib

import torch

MASK32 = 0xFFFFFFFF
_MULT = 0x045D9F3B  # odd, < 2**31: x * _MULT fits in int64 for any 32-bit x


def mix32(x: int) -> int:
    """Scalar 32-bit integer mixer (the same steps as :func:`mix32_tensor`)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MULT) & MASK32
    x ^= x >> 16
    x = (x * _MULT) & MASK32
    x ^= x >> 16
    return x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """Elementwise :func:`mix32` on an int64 tensor holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MULT) & MASK32
    x = x ^ (x >> 16)
    x = (x * _MULT) & MASK32
    return x ^ (x >> 16)


def step_mix(step: int) -> int:
    """The step's contribution to every stream key (the kernels receive this one number)."""
    return mix32(step + 0x9E3779B9)


def stream_key(seed: int, step: int) -> int:
    """The per-(state, step) key that every element index is mixed with."""
    return mix32((seed & MASK32) ^ step_mix(step))


def state_seed(base_seed: int, param_index: int, state_key: str) -> int:
    """A stable seed for one (parameter, state key): independent of process and rank."""
    return mix32(base_seed ^ zlib.crc32(f"{param_index}:{state_key}".encode()))


ELEMENT_MULT = 0x9E3779B1  # odd, ~2**32 / golden ratio: a Weyl sequence over consecutive indices


def _as_int32(c: int) -> int:
    """The int32 with the same 32 bits as ``c`` in [0, 2**32)."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _xorshift16(x: torch.Tensor) -> torch.Tensor:
    """``x ^ (x >> 16)`` of the 32 bits held in int32 ``x`` (a logical shift: mask the sign fill)."""
    return x ^ ((x >> 16) & 0xFFFF)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` on the 32 bits held in int32 ``x`` (wrapping multiplies)."""
    x = _xorshift16(x) * _MULT
    x = _xorshift16(x) * _MULT
    return _xorshift16(x)


def element_mix(x: torch.Tensor) -> torch.Tensor:
    """The per-element mixer: multiply, xor-shift, multiply (mod 2**32, on the 32 bits held in
    an int32 tensor; int32 multiplies wrap, and vectorize where int64 ones do not).

    Two multiplies and one xor-shift where :func:`mix32` has three xor-shifts: the key already
    carries a full :func:`mix32` of seed and step, so for a fixed element the bits are uniform
    and independent across steps (the map is a bijection); the middle xor-shift folds the well
    mixed high half of the first product into the low half, which decorrelates neighbouring
    indices (measured correlation of adjacent elements' rounding bits: |r| < 0.003)."""
    y = x * _as_int32(ELEMENT_MULT)
    return _xorshift16(y) * _as_int32(ELEMENT_MULT)


def _key32(key):
    """The 32 bits of ``key`` (a Python int or an int64 0-d tensor) as an int32."""
    return _as_int32(key & MASK32) if isinstance(key, int) else key.to(torch.int32)


def random_bits32(key, index: torch.Tensor) -> torch.Tensor:
    """:func:`random_bits`' 32 bits held in int32 (the form the codecs compute with)."""
    lo = index.to(torch.int32)  # the low 32 bits
    hi = _mix32_int32((index >> 32).to(torch.int32))  # 0 for indices below 2**32
    return element_mix((lo ^ _key32(key)) + hi)


def random_bits(key, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (as int64 in [0, 2**32)) for each element index (int64 tensor); ``key``
    a Python int in [0, 2**32) or an int64 0-d tensor holding one.

    The arithmetic is modulo 2**32 on int32 tensors (same bits as the Triton kernels' uint32
    twin and as the int64 formulation this replaced on 2026-11-23: the stream is unchanged)."""
    return random_bits32(key, index).to(torch.int64) & MASK32


class RoundingContext:
    """What a codec needs to round stochastically: a key and the flat index of element (0, 0).

    ``row_stride`` is the element distance between rows of the 2-D slab being encoded, so the
    index of slab element (r, c) is ``offset + r * row_stride + c`` in the whole tensor.
    ``narrow``: the caller knows every index is below 2**32 (``offset`` may then be a tensor);
    with a Python ``offset`` this is found out here. Narrow indices skip the high word, whose mix
    is 0, and the element arithmetic runs on int32 (as the Triton kernels' uint32 indices): the
    same bits, without per-element int64 work.
    """

    __slots__ = ("key", "offset", "row_stride", "narrow")

    def __init__(self, key: int, offset: int = 0, row_stride: int = 0, narrow: bool = False):
        self.key = key
        self.offset = offset
        self.row_stride = row_stride
        self.narrow = narrow

    def bits(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The 32 random bits of each slab element, as int64 in [0, 2**32)."""
        return self.bits32(rows, cols, device).to(torch.int64) & MASK32

    def bits32(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The same 32 bits held in int32 (the codecs' form: int32 arithmetic vectorizes twice as
        wide; take the top 24 bits as ``(b >> 8) & 0xFFFFFF``, the shift filling with the sign)."""
        r = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
        if self.narrow or (isinstance(self.offset, int) and self.offset + max(rows - 1, 0) * self.row_stride + cols
                           <= 1 << 32):
            row_lo = (self.offset + r * self.row_stride).to(torch.int32)  # per row, the low 32 bits
            lo = row_lo + torch.arange(cols, device=device, dtype=torch.int32).unsqueeze(0)  # wraps mod 2**32
            return element_mix(lo ^ _key32(self.key))
        c = torch.arange(cols, device=device, dtype=torch.int64).unsqueeze(0)
        return random_bits32(self.key, self.offset + r * self.row_stride + c)
