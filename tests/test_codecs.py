"""Codecs against a float64 reference, with the error bounds each one guarantees."""

import pytest
import torch

import optstate_core as oc
from optstate_core.state.codecs.int4 import int4_levels
from optstate_core.state.codecs.rounding import RoundingContext


def heavy_tailed(rows=64, cols=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g) * 1.5)


def block_max(x, block):
    rows, cols = x.shape
    pad = -cols % block
    xb = torch.nn.functional.pad(x.abs(), (0, pad)).reshape(rows, -1, block).amax(-1)
    return xb.repeat_interleave(block, 1)[:, :cols]


def pow2_scale(x, block):
    m = block_max(x, block)
    return torch.exp2(torch.floor(torch.log2(m)) + 1)


def test_fp32_is_identity():
    x = heavy_tailed().double()
    assert torch.equal(oc.FP32Codec().encode(x).decode(), x)


def test_bf16_relative_error():
    x = heavy_tailed().double()
    d = oc.BF16Codec().encode(x.float()).decode().double()
    assert ((d - x).abs() <= 2.0 ** -8 * x.abs()).all()


def test_fp16_block_scaled_relative_error():
    x = heavy_tailed().double()
    d = oc.FP16Codec().encode(x.float()).decode().double()
    big = x.abs() >= block_max(x, 256) * 2.0 ** -20  # above fp16's normal range after scaling
    assert ((d - x).abs() <= 2.0 ** -10 * x.abs())[big].all()


def test_int8_signed_bounds():
    x = heavy_tailed().double()
    codec = oc.Int8Codec().specialize(nonnegative=False)
    enc = codec.encode(x.float())
    d = enc.decode().double()
    s = pow2_scale(x, 256)
    normal = x.abs() >= s * 2.0 ** -15
    assert ((d - x).abs() <= x.abs() / 15)[normal].all()  # minifloat: relative precision
    assert ((d - x).abs() <= s * 2.0 ** -19)[~normal].all()  # subnormal steps of 2**-18 * s
    assert (torch.sign(d) == torch.sign(x))[d != 0].all()
    assert enc.nbytes * 8 / x.numel() < 8.14


def test_int8_unsigned_never_zero_and_relative():
    v = heavy_tailed().double() ** 2 * 1e-8
    v[0, :10] = 0.0
    d = oc.Int8Codec().specialize(nonnegative=True).encode(v.float()).decode().double()
    assert torch.equal(d[0, :10], torch.zeros(10, dtype=torch.float64))  # a true zero has its own code
    assert ((d > 0) == (v > 0)).all()  # nonzero never becomes zero
    s = pow2_scale(v, 256)
    in_range = v >= s * 2.0 ** -31  # the lowest binade gives up its first code to the exact zero
    assert ((d - v).abs() <= v / 15)[in_range].all()
    lowest = (v > 0) & ~in_range
    assert ((d - v).abs() <= v / 8)[lowest & (v >= s * 2.0 ** -32)].all()


def test_int4_signed_bound():
    x = heavy_tailed().double()
    codec = oc.Int4Codec().specialize(nonnegative=False)
    d = codec.encode(x.float()).decode().double()
    levels = int4_levels(True, 2.0).double()
    half_gap = (levels[1:] - levels[:-1]).max() / 2
    assert ((d - x).abs() <= half_gap * block_max(x, 128) * (1 + 1e-6)).all()
    assert codec.encode(x.float()).nbytes * 8 / x.numel() < 4.3


def test_int4_unsigned_log_bound_and_never_zero():
    v = heavy_tailed(seed=3).double().abs() * 1e-6
    codec = oc.Int4Codec().specialize(nonnegative=True)
    d = codec.encode(v.float()).decode().double()
    assert ((d > 0) == (v > 0)).all()
    levels = int4_levels(False, 4.0).double()
    max_ratio = (levels[2:] / levels[1:-1]).max()  # widest geometric gap between nonzero levels
    m = block_max(v, 128)
    in_range = v >= m * levels[1]
    ratio = (d / v)[in_range]
    assert (ratio <= max_ratio.sqrt() * (1 + 1e-5)).all() and (ratio >= 1 / max_ratio.sqrt() / (1 + 1e-5)).all()


@pytest.mark.parametrize("codec", [oc.Int8Codec(), oc.Int4Codec(), oc.FP16Codec()], ids=lambda c: c.name)
def test_nonfinite_does_not_spread(codec):
    x = heavy_tailed(rows=2, cols=512)
    x[0, 3], x[0, 7], x[1, 5] = float("nan"), float("inf"), float("-inf")
    codec = codec.specialize(nonnegative=False)
    d = codec.encode(x).decode()
    finite = torch.isfinite(x)
    ref = codec.encode(torch.where(finite, x, torch.zeros_like(x))).decode()
    assert torch.equal(d[finite], ref[finite])  # the rest of each block is unaffected
    assert torch.isfinite(d).all()


@pytest.mark.parametrize("codec", [oc.FP16Codec(), oc.Int8Codec(), oc.Int4Codec()], ids=lambda c: c.name)
def test_second_moment_does_not_underflow(codec):
    v = torch.full((1, 4096), 1e-10)
    v[0, ::7] = 1e-4  # large values in the same blocks
    assert (v.half() == 0).any()  # what plain fp16 does
    d = codec.specialize(nonnegative=True).encode(v).decode()
    assert (d > 0).all()


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_stochastic_rounding_unbiased_and_reproducible(name):
    codec = oc.get_codec(name, stochastic_rounding=True).specialize(nonnegative=False)
    x = (torch.rand(1, 256 * 64) - 0.5)
    x[0, ::256] = 1.0  # fix every block's scale
    n = 200
    mean = sum(codec.encode(x, RoundingContext(k * 7919 + 13, 0, 0)).decode() for k in range(n)) / n
    bias = (mean - x).abs().mean()
    plain = oc.get_codec(name).specialize(nonnegative=False).encode(x).decode()
    assert bias < 0.25 * (plain - x).abs().mean()  # unbiased on average, unlike nearest's error
    a = codec.encode(x, RoundingContext(5, 0, 0))
    b = codec.encode(x, RoundingContext(5, 0, 0))
    c = codec.encode(x, RoundingContext(6, 0, 0))
    key = "codes" if "codes" in a.payload else "data"
    assert torch.equal(a.payload[key], b.payload[key])
    assert not torch.equal(a.payload[key], c.payload[key])


def test_decode_encode_is_idempotent():
    x = heavy_tailed()
    for codec in (oc.Int8Codec().specialize(False), oc.Int4Codec().specialize(False),
                  oc.Int8Codec().specialize(True), oc.Int4Codec().specialize(True)):
        src = x.abs() if codec.signed is False else x
        e1 = codec.encode(src)
        e2 = codec.encode(e1.decode())
        assert all(torch.equal(e1.payload[k], e2.payload[k]) for k in e1.payload)


def test_unknown_codec_name():
    with pytest.raises(ValueError, match="unknown codec 'int7'"):
        oc.get_codec("int7")
    with pytest.raises(ValueError, match="block_size"):
        oc.Int8Codec(block_size=100)


def test_get_codec_aliases():
    assert oc.get_codec("8bit").name == "int8"
    assert oc.get_codec("4bit").name == "int4"
    assert oc.get_codec("none").lossless


def test_rounding_stream_is_the_documented_32_bit_formula():
    """The torch rounding bits (int32 arithmetic since 2026-11-23) are the stream of the scalar
    formula the Triton kernels also compute, for indices past 2**32 and keys past 2**31 too."""
    from optstate_core.state.codecs.rounding import ELEMENT_MULT, MASK32, mix32, random_bits

    def scalar(key, i):
        x = (((i & MASK32) ^ key) + mix32(i >> 32)) & MASK32
        y = (x * ELEMENT_MULT) & MASK32
        y ^= y >> 16
        return (y * ELEMENT_MULT) & MASK32
    idx = torch.tensor([0, 1, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 12345] +
                       list(range(1000, 1064)), dtype=torch.int64)
    for key in (0, 12345, 2**31, 2**32 - 1):
        expected = torch.tensor([scalar(key, int(i)) for i in idx])
        assert torch.equal(random_bits(key, idx), expected)
        assert torch.equal(random_bits(torch.tensor(key), idx), expected)  # key as a 0-d tensor
    assert torch.equal(RoundingContext(7, 2**32 - 3, 10).bits(2, 4, "cpu"),
                       torch.tensor([[scalar(7, 2**32 - 3 + r * 10 + c) for c in range(4)] for r in range(2)]))
    # indices below 2**32 take the int32 path (found out from a Python offset, or told with a
    # tensor offset): the same bits, across the 2**31 sign boundary and up to 2**32 - 1
    for offset, rows, stride, cols in ((0, 3, 7, 5), (2**31 - 6, 2, 4, 4), (2**32 - 12, 3, 4, 4)):
        expected = torch.tensor([[scalar(12345, offset + r * stride + c) for c in range(cols)] for r in range(rows)])
        assert torch.equal(RoundingContext(12345, offset, stride).bits(rows, cols, "cpu"), expected)
        assert torch.equal(RoundingContext(torch.tensor(12345), torch.tensor(offset), stride, narrow=True)
                           .bits(rows, cols, "cpu"), expected)


def test_arithmetic_decodes_equal_the_tables_bit_for_bit():
    from optstate_core.state.codecs.int4 import Int4Codec
    from optstate_core.state.codecs.int8 import MinifloatMap
    codes = torch.arange(256, dtype=torch.uint8)
    for signed in (True, False):
        for exp_bits in range(1, 7):
            m = MinifloatMap(signed, exp_bits)
            assert torch.equal(m.decode(codes).view(torch.int32), m.lut().view(torch.int32)), (signed, exp_bits)
        for power in (None, 1, 2, 3, 4, 6, 2.5):
            codec = Int4Codec(signed=signed, power=power)
            table = codec.tables("cpu")[2]
            got = codec.values_of(codes[:16])
            assert torch.equal(got.view(torch.int32), table.view(torch.int32)), (signed, power)


@pytest.mark.parametrize("signed,power", [(True, 1), (True, 2), (True, 3), (True, 4), (True, 7),
                                          (False, 2), (False, 4), (False, 6)])
def test_int4_nearest_by_arithmetic_equals_the_midpoint_search(signed, power):
    """Nearest 4-bit codes of integer-power levels are computed by arithmetic (a rounded root,
    then one comparison with a midpoint); at every midpoint, up to three float32 steps either
    side, the ends, zeros, tiny values and random values they are ``bucketize``'s codes."""
    from optstate_core.state.codecs.int4 import Int4Codec
    codec = Int4Codec(signed=signed, power=power)
    assert codec.integer_power == power
    mids, low = codec.midpoints, -1.0 if signed else 0.0
    near = [mids]
    for direction in (2.0, -2.0):
        step = mids
        for _ in range(3):
            step = torch.nextafter(step, torch.full_like(step, direction))
            near.append(step)
    gen = torch.Generator().manual_seed(power + 10 * signed)
    rand = torch.rand(200000, generator=gen)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-38, -1e-38, 1e-45, 3e-8, -3e-8])
    y = torch.cat([*near, special, rand ** power, rand * 2 - 1, -(rand ** power)]).clamp(low, 1.0)
    assert torch.equal(codec._nearest(y).long(), torch.bucketize(y, mids))
    assert torch.equal(codec.codes_of(y, None).long(), torch.bucketize(y, mids))


@pytest.mark.parametrize("power", [2, 4, 6])
def test_int4_stochastic_bracket_equals_the_table_search(power):
    """The stochastic 4-bit encoder of non-negative states finds each value's bracketing levels
    by arithmetic in the level domain (level j is j**p); at every level, one float32 step either
    side, and random values in [0, 15**p] it gives the table search's level index and the integer
    levels, bit for bit."""
    from optstate_core.state.codecs.int4 import Int4Codec
    codec = Int4Codec(signed=False, power=power, stochastic_rounding=True)
    assert codec.integer_power == power and codec.level_domain == 15.0 ** power
    levels = torch.arange(16, dtype=torch.float64).pow(power).float()
    top = codec.level_domain
    z = torch.cat([levels, torch.nextafter(levels, torch.full_like(levels, 2 * top)),
                   torch.nextafter(levels, torch.full_like(levels, -1.0)),
                   torch.rand(20000, generator=torch.Generator().manual_seed(power)) ** power * top,
                   torch.rand(20000, generator=torch.Generator().manual_seed(power + 1)) * top]).clamp(0.0, top)
    lo, l0, l1 = codec._bracket(z)
    expected = (torch.bucketize(z, levels, right=True) - 1).clamp(0, len(levels) - 2)
    assert torch.equal(lo.long(), expected)
    assert torch.equal(l0.view(torch.int32), levels[expected].view(torch.int32))
    assert torch.equal(l1.view(torch.int32), levels[expected + 1].view(torch.int32))


def test_int4_level_domain_rounding_is_unbiased_and_lands_on_the_bracket():
    """Stochastic 4-bit codes of non-negative states (decided in the level domain): every code is
    one of the two levels around its value (a positive value never 0), and over many draws the
    decoded mean matches the value within 5 standard errors of the two-level draw (above the first
    positive level; below it the code is 1, never 0)."""
    from optstate_core.state.codecs.int4 import Int4Codec
    from optstate_core.state.codecs.rounding import RoundingContext, stream_key
    codec = Int4Codec(signed=False, stochastic_rounding=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(1, 256, generator=gen) ** 4
    x[0, 0] = x[0, 128] = 1.0  # the maxima of both 128-element blocks: every value normalized by 1
    draws = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    levels = codec.levels.double()
    for step in range(draws):
        payload = {"codes": torch.empty(1, 128, dtype=torch.uint8), "scales": torch.empty(1, 2)}
        codec.encode_into(x, payload, RoundingContext(stream_key(11, step), row_stride=256))
        decoded = codec.decode_into(payload, torch.empty_like(x)).double()
        lo = (torch.bucketize(x.double(), levels, right=True) - 1).clamp(0, 14)
        assert bool(((decoded == levels[lo]) | (decoded == levels[lo + 1])).all())
        assert bool((decoded[x > 0] > 0).all())
        total += decoded
    spread = (levels[lo + 1] - levels[lo]) / 2
    above = x.double() >= levels[1]
    assert int(above.sum()) > 200
    error = (total / draws - x.double()).abs()
    assert bool((error <= 5 * spread / draws ** 0.5 + 1e-7)[above].all())


@pytest.mark.parametrize("cols", [1, 2, 3, 5, 6, 7, 8, 12, 16, 24, 256, 260])
def test_pack_nibbles_puts_element_2i_in_the_low_nibble(cols):
    """4-bit codes packed two per byte (eight at a time through an int64 view when the row holds a
    multiple of 8) are the element-by-element packing, and unpacking (eight at a time when the row
    has a multiple of 4 bytes) and the codec's decode give the codes back."""
    from optstate_core.state.codecs.int4 import Int4Codec, pack_nibbles, unpack_nibbles
    codes = torch.randint(0, 16, (5, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(cols))
    padded = torch.nn.functional.pad(codes, (0, cols % 2))
    expected = padded[:, 0::2] + padded[:, 1::2] * 16
    assert torch.equal(pack_nibbles(codes), expected)
    assert torch.equal(unpack_nibbles(expected, cols), codes)
    codec = Int4Codec(signed=False)
    payload = {"codes": pack_nibbles(codes), "scales": torch.ones(5, -(-cols // codec.block_size))}
    decoded = codec.decode_into(payload, torch.empty(5, cols))
    assert torch.equal(decoded, codec.values_of(codes))
