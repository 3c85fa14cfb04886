"""Counter-based random bits for stochastic rounding.

A stochastic rounding decision for element ``i`` of a state at optimizer step ``t`` is a pure
function of ``(seed, t, i)``: reproducible, identical on every rank and after a checkpoint
resume, and with no random buffer to store. The same arithmetic runs in the Triton kernels
(``optstate_core.kernels``); all products stay below 2**63 so the torch version can use int64.
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


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), in 16-bit halves (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def element_mix(x: torch.Tensor) -> torch.Tensor:
    """The per-element mixer: multiply, xor-shift, multiply (mod 2**32; int64 holding [0, 2**32)).

    Two multiplies and one xor-shift where :func:`mix32` has three xor-shifts: the key already
    carries a full :func:`mix32` of seed and step, so for a fixed element the bits are uniform
    and independent across steps (the map is a bijection); the middle xor-shift folds the well
    mixed high half of the first product into the low half, which decorrelates neighbouring
    indices (measured correlation of adjacent elements' rounding bits: |r| < 0.003)."""
    y = _mul32(x, ELEMENT_MULT)
    return _mul32(y ^ (y >> 16), ELEMENT_MULT)


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits (as int64 in [0, 2**32)) for each element index (int64 tensor)."""
    lo = index & MASK32
    hi = mix32_tensor(index >> 32)  # 0 for indices below 2**32
    return element_mix(((lo ^ key) + hi) & MASK32)


class RoundingContext:
    """What a codec needs to round stochastically: a key and the flat index of element (0, 0).

    ``row_stride`` is the element distance between rows of the 2-D slab being encoded, so the
    index of slab element (r, c) is ``offset + r * row_stride + c`` in the whole tensor.
    """

    __slots__ = ("key", "offset", "row_stride")

    def __init__(self, key: int, offset: int = 0, row_stride: int = 0):
        self.key = key
        self.offset = offset
        self.row_stride = row_stride

    def bits(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        r = torch.arange(rows, device=device, dtype=torch.int64).unsqueeze(1)
        c = torch.arange(cols, device=device, dtype=torch.int64).unsqueeze(0)
        return random_bits(self.key, self.offset + r * self.row_stride + c)
