"""The Triton codec twins reproduce the torch codecs bit for bit on identical inputs."""
import pytest
import torch

import optstate_core as oc
from optstate_core.state.codecs.rounding import RoundingContext

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from optstate_core.step.kernels import launch  # noqa: E402
from optstate_core.step.kernels.common import program_tile, tile_offsets  # noqa: E402
from optstate_core.step.kernels.codec_ops import load_state, store_state  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NBLK = 2


@triton.jit
def encode_kernel(X, D, S, KEYS, COLS, NBR, NBLOCKS, PROG_START, N_TENSORS, TPOW2: tl.constexpr, levels, mids,
                  KIND: tl.constexpr, SIGNED: tl.constexpr, SR: tl.constexpr, N_LEVELS: tl.constexpr,
                  NBLK: tl.constexpr, INV_POW: tl.constexpr, POW: tl.constexpr, CLEAN: tl.constexpr = False):
    t, b0 = program_tile(tl.program_id(0), PROG_START, N_TENSORS, NBLK, TPOW2)
    elem, mask, pair, pmask, s8, s4, s4mask = tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK, CLEAN)
    x = tl.load(tl.load(X + t).to(tl.pointer_type(tl.float32)) + elem, mask=mask, other=0.0)
    store_state(x, tl.load(D + t), tl.load(S + t), elem, mask, pair, pmask, s8, s4, s4mask,
                tl.load(KEYS + t).to(tl.uint32), elem, levels, mids, KIND, SIGNED, SR, N_LEVELS, NBLK, INV_POW, POW,
                CLEAN, CLEAN)


@triton.jit
def decode_kernel(OUT, D, S, COLS, NBR, NBLOCKS, PROG_START, N_TENSORS, TPOW2: tl.constexpr, lut,
                  KIND: tl.constexpr, SIGNED: tl.constexpr, NBLK: tl.constexpr, POW: tl.constexpr,
                  CLEAN: tl.constexpr = False):
    t, b0 = program_tile(tl.program_id(0), PROG_START, N_TENSORS, NBLK, TPOW2)
    elem, mask, pair, pmask, s8, s4, s4mask = tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK, CLEAN)
    x = load_state(tl.load(D + t), tl.load(S + t), elem, mask, pair, pmask, s8, s4, s4mask, lut, KIND, SIGNED, NBLK,
                   POW)
    tl.store(tl.load(OUT + t).to(tl.pointer_type(tl.float32)) + elem, x, mask=mask)


SHAPES = [(3, 700), (257,), (1, 1), (5, 256), (2, 3, 129)]
CODECS = [oc.Int8Codec(), oc.Int8Codec(stochastic_rounding=True), oc.Int4Codec(), oc.Int4Codec(power=3.0), oc.Int4Codec(power=2.5),
          oc.Int4Codec(stochastic_rounding=True), oc.BF16Codec(), oc.BF16Codec(stochastic_rounding=True)]


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g) * torch.exp(2 * torch.randn(s, generator=g)) for s in SHAPES]
    xs[0][0, 5] = float("nan")
    xs[0][1, 9] = float("inf")
    xs[3][2, :] = 0.0
    return [x.to(DEVICE) for x in xs]


def tables(shapes):
    return launch.work_tables([tuple(s) for s in shapes], NBLK, torch.device(DEVICE))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-sr' if c.stochastic_rounding else ''}")
@pytest.mark.parametrize("nonnegative", [False, True])
def test_encode_and_decode_match_torch(codec, nonnegative):
    codec = codec.specialize(nonnegative)
    xs = inputs(3)
    if nonnegative:
        xs = [x.abs() * 1e-6 for x in xs]
    check_twin(codec, xs, nonnegative)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-sr' if c.stochastic_rounding else ''}")
@pytest.mark.parametrize("nonnegative", [False, True])
def test_clean_tiles_match_torch(codec, nonnegative):
    """The fast path of the fused step (aligned rows, finite values: no masks, clamps or NaN tests
    in the encoders) gives the torch codec's codes and scales too, including values at +-absmax
    (|x / absmax| may round above 1) and an all-zero block."""
    codec = codec.specialize(nonnegative)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(s, generator=g) * torch.exp(2 * torch.randn(s, generator=g)) for s in [(3, 512), (256,), (7, 256)]]
    xs[2][1, :] = 0.0
    xs[2][3, 128:] = 0.0
    xs[0][:, 17] = -xs[0].abs().amax(dim=1)
    if nonnegative:
        xs = [x.abs() * 1e-6 for x in xs]
    if isinstance(codec, oc.Int4Codec):  # subnormal: the reciprocal of the block maximum overflows
        tiny = torch.linspace(0, 2e-40, 128)
        xs[2][5, :128] = tiny
        xs[2][5, 128:] = tiny if nonnegative else -tiny
    check_twin(codec, [x.to(DEVICE) for x in xs], nonnegative, clean=True)


@pytest.mark.parametrize("clean", [False, True])
@pytest.mark.parametrize("nonnegative", [False, True])
@pytest.mark.parametrize("power", [None, 3.0])
def test_int4_codes_at_the_midpoints_match_torch(nonnegative, power, clean):
    """The arithmetic 4-bit encoder at every decision boundary and one float32 step either side
    (blocks of 128 led by 1.0, so the normalized values are exactly these), and the arithmetic
    decoder on all 16 codes."""
    codec = oc.Int4Codec(power=power).specialize(nonnegative)
    mids = codec.midpoints[torch.isfinite(codec.midpoints)]
    vals = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0)), codec.levels])
    if nonnegative:
        vals = vals.clamp_min(0)
    vals = torch.cat([vals, -vals]) if not nonnegative else vals
    n = vals.numel()
    assert n <= 127
    x = torch.zeros(2, 128)  # two 128-blocks: one whole 256-element tile
    x[:, 0] = 1.0
    x[0, 1:n + 1] = vals
    check_twin(codec, [x.reshape(1, -1).to(DEVICE)], nonnegative, clean)
    if codec.integer_power:  # every code, the arithmetic way, equals the table
        codes = torch.arange(16, dtype=torch.uint8)
        packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8).repeat(1, 8).to(DEVICE)
        enc = oc.EncodedTensor(codec, {"codes": packed, "scales": torch.ones(1, 1, device=DEVICE)}, (1, 128),
                               torch.float32)
        decoded = torch.full((1, 128), 123.0, device=DEVICE)
        cols, nbr, nblocks, prog_start, n_t, tpow2, n_prog = tables([(1, 128)])
        dev = torch.device(DEVICE)
        decode_kernel[(n_prog,)](launch.pointer_table([decoded], dev), launch.pointer_table([packed], dev),
                                 launch.pointer_table([enc.payload["scales"]], dev), cols, nbr, nblocks, prog_start,
                                 n_t, tpow2, codec.tables(dev)[2], KIND=3, SIGNED=not nonnegative, NBLK=NBLK,
                                 POW=codec.integer_power)
        torch.testing.assert_close(decoded, enc.decode(), rtol=0, atol=0)


@pytest.mark.parametrize("clean", [False, True])
@pytest.mark.parametrize("power", [None, 2.0])
def test_int4_stochastic_codes_at_the_levels_match_torch(power, clean):
    """The arithmetic stochastic 4-bit encoder of a non-negative state (its root estimate is
    corrected by exact comparisons with the levels) at every level and one float32 step either
    side, and at random values: the same codes as the torch codec's table search."""
    codec = oc.Int4Codec(power=power, stochastic_rounding=True).specialize(True)
    assert codec.integer_power
    levels = codec.levels
    vals = torch.cat([levels, torch.nextafter(levels, torch.full_like(levels, 2.0)),
                      torch.nextafter(levels, torch.full_like(levels, -2.0))]).clamp(0, 1)
    n = vals.numel()
    assert n <= 127
    x = torch.rand(4, 128, generator=torch.Generator().manual_seed(7)) ** 4
    x[:, 0] = 1.0
    x[0, 1:n + 1] = vals
    check_twin(codec, [x.reshape(2, 256).to(DEVICE)], True, clean)


def check_twin(codec, xs, nonnegative, clean=False):
    """Encode and decode with the kernels, bit for bit against the torch codec. ``clean``: the
    fused Adam step's fast path (aligned tiles, store_state's FINITE and WHOLE): every row a
    multiple of 256 long and every value finite."""
    keys = [12345 + 77 * i for i in range(len(xs))]
    refs = [codec.encode(x, RoundingContext(k, 0, x.numel() // (x.shape[0] if x.dim() >= 2 else 1)))
            for x, k in zip(xs, keys)]
    outs = [codec.encode(torch.zeros_like(x)) for x in xs]  # same layout, poisoned below
    for o in outs:
        for t in o.payload.values():
            t.fill_(0x5A if t.dtype == torch.uint8 else 7.0)
    kind = int(codec.kernel_form)
    cols, nbr, nblocks, prog_start, n_t, tpow2, n_prog = tables([x.shape for x in xs])
    dev = torch.device(DEVICE)
    data_key = "data" if kind == 1 else "codes"
    D = launch.pointer_table([o.payload[data_key] for o in outs], dev)
    S = launch.pointer_table([o.payload.get("scales") for o in outs], dev)
    X = launch.pointer_table(xs, dev)
    levels, mids, lut = codec.tables(dev) if kind == 3 else (torch.zeros(16, device=dev),) * 3
    signed = not nonnegative
    power = codec.integer_power if kind == 3 else 0  # 0: table decode / midpoints
    encode_kernel[(n_prog,)](X, D, S, launch.device_table(keys, dev), cols, nbr, nblocks, prog_start, n_t, tpow2, levels, mids,
                             KIND=kind, SIGNED=signed, SR=codec.stochastic_rounding,
                             N_LEVELS=len(levels) if kind == 3 else 2, NBLK=NBLK,
                             INV_POW=1.0 / codec.effective_power if kind == 3 else 0.5, POW=power, CLEAN=clean)
    for ref, out in zip(refs, outs):
        for name in ref.payload:  # bit-identical (NaN counts as equal to NaN)
            torch.testing.assert_close(out.payload[name], ref.payload[name], rtol=0, atol=0, equal_nan=True)
    decoded = [torch.full_like(x, 123.0) for x in xs]
    decode_kernel[(n_prog,)](launch.pointer_table(decoded, dev), D, S, cols, nbr, nblocks, prog_start, n_t, tpow2, lut,
                             KIND=kind, SIGNED=signed, NBLK=NBLK, POW=power, CLEAN=clean)
    for ref, got in zip(refs, decoded):
        torch.testing.assert_close(got, ref.decode(), rtol=0, atol=0, equal_nan=True)


def test_cached_tables_are_aligned_views_of_one_table_copied_once(monkeypatch):
    """A launch's changing tables (gradients, clip factors, a staged slab's states) share one
    device table: each sub-table holds its values, starts at a 16-byte boundary (Triton
    specializes pointer arguments on it), and the same values reuse the table without a copy."""
    launch.clear_caches()
    copies = []
    real = launch.device_table
    monkeypatch.setattr(launch, "device_table", lambda values, device, **kw: copies.append(list(values))
                        or real(values, device, **kw))
    lists = ([11, 12, 13], [21], [31, 32])
    tables = launch.cached_tables(lists, torch.device("cpu"))
    assert [t.tolist() for t in tables] == [list(v) for v in lists]
    assert all(t.data_ptr() % 16 == 0 for t in tables)
    assert len({t.untyped_storage().data_ptr() for t in tables}) == 1 and len(copies) == 1
    again = launch.cached_tables(lists, torch.device("cpu"))
    assert len(copies) == 1 and again[2].data_ptr() == tables[2].data_ptr()
    launch.cached_tables(([11, 12, 13], [22], [31, 32]), torch.device("cpu"))  # one address moved: one copy
    assert len(copies) == 2
    launch.clear_caches()
