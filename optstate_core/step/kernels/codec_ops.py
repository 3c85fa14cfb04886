"""Triton twins of the codecs (``optstate_core/state/codecs``): decode and encode state tiles in registers.

Each function reproduces its torch reference bit for bit on identical inputs: the int8
minifloat uses only exact multiplies and integer operations on float32 bits, the 4-bit
codebook compares against the same float32 midpoints (computed from the code for integer
powers, read from a table otherwise) after a correctly rounded division, bf16
rounds to nearest even, and stochastic rounding draws from the same counter hash
(``codecs/rounding.py``: a per-(state, step) key, then two multiplies and a xor-shift per element).

Tiles are ``[2, NBLK, 128]``: ``NBLK`` 256-element blocks of one tensor (the middle axis), each as
its two 128-element halves (the first axis). In that shape the compiler gives each warp whole
256-element blocks (per-block reductions stay inside a warp) and each thread four consecutive
elements of both halves, and a 4-bit tile's packed bytes are the ``[2, NBLK, 64]`` tensor whose
thread holds the two bytes of its four elements: codes unpack and pack in registers
(``tl.join``/``tl.split`` of the even and odd elements), with no shared-memory round trip.
4-bit codes are two per byte (even element in the low nibble).
"""
import triton
import triton.language as tl

from ...state.codecs.kinds import StateKind

# state kinds as the kernels' constexprs, from the one enum (a codec's ``kernel_form`` says which it has)
FP32 = tl.constexpr(int(StateKind.FP32))
BF16 = tl.constexpr(int(StateKind.BF16))
INT8 = tl.constexpr(int(StateKind.INT8))
INT4 = tl.constexpr(int(StateKind.INT4))
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
def finite_abs_bits(x, mask, FINITE: tl.constexpr = False, WHOLE: tl.constexpr = False):
    """The bits (int32) of |x| where finite and unmasked, else 0: the elements a block maximum is
    taken over. Bits of non-negative floats order as integers, so the maximum is an integer
    reduction (one warp-wide instruction on the GPU instead of a ladder of shuffles).
    FINITE: the caller guarantees finite values wherever the block is stored; WHOLE: ``mask`` is
    constant over each block and a masked block is not stored. Either drops its test (the blocks
    that are stored get the same maximum)."""
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if not FINITE:
        a = tl.where(a < 0x7F800000, a, 0)  # inf and NaN
    if not WHOLE:
        a = tl.where(mask, a, 0)
    return a


@triton.jit
def int8_block_max_bits(x, mask, FINITE: tl.constexpr = False, WHOLE: tl.constexpr = False):
    """[NBLK] bits of each 256-element block's largest |x| (``finite_abs_bits``'s elements)."""
    return tl.max(tl.max(finite_abs_bits(x, mask, FINITE, WHOLE), axis=2), axis=0)


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
def encode_int8(y, rbits, SIGNED: tl.constexpr, SR: tl.constexpr, FINITE: tl.constexpr = False):
    """Codes (int32) of values normalized by their block's power-of-two scale (see
    codecs/int8.py MinifloatMap.encode for the construction). FINITE: no NaN to map to 0."""
    if SR:
        half = (rbits & 0xFFFFF).to(tl.int32)
    else:
        half = 0x80000
    if SIGNED:
        a = tl.abs(y)
        if not FINITE:
            a = tl.where(a == a, a, 0.0)
        small = a < 3.0517578125e-05
        t = tl.where(small, a + 3.0517578125e-05, a)
        mag = ((t.to(tl.int32, bitcast=True) + half) >> 20) - tl.where(small, 896, 888)
        mag = tl.minimum(tl.maximum(mag, 0), 127)
        return tl.where((y < 0) & (mag > 0), mag | 128, mag)
    else:
        if FINITE:
            a = tl.maximum(y, 0.0)
        else:
            a = tl.maximum(tl.where(y == y, y, 0.0), 0.0)
        normal = ((a.to(tl.int32, bitcast=True) + half) >> 20) - 760
        return tl.where(a > 0, tl.minimum(tl.maximum(normal, 1), 255), 0)


# -- 4-bit codebook -------------------------------------------------------------------------------
@triton.jit
def ipow(k, P: tl.constexpr):
    """k ** P for a small integer- or half-integer-valued tensor and a constexpr P >= 1 (exact below
    2**24), squaring first for an even P (codecs/int4.py ``_ipow``)."""
    if P % 2 == 0:
        base = k * k
        out = base
        for _ in tl.static_range(P // 2 - 1):
            out = out * base
    else:
        out = k
        for _ in tl.static_range(P - 1):
            out = out * k
    return out


MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + MAGIC rounds x (|x| < 2**22) to an integer in the low bits


@triton.jit
def code_value(c, offset: tl.constexpr):
    """float32(c - offset) for integer codes 0 <= c < 2**22, exactly, by float arithmetic on the
    bits (no conversion instruction)."""
    return (c | 0x4B400000).to(tl.float32, bitcast=True) - (12582912.0 + offset)


@triton.jit
def copysign(mag, sign_of):
    """|mag| with the sign bit of ``sign_of`` (float32; ``mag`` must be non-negative)."""
    bits = mag.to(tl.int32, bitcast=True) | (sign_of.to(tl.int32, bitcast=True) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def int4_root(a, INV_POW: tl.constexpr):
    """a ** INV_POW for a in [0, 1] (approximate: the encoders only need the code it rounds to
    within one of the nearest, and fix that with one exact comparison)."""
    if INV_POW == 0.5:
        r = tl.sqrt(a)
    elif INV_POW == 0.25:
        r = tl.sqrt(tl.sqrt(a))
    else:
        r = tl.exp2(tl.log2(a) * INV_POW)
    return r


@triton.jit
def decode_int4(c, lut_ptr, SIGNED: tl.constexpr, POW: tl.constexpr):
    """Values of 4-bit codes (int32 0..15): arithmetic for integer powers, else the table. The
    arithmetic levels are ``(c - 7) ** p`` (signed) or ``c ** p`` times float32(1 / n**p), an
    exact integer times one constant like the torch codec's levels."""
    if POW == 0:
        out = tl.load(lut_ptr + c)
    elif SIGNED:
        d = code_value(c, 7.0)
        if POW % 2 == 0:
            out = ipow(d, POW - 1) * tl.abs(d) * (1.0 / 7 ** POW)
        else:
            out = ipow(d, POW) * (1.0 / 7 ** POW)
    else:
        out = ipow(code_value(c, 0.0), POW) * (1.0 / 15 ** POW)
    return out


@triton.jit
def encode_int4_signed(y, INV_POW: tl.constexpr, POW: tl.constexpr, FINITE: tl.constexpr = False):
    """``bucketize(clamp(y, -1, 1), mids)`` (NaN -> code 7) for the signed levels
    ``sign(j) (|j| / 7) ** p`` and midpoints ``(j**p + (j+1)**p) / (2 * 7**p)``.

    In the root domain ``z = 7 + 7 sign(y) |y| ** (1/p)`` the boundary between codes ``i`` and
    ``i + 1`` lies within 0.41 of ``i + 0.5`` (power means of neighbours), so ``est = floor(z) + 1``
    is the code or one above it: one exact comparison with the boundary below ``est`` decides.
    That boundary is ``sign(w) ((|w| - 1/2)**p + (|w| + 1/2)**p) c / 2`` with ``w = est - 7.5``
    (for ``est = 0`` it is below -1, so it never lowers the code): an exact integer times the
    torch codec's constant, the same float32 product. Codes are returned in the low 4 bits (the
    bits above are not cleared).

    FINITE: ``y`` is finite with ``|y| <= 1`` up to the rounding of ``x * (1 / absmax)``, which the
    comparison handles as the clamp would: no clamp, no NaN test."""
    if FINITE:
        a = tl.abs(y)
    else:
        a = tl.minimum(tl.abs(y), 1.0)  # NaN: whatever min gives, the code is replaced below
    sr = copysign(int4_root(a, INV_POW), y)
    t = (sr * 7.0 + 7.5) + MAGIC  # round(z + 1/2): an integer in the low mantissa bits
    w = (t - MAGIC) - 7.5
    if POW == 2:  # (|w| - 1/2)**2 + (|w| + 1/2)**2 = 2 (w**2 + 1/4): the factor 2 goes into c
        bound = copysign((w * w + 0.25) * (1.0 / 7 ** POW), w)
    else:
        aw = tl.abs(w)
        bound = copysign((ipow(aw - 0.5, POW) + ipow(aw + 0.5, POW)) * (0.5 / 7 ** POW), w)
    if FINITE:
        code = t.to(tl.int32, bitcast=True) - (y <= bound).to(tl.int32)
    else:
        code = t.to(tl.int32, bitcast=True) - (copysign(a, y) <= bound).to(tl.int32)
        code = tl.where(y == y, code, 7)
    return code


@triton.jit
def encode_int4_unsigned(y, INV_POW: tl.constexpr, POW: tl.constexpr, FINITE: tl.constexpr = False):
    """``bucketize(clamp(y, 0, 1), mids)`` (NaN -> 0) for the levels ``(j / 15) ** p`` and the
    geometric midpoints ``(j (j+1)) ** (p/2) / 15**p`` (even p).

    In the root domain ``15 y ** (1/p)`` the boundary between codes ``j`` and ``j + 1`` is
    ``sqrt(j (j+1))``, below ``j + 1/2``: ``est = round(15 y ** (1/p))`` is the code or one below
    it, and one exact comparison with the boundary above ``est`` decides (0 for ``est = 0``, so a
    positive value never gets code 0; above 1 for ``est = 15``). Codes are returned in the low 4
    bits (the bits above are not cleared).

    FINITE: ``y`` is finite, ``0 <= y <= 1`` up to the rounding of ``x * (1 / absmax)``: no clamp,
    no NaN or sign test (0 gets code 0 from the comparison)."""
    if FINITE:
        a = y
    else:
        a = tl.minimum(y, 1.0)  # NaN, negative: code 0 below
    t = int4_root(a, INV_POW) * 15.0 + MAGIC
    e = t - MAGIC
    bound = ipow(e * e + e, POW // 2) * (1.0 / 15 ** POW)
    code = t.to(tl.int32, bitcast=True) + (a > bound).to(tl.int32)
    if not FINITE:
        code = tl.where(y > 0, code, 0)
    return code


@triton.jit
def encode_int4_unsigned_sr(z, rbits, INV_POW: tl.constexpr, POW: tl.constexpr, FINITE: tl.constexpr = False):
    """Stochastically rounded codes for the levels ``(j / 15) ** p`` (even integer p) in their level
    domain ``z = x * float32(15**p / absmax)``, where level ``j`` is the integer ``j**p``, as
    codecs/int4.py ``level_domain_codes``: ``lo`` = the largest level <= z (clamped to 0..14), then
    ``lo + 1`` with probability ``(z - l0) / (l1 - l0)``; a positive value never gets code 0.

    ``e0 = floor(z ** (1/p))`` is ``lo`` or one off (the root is approximate); exact comparisons
    with the integer levels on both sides decide, so the codes equal the reference's. FINITE: ``z``
    is finite and non-negative (above ``15**p`` only by rounding, which the clamp of ``e0`` handles)."""
    if not FINITE:
        z = tl.where(z == z, z, 0.0)
        z = tl.minimum(tl.maximum(z, 0.0), 15.0 ** POW)
    e0 = tl.minimum(tl.floor(int4_root(z, INV_POW)), 14.0)
    la = ipow(e0, POW)
    lb = ipow(e0 + 1.0, POW)
    down = la > z
    up = (lb <= z) & (e0 < 14.0)
    lc = ipow(tl.where(down, e0 - 1.0, e0 + 2.0), POW)
    l0 = tl.where(down, lc, tl.where(up, lb, la))
    l1 = tl.where(down, la, tl.where(up, lc, lb))
    lo = e0.to(tl.int32) - down.to(tl.int32) + up.to(tl.int32)
    u = (rbits >> 8).to(tl.float32) * 5.9604644775390625e-08
    code = lo + (u * (l1 - l0) < z - l0).to(tl.int32)  # u < (z - l0) / (l1 - l0), without the division
    return tl.where(z > 0, tl.maximum(code, 1), code)


@triton.jit
def encode_int4(y, rbits, levels_ptr, mids_ptr, N_LEVELS: tl.constexpr, SIGNED: tl.constexpr,
                SR: tl.constexpr, INV_POW: tl.constexpr, POW: tl.constexpr = 0, FINITE: tl.constexpr = False):
    """Codes of values normalized by their block absmax (codecs/int4.py codes_of), in the low 4
    bits of an int32 (the bits above may be set).

    Nearest, integer power: :func:`encode_int4_signed` / :func:`encode_int4_unsigned`. Other
    powers: the level map is ``(j / n) ** p``, so ``round(n * |y| ** (1 / p))`` is within one
    code of the nearest-by-midpoint code; one comparison on each side makes it exact (the
    midpoint table is padded with +inf to 16 entries)."""
    if POW != 0 and not SR:
        if SIGNED:
            return encode_int4_signed(y, INV_POW, POW, FINITE)
        else:
            return encode_int4_unsigned(y, INV_POW, POW, FINITE)
    if POW != 0 and SR and not SIGNED:  # y: in the level domain (store_state)
        return encode_int4_unsigned_sr(y, rbits, INV_POW, POW, FINITE)
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
    else:  # a non-integer power: the midpoints from the table
        r = int4_root(tl.abs(y), INV_POW)
        if SIGNED:
            idx = (r * 7.0 + 0.5).to(tl.int32)
            code = tl.minimum(tl.maximum(tl.where(y < 0, 7 - idx, 7 + idx), 0), N_LEVELS - 1)
        else:
            code = tl.minimum((r * 15.0 + 0.5).to(tl.int32), N_LEVELS - 1)
        above = tl.load(mids_ptr + code)
        below = tl.load(mids_ptr + tl.maximum(code - 1, 0))
        code = tl.where(y > above, code + 1, tl.where((code > 0) & (y <= below), code - 1, code))
    return code


# -- load / store one state tile of any kind --------------------------------------------------------
@triton.jit
def load_state(data_addr, scale_addr, elem, mask, pair, pmask, s8, s4, s4mask, lut_ptr,
               KIND: tl.constexpr, SIGNED: tl.constexpr, NBLK: tl.constexpr, POW: tl.constexpr = 0):
    """Decode a [2, NBLK, 128] tile. ``elem`` element offsets, ``pair`` packed-byte offsets
    ([2, NBLK, 64], byte ``i`` holds elements ``2i`` and ``2i + 1`` of its half), ``s8`` per-block
    int8 scale offsets ([NBLK], -1: none), ``s4`` per-half int4 scale offsets ([2, NBLK])."""
    if KIND == FP32:
        return tl.load(aligned(data_addr, tl.float32) + elem, mask=mask, other=0.0)
    elif KIND == BF16:
        return tl.load(aligned(data_addr, tl.bfloat16) + elem, mask=mask, other=0.0).to(tl.float32)
    elif KIND == INT8:
        c = tl.load(aligned(data_addr, tl.uint8) + elem, mask=mask, other=0)
        s = tl.load(aligned(scale_addr, tl.float32) + s8, mask=s8 >= 0, other=0.0)
        return decode_int8(c, SIGNED) * s[None, :, None]
    else:
        b = tl.load(aligned(data_addr, tl.uint8) + pair, mask=pmask, other=0).to(tl.int32)
        c = tl.reshape(tl.join(b & 15, b >> 4), (2, NBLK, 128))  # even, odd elements: in registers
        s = tl.load(aligned(scale_addr, tl.float32) + s4, mask=s4mask, other=0.0)
        return decode_int4(c, lut_ptr, SIGNED, POW) * s[:, :, None]


@triton.jit
def store_state(x, data_addr, scale_addr, elem, mask, pair, pmask, s8, s4, s4mask, key, sr_idx, levels_ptr, mids_ptr,
                KIND: tl.constexpr, SIGNED: tl.constexpr, SR: tl.constexpr, N_LEVELS: tl.constexpr,
                NBLK: tl.constexpr, INV_POW: tl.constexpr = 0.5, POW: tl.constexpr = 0,
                FINITE: tl.constexpr = False, WHOLE: tl.constexpr = False, absmax_bits=0,
                HAVE_ABSMAX: tl.constexpr = False):
    """Encode a [2, NBLK, 128] tile (masked elements ignored) and store codes and scales.
    ``sr_idx``: the elements' indices in the whole tensor (the stochastic rounding counters).
    FINITE: every value of a block that is stored is finite (and non-negative for an unsigned
    codec); WHOLE: ``mask`` is constant over each 256-element block. Both only drop tests whose
    outcome is then known: the stored codes and scales are the same. HAVE_ABSMAX (int8): the
    caller already took the blocks' maxima, ``absmax_bits`` [NBLK] = ``int8_block_max_bits``."""
    if KIND == FP32:
        tl.store(aligned(data_addr, tl.float32) + elem, x, mask=mask)
    elif KIND == BF16:
        tl.store(aligned(data_addr, tl.bfloat16) + elem, bf16_grid(x, key, sr_idx, SR).to(tl.bfloat16), mask=mask)
    elif KIND == INT8:
        if HAVE_ABSMAX:
            absmax = absmax_bits.to(tl.float32, bitcast=True)
        else:
            absmax = int8_block_max_bits(x, mask, FINITE, WHOLE).to(tl.float32, bitcast=True)
        e = pow2_exponent(absmax)
        y = x * exp2_int(-e)[None, :, None]
        if SR:
            rb = random_bits(key, sr_idx)
        else:
            rb = 0
        codes = encode_int8(y, rb, SIGNED, SR, FINITE)
        tl.store(aligned(data_addr, tl.uint8) + elem, codes.to(tl.uint8), mask=mask)
        tl.store(aligned(scale_addr, tl.float32) + s8, exp2_int(e), mask=s8 >= 0)
    else:
        absmax = tl.max(finite_abs_bits(x, mask, FINITE, WHOLE), axis=2).to(tl.float32, bitcast=True)  # [2, NBLK]
        safe = tl.where(absmax > 0, absmax, 1.0)
        inv = tl.math.div_rn(1.0, safe)  # as the torch codec: the rounded reciprocal, 0 where it overflows
        inv = tl.where(inv < float("inf"), inv, 0.0)
        if SR and POW != 0 and not SIGNED:  # stochastic non-negative integer-power levels: the level domain
            inv = inv * (15.0 ** POW)
        y = x * inv[:, :, None]
        if SR:
            rb = random_bits(key, sr_idx)
        else:
            rb = 0
        codes = encode_int4(y, rb, levels_ptr, mids_ptr, N_LEVELS, SIGNED, SR, INV_POW, POW, FINITE)
        if not WHOLE:
            codes = tl.where(mask, codes, 0)  # the padding nibble of an odd row, as the torch codec
        lo, hi = tl.split(tl.reshape(codes, (2, NBLK, 64, 2)))  # even, odd elements: in registers
        tl.store(aligned(data_addr, tl.uint8) + pair, ((lo & 15) | (hi << 4)).to(tl.uint8), mask=pmask)
        tl.store(aligned(scale_addr, tl.float32) + s4, absmax, mask=s4mask)
