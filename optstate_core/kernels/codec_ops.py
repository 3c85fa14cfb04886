"""Triton twins of the codecs (``optstate_core/codecs``): decode and encode state tiles in registers.

Each function reproduces its torch reference bit for bit on identical inputs: the int8
minifloat uses only exact multiplies and integer operations on float32 bits, the 4-bit
codebook compares against the same float32 midpoints (computed from the code for integer
powers, read from a table otherwise) after a correctly rounded division, bf16
rounds to nearest even, and stochastic rounding draws from the same counter hash
(``codecs/rounding.py``: a per-(state, step) key, then two multiplies and a xor-shift per element). Tiles are ``[NBLK, 256]`` element blocks of one tensor; 4-bit codes
are two per byte (even element in the low nibble).
"""
import triton
import triton.language as tl

# state kinds (constexpr); the Python side maps codecs to these in optstate_core/fused.py
FP32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
INT8 = tl.constexpr(2)
INT4 = tl.constexpr(3)
TILE = tl.constexpr(256)


@triton.jit
def mix32(x):
    """The 32-bit mixer of codecs/rounding.py (uint32 arithmetic wraps like the masked int64)."""
    x = x ^ (x >> 16)
    x = x * 73244475  # 0x045D9F3B
    x = x ^ (x >> 16)
    x = x * 73244475
    x = x ^ (x >> 16)
    return x


@triton.jit
def element_mix(x):
    """codecs/rounding.py element_mix on uint32 (wrapping multiplies): multiply, xor-shift, multiply."""
    c = tl.full([], 0x9E3779B1, tl.uint32)
    y = x * c
    return (y ^ (y >> 16)) * c


@triton.jit
def random_bits(key, idx):
    """32 random bits (uint32) for element indices, keyed by a uint32 stream key. uint32
    indices (< 2**32) skip the high word, whose mix is 0 (the same bits as the int64 form)."""
    if idx.dtype == tl.uint32:
        out = element_mix(idx ^ key)
    else:
        wide = idx.to(tl.int64)
        out = element_mix(((wide & 0xFFFFFFFF).to(tl.uint32) ^ key) + mix32((wide >> 32).to(tl.uint32)))
    return out


@triton.jit
def aligned(addr, dtype: tl.constexpr):
    """A typed pointer from a table address, declared 16-byte aligned (torch allocations are)."""
    return tl.multiple_of(addr.to(tl.pointer_type(dtype)), 16)


@triton.jit
def round_to_bf16(x, rbits, SR: tl.constexpr):
    """float32 values on the bf16 grid (nearest-even, or stochastic from ``rbits``), so that the
    final conversion is exact whatever rounding the backend's cast uses."""
    bits = x.to(tl.int32, bitcast=True)
    if SR:
        add = (rbits & 0xFFFF).to(tl.int32)
    else:
        add = 0x7FFF + ((bits >> 16) & 1)
    r = ((bits + add) & -65536).to(tl.float32, bitcast=True)
    return tl.where((x == x) & (tl.abs(x) < float("inf")), r, x)


@triton.jit
def bf16_grid(x, key, sr_idx, SR: tl.constexpr):
    """``x`` rounded onto the bf16 grid: nearest-even, or stochastically with the counter hash."""
    if SR:
        rb = random_bits(key, sr_idx)
    else:
        rb = 0
    return round_to_bf16(x, rb, SR)


@triton.jit
def finite_abs(x, mask):
    """|x| where finite (NaN fails the comparison too), else 0."""
    a = tl.abs(x)
    return tl.where(mask & (a < float("inf")), a, 0.0)


@triton.jit
def pow2_exponent(absmax):
    """e with absmax / 2**e in [0.5, 1), clamped to [-125, 126] (codecs/blocks.py pow2_scale)."""
    bits = absmax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126
    return tl.minimum(tl.maximum(e, -125), 126)


@triton.jit
def exp2_int(e):
    """2**e as float32 for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


# -- int8 minifloat: signed E4M3 with subnormals, unsigned E5M3 with an exact zero --------------
@triton.jit
def decode_int8(codes, SIGNED: tl.constexpr):
    """Signed: sign + E4M3 with subnormals (a subnormal code is decoded as the first normal
    binade minus its lower bound, exact); unsigned: E5M3 with code 0 = 0."""
    c = codes.to(tl.int32)
    if SIGNED:
        mag = c & 127
        small = mag < 8
        val = (((tl.where(small, mag + 8, mag) + 888) << 20).to(tl.float32, bitcast=True)
               - tl.where(small, 3.0517578125e-05, 0.0))
        return tl.where(c >= 128, -val, val)
    else:
        val = ((c + 760) << 20).to(tl.float32, bitcast=True)
        return tl.where(c == 0, 0.0, val)


@triton.jit
def encode_int8(y, rbits, SIGNED: tl.constexpr, SR: tl.constexpr):
    """Codes (int32) of values normalized by their block's power-of-two scale (see
    codecs/int8.py MinifloatMap.encode for the construction)."""
    if SR:
        half = (rbits & 0xFFFFF).to(tl.int32)
    else:
        half = 0x80000
    if SIGNED:
        a = tl.abs(y)
        a = tl.where(a == a, a, 0.0)
        small = a < 3.0517578125e-05
        t = tl.where(small, a + 3.0517578125e-05, a)
        mag = ((t.to(tl.int32, bitcast=True) + half) >> 20) - tl.where(small, 896, 888)
        mag = tl.minimum(tl.maximum(mag, 0), 127)
        return tl.where((y < 0) & (mag > 0), mag | 128, mag)
    else:
        a = tl.where(y == y, y, 0.0)
        a = tl.maximum(a, 0.0)
        normal = ((a.to(tl.int32, bitcast=True) + half) >> 20) - 760
        return tl.where(a > 0, tl.minimum(tl.maximum(normal, 1), 255), 0)


# -- 4-bit codebook -------------------------------------------------------------------------------
@triton.jit
def ipow(k, P: tl.constexpr):
    """k ** P for a small integer tensor and a constexpr P >= 1."""
    out = k
    for _ in tl.static_range(P - 1):
        out = out * k
    return out


@triton.jit
def signed_int4_mid(u, POW: tl.constexpr):
    """The signed decision boundary between codes i and i + 1 for odd ``u = 2 i - 13``:
    ``sign(u) (j**p + (j+1)**p) c / 2`` with ``j = (|u| - 1) / 2`` (codecs/int4.py int4_midpoints),
    computed as one float32 product of an exact integer. |u| = 15 gives a bound beyond +-1, so the
    first and last codes need no guard."""
    a = tl.abs(u)
    if POW == 2:  # j**2 + (j+1)**2 = (u**2 + 1) / 2
        out = ((a * a + 1) * tl.where(u < 0, -1, 1)).to(tl.float32) * (0.25 / 7 ** POW)
    else:
        j = (a - 1) // 2
        out = ((ipow(j, POW) + ipow(j + 1, POW)) * tl.where(u < 0, -1, 1)).to(tl.float32) * (0.5 / 7 ** POW)
    return out


@triton.jit
def unsigned_int4_mid(j, POW: tl.constexpr):
    """The boundary between codes j and j + 1 of the non-negative map: (j (j+1))**(p/2) c (0 for
    j = -1 and 0, beyond 1 for j = 15)."""
    return ipow(j * (j + 1), POW // 2).to(tl.float32) * (1.0 / 15 ** POW)


@triton.jit
def decode_int4(c, lut_ptr, SIGNED: tl.constexpr, POW: tl.constexpr):
    """Values of 4-bit codes (int32 0..15): arithmetic for integer powers, else the table."""
    if POW == 0:
        out = tl.load(lut_ptr + c)
    elif SIGNED:
        d = c - 7
        if POW == 2:
            out = (d * tl.abs(d)).to(tl.float32) * (1.0 / 7 ** POW)
        else:
            mag = ipow(tl.abs(d), POW).to(tl.float32) * (1.0 / 7 ** POW)
            out = tl.where(d < 0, -mag, mag)
    else:
        out = ipow(c, POW).to(tl.float32) * (1.0 / 15 ** POW)
    return out


@triton.jit
def encode_int4_arith(y, r, SIGNED: tl.constexpr, POW: tl.constexpr):
    """Nearest codes for an integer power, ``bucketize(y, mids)`` exactly: the root-domain
    estimate (``r`` = |y| ** (1/p)) is within one code of it; one comparison with the computed
    boundary on each side fixes it (a value equal to a boundary takes the lower code)."""
    if SIGNED:
        est = (tl.where(y < 0, -r, r) * 7.0 + 7.5).to(tl.int32)  # in [0, 14]: y is clamped to [-1, 1]
        u = 2 * est - 13
        code = est - (y <= signed_int4_mid(u - 2, POW)).to(tl.int32) + (y > signed_int4_mid(u, POW)).to(tl.int32)
    else:
        est = (r * 15.0 + 0.5).to(tl.int32)  # in [0, 15]
        code = est - (y <= unsigned_int4_mid(est - 1, POW)).to(tl.int32) + \
            (y > unsigned_int4_mid(est, POW)).to(tl.int32)
        code = tl.maximum(code, 0)
    return code


@triton.jit
def encode_int4(y, rbits, levels_ptr, mids_ptr, N_LEVELS: tl.constexpr, SIGNED: tl.constexpr,
                SR: tl.constexpr, INV_POW: tl.constexpr, POW: tl.constexpr = 0):
    """Codes (int32) of values normalized by their block absmax (codecs/int4.py codes_of).

    Nearest: the level map is ``(j / n) ** p``, so ``round(n * |y| ** (1 / p))`` is within one
    code of the nearest-by-midpoint code; one comparison on each side makes it exact (the
    midpoint table is padded with +inf to 16 entries)."""
    y = tl.where(y == y, y, 0.0)
    if SIGNED:
        y = tl.minimum(tl.maximum(y, -1.0), 1.0)
    else:
        y = tl.minimum(tl.maximum(y, 0.0), 1.0)
    code = tl.zeros(y.shape, dtype=tl.int32)
    if SR:
        for i in tl.static_range(N_LEVELS):
            code += (tl.load(levels_ptr + i) <= y).to(tl.int32)
        lo = tl.minimum(tl.maximum(code - 1, 0), N_LEVELS - 2)
        l0 = tl.load(levels_ptr + lo)
        l1 = tl.load(levels_ptr + lo + 1)
        p = tl.math.div_rn(y - l0, l1 - l0)
        u = (rbits >> 8).to(tl.float32) * 5.9604644775390625e-08
        code = lo + (u < p).to(tl.int32)
        if not SIGNED:
            code = tl.where(y > 0, tl.maximum(code, 1), code)
    else:
        if INV_POW == 0.5:
            r = tl.sqrt(tl.abs(y))
        elif INV_POW == 0.25:
            r = tl.sqrt(tl.sqrt(tl.abs(y)))
        else:
            r = tl.exp2(tl.log2(tl.abs(y)) * INV_POW)
        if POW != 0:
            code = encode_int4_arith(y, r, SIGNED, POW)
        else:
            if SIGNED:
                idx = (r * 7.0 + 0.5).to(tl.int32)
                code = tl.minimum(tl.maximum(tl.where(y < 0, 7 - idx, 7 + idx), 0), N_LEVELS - 1)
            else:
                code = tl.minimum((r * 15.0 + 0.5).to(tl.int32), N_LEVELS - 1)
            above = tl.load(mids_ptr + code)
            below = tl.load(mids_ptr + tl.maximum(code - 1, 0))
            code = tl.where(y > above, code + 1, tl.where((code > 0) & (y <= below), code - 1, code))
    return code


@triton.jit
def per_half(v, NBLK: tl.constexpr):
    """[NBLK * 2] per-128-block values -> [NBLK, 256] (broadcast over each block)."""
    return tl.reshape(tl.broadcast_to(tl.reshape(v, (NBLK * 2, 1)), (NBLK * 2, 128)), (NBLK, 256))


# -- load / store one state tile of any kind --------------------------------------------------------
@triton.jit
def load_state(data_addr, scale_addr, elem, mask, pbyte, s8, s4, s4mask, lut_ptr,
               KIND: tl.constexpr, SIGNED: tl.constexpr, NBLK: tl.constexpr, POW: tl.constexpr = 0):
    """Decode a [NBLK, 256] tile. ``elem`` element offsets, ``pbyte`` the packed byte of each
    element ([NBLK, 256]: each byte is read by its two elements, which keeps every array in one
    register layout), ``s8`` per-row int8 scale offsets ([NBLK]), ``s4`` int4 scale offsets ([NBLK, 2])."""
    if KIND == FP32:
        return tl.load(aligned(data_addr, tl.float32) + elem, mask=mask, other=0.0)
    elif KIND == BF16:
        return tl.load(aligned(data_addr, tl.bfloat16) + elem, mask=mask, other=0.0).to(tl.float32)
    elif KIND == INT8:
        c = tl.load(aligned(data_addr, tl.uint8) + elem, mask=mask, other=0)
        s = tl.load(aligned(scale_addr, tl.float32) + s8, mask=s8 >= 0, other=0.0)
        return decode_int8(c, SIGNED) * s[:, None]
    else:
        b = tl.load(aligned(data_addr, tl.uint8) + pbyte, mask=mask, other=0).to(tl.int32)
        c = (b >> ((tl.arange(0, 256) & 1) * 4)[None, :]) & 15
        v = decode_int4(c, lut_ptr, SIGNED, POW)
        s = tl.load(aligned(scale_addr, tl.float32) + s4, mask=s4mask, other=0.0)  # [NBLK, 2]
        s = tl.reshape(tl.broadcast_to(tl.reshape(s, (NBLK * 2, 1)), (NBLK * 2, 128)), (NBLK, 256))
        return v * s


@triton.jit
def store_state(x, data_addr, scale_addr, elem, mask, pair, pmask, s8, s4, s4mask, key, sr_idx, levels_ptr, mids_ptr,
                KIND: tl.constexpr, SIGNED: tl.constexpr, SR: tl.constexpr, N_LEVELS: tl.constexpr,
                NBLK: tl.constexpr, INV_POW: tl.constexpr = 0.5, POW: tl.constexpr = 0):
    """Encode a [NBLK, 256] tile (masked elements ignored) and store codes and scales.
    ``sr_idx``: the elements' indices in the whole tensor (the stochastic rounding counters)."""
    if KIND == FP32:
        tl.store(aligned(data_addr, tl.float32) + elem, x, mask=mask)
    elif KIND == BF16:
        tl.store(aligned(data_addr, tl.bfloat16) + elem, bf16_grid(x, key, sr_idx, SR).to(tl.bfloat16), mask=mask)
    elif KIND == INT8:
        absmax = tl.max(finite_abs(x, mask), axis=1)
        e = pow2_exponent(absmax)
        y = x * exp2_int(-e)[:, None]
        if SR:
            rb = random_bits(key, sr_idx)
        else:
            rb = 0
        codes = encode_int8(y, rb, SIGNED, SR)
        tl.store(aligned(data_addr, tl.uint8) + elem, codes.to(tl.uint8), mask=mask)
        tl.store(aligned(scale_addr, tl.float32) + s8, exp2_int(e), mask=s8 >= 0)
    else:
        absmax = tl.max(tl.reshape(finite_abs(x, mask), (NBLK * 2, 128)), axis=1)  # [NBLK * 2]
        safe = tl.where(absmax > 0, absmax, 1.0)
        y = x * per_half(tl.math.div_rn(1.0, safe), NBLK)  # as the torch codec: the rounded reciprocal
        if SR:
            rb = random_bits(key, sr_idx)
        else:
            rb = 0
        codes = encode_int4(y, rb, levels_ptr, mids_ptr, N_LEVELS, SIGNED, SR, INV_POW, POW)
        codes = tl.where(mask, codes, 0)  # the padding nibble of an odd row, as the torch codec
        lo, hi = tl.split(tl.reshape(codes, (NBLK, 128, 2)))
        tl.store(aligned(data_addr, tl.uint8) + pair, (lo | (hi << 4)).to(tl.uint8), mask=pmask)
        tl.store(aligned(scale_addr, tl.float32) + s4, tl.reshape(absmax, (NBLK, 2)), mask=s4mask)
