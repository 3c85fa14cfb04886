"""Triton helpers every fused update kernel shares: tiles and their offsets, parameters and gradients, NaN/inf skips.

A program updates ``NBLK`` 256-element blocks of one tensor of a launch (pointer tables,
``launch.py``), as ``[2, NBLK, 128]`` tiles (``codec_ops.py``). The update kernels (``adam.py``,
``sgd.py``, ``lion.py``, ``schedule_free.py``) import these; nothing here is specific to one optimizer.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import interpreting
from .codec_ops import bf16_grid, mix32, round_to_bf16

#: update-kernel arguments compiled without specializing on their value: Triton otherwise compiles
#: a separate variant for a launch over one tensor (a count of 1 becomes a constant), so gradient
#: release (one parameter per launch) and bucket launches (several) each paid a compile of their
#: own, 1 s apiece on an H100 with Triton's cache empty (docs/benchmarks-journal.md section 34)
UNSPECIALIZED = ["N_TENSORS"]
P_FP32 = tl.constexpr(0)
P_BF16 = tl.constexpr(1)
P_FP16 = tl.constexpr(2)
# compiled kernels take a product that must not fuse into a later add (an fma rounds once) from
# libdevice's correctly rounded multiply; the interpreter (numpy) never fuses and has no libdevice
ROUNDED_MUL = tl.constexpr(not interpreting())


@triton.jit
def param_pointer(addr, P_KIND: tl.constexpr):
    if P_KIND == P_BF16:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    elif P_KIND == P_FP16:
        ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        ptr = addr.to(tl.pointer_type(tl.float32))
    return tl.multiple_of(ptr, 16)  # torch allocations are (at least) 16-byte aligned


@triton.jit
def sr_indices(elem, BASE, t, SR: tl.constexpr, IDX32: tl.constexpr):
    """Global element indices for stochastic rounding (uint32 when they all fit in 32 bits)."""
    if not SR:
        out = elem
    elif IDX32:
        out = elem.to(tl.uint32) + tl.load(BASE + t).to(tl.uint32)
    else:
        out = elem.to(tl.int64) + tl.load(BASE + t)
    return out


@triton.jit
def load_step_mix(STEP):
    """``step_mix`` of the optimizer's step count read from the device (codecs/rounding.py), so a
    replayed CUDA graph draws the rounding bits of the step it replays, not of the captured one."""
    return mix32(((tl.load(STEP) + 0x9E3779B9) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def state_key(SEEDS, i, step_mix):
    """The stream key of state ``i`` this step: mix32(seed ^ step_mix) (codecs/rounding.py)."""
    return mix32(tl.load(SEEDS + i).to(tl.uint32) ^ step_mix.to(tl.uint32))


@triton.jit
def load_param_grad(P, G, t, elem, mask, P_KIND: tl.constexpr):
    """The parameter's pointer and the tile of parameter and gradient values, as float32."""
    p_ptr = param_pointer(tl.load(P + t), P_KIND)
    g_ptr = param_pointer(tl.load(G + t), P_KIND)
    p = tl.load(p_ptr + elem, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + elem, mask=mask, other=0.0).to(tl.float32)
    return p_ptr, p, g


@triton.jit
def scale_grad(g, GS, t, P_KIND: tl.constexpr):
    """The gradient tile times tensor ``t``'s clip factor (``GS[t]``: the address of an fp32 factor
    that already holds the gradient dtype's rounding of it; 1.0 when nothing clips in the launch),
    rounded to the gradient's dtype: bit for bit what ``grad.mul_(factor)`` in that dtype and a
    load of the result would give, with no pass over the gradient (gradient release's clipping,
    ``fused_launch``). Every launch multiplies, so a launch that clips and one over gradients
    clipped beforehand run the same code (the compiler's fused multiply-adds included)."""
    f = tl.load(tl.load(GS + t).to(tl.pointer_type(tl.float32)))
    if ROUNDED_MUL:  # the product itself, as torch's multiply gives it (no fma with what follows)
        g = libdevice.mul_rn(g, f)
    else:
        g = g * f
    if P_KIND == P_BF16:
        g = round_to_bf16(g, 0, False)  # nearest-even by bits (the interpreter's cast truncates)
    elif P_KIND == P_FP16:
        g = g.to(tl.float16).to(tl.float32)
    return g


@triton.jit
def store_param(p, p_ptr, elem, sr_idx, mask, key, P_KIND: tl.constexpr, P_SR: tl.constexpr):
    """Store updated fp32 values into the parameter's dtype (bf16: nearest-even or stochastic)."""
    if P_KIND == P_BF16:
        p = bf16_grid(p, key, sr_idx, P_SR)
    tl.store(p_ptr + elem, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_master(p, C, t, elem, mask, MASTER: tl.constexpr):
    """MASTER (8 or 16 correction bits): the fp32 master from the bf16 parameter ``p`` (widened:
    its bits are b << 16) and its integer correction (twin: ``master_weights.join``)."""
    if MASTER == 8:
        c_ptr = tl.load(C + t).to(tl.pointer_type(tl.int8))
        d = tl.load(c_ptr + elem, mask=mask, other=0).to(tl.int32) * 256
    else:
        c_ptr = tl.load(C + t).to(tl.pointer_type(tl.int16))
        d = tl.load(c_ptr + elem, mask=mask, other=0).to(tl.int32)
    bits = p.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    m = tl.where(mag < 0x7F800000, tl.maximum(mag + d, 0), mag)
    return (m | (bits ^ mag)).to(tl.float32, bitcast=True)


@triton.jit
def store_master(x, p_ptr, C, t, elem, mask, MASTER: tl.constexpr):
    """MASTER: split the fp32 master into the bf16 parameter (nearest, ties away) and the
    correction, stored in the same pass (twin: ``master_weights.split`` + the corr codecs)."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    finite = mag < 0x7F800000
    m = tl.minimum(mag, 0x7F7F7FFF)
    b = (m + 0x8000) >> 16
    d = m - (b << 16)
    b = tl.where(finite, b, (mag >> 16) | tl.where(mag > 0x7F800000, 0x40, 0))  # NaN stays NaN
    d = tl.where(finite, d, 0)
    low = ((b << 16) | (bits ^ mag)).to(tl.float32, bitcast=True)  # exactly a bf16 value
    tl.store(p_ptr + elem, low.to(tl.bfloat16), mask=mask)
    if MASTER == 8:
        q = (d + 128) >> 8  # d / 256 rounded half to even, like torch.round
        q = tl.where(((d & 255) == 128) & ((q & 1) != 0), q - 1, q)
        q = tl.minimum(tl.maximum(q, -128), 127)
        c_ptr = tl.load(C + t).to(tl.pointer_type(tl.int8))
        tl.store(c_ptr + elem, q.to(tl.int8), mask=mask)
    else:
        c_ptr = tl.load(C + t).to(tl.pointer_type(tl.int16))
        tl.store(c_ptr + elem, d.to(tl.int16), mask=mask)


@triton.jit
def program_tile(pid, PROG_START, N_TENSORS, NBLK: tl.constexpr, TPOW2: tl.constexpr):
    """Tensor ``t`` and first tile of program ``pid``: ``t`` = the number of tensors whose first
    program is <= pid, minus one, counted over the per-tensor prefix table in one vector load
    (O(tensors) table memory instead of O(programs); TPOW2 >= tensors + 1, a power of two)."""
    i = tl.arange(0, TPOW2)
    starts = tl.load(PROG_START + i, mask=i <= N_TENSORS, other=2147483647)
    t = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
    return t, (pid - tl.load(PROG_START + t)) * NBLK


@triton.jit
def tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK: tl.constexpr, ALIGNED: tl.constexpr = False):
    """Offsets of the [2, NBLK, 128] tile of 256-column blocks ``b0 .. b0 + NBLK - 1`` of tensor
    ``t`` (axis 1: the block, axis 0: its half, axis 2: the column in the half; see codec_ops):
    (elements, mask, packed-byte offsets [2, NBLK, 64], their mask, int8 scale offsets [NBLK]
    (-1: none), int4 scale offsets [2, NBLK], their mask).

    ALIGNED: every row length is a multiple of 256 and offsets fit in int32, so block ``j``
    covers elements ``[256 j, 256 (j + 1))`` and the compiler can use wide, aligned accesses.
    """
    if ALIGNED:
        out = _aligned_offsets(t, b0, NBLOCKS, NBLK)
    else:
        out = _general_offsets(t, b0.to(tl.int64), COLS, NBR, NBLOCKS, NBLK)
    return out


@triton.jit
def per_block(v):
    """[NBLK] per-block values -> [1, NBLK, 1] (broadcasts over a tile)."""
    return v[None, :, None]


@triton.jit
def _aligned_offsets(t, b0, NBLOCKS, NBLK: tl.constexpr):
    nblocks = tl.load(NBLOCKS + t)
    j = b0 + tl.arange(0, NBLK)
    ok = j < nblocks
    half = tl.arange(0, 2)
    jj = per_block(j)
    hh = half[:, None, None]
    elem = jj * 256 + hh * 128 + tl.arange(0, 128)[None, None, :]
    mask = tl.broadcast_to(per_block(ok), (2, NBLK, 128))
    # contiguous in pairs (not more): the layout gives each thread the 2 bytes of its 4 elements
    pair = tl.max_contiguous(jj * 128 + hh * 64 + tl.arange(0, 64)[None, None, :], [1, 1, 2])
    pmask = tl.broadcast_to(per_block(ok), (2, NBLK, 64))
    s4 = 2 * j[None, :] + half[:, None]
    s4mask = tl.broadcast_to(ok[None, :], (2, NBLK))
    s8 = tl.where(ok, j, -1)
    return elem, mask, pair, pmask, s8, s4, s4mask


@triton.jit
def _general_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK: tl.constexpr):
    cols = tl.load(COLS + t)
    nbr = tl.load(NBR + t)
    nblocks = tl.load(NBLOCKS + t)
    j = b0 + tl.arange(0, NBLK).to(tl.int64)
    ok = j < nblocks
    row = j // nbr
    bc = j % nbr
    half = tl.arange(0, 2)
    hh = half[:, None, None]
    col = per_block(bc) * 256 + hh * 128 + tl.arange(0, 128)[None, None, :]
    mask = per_block(ok) & (col < cols)
    elem = per_block(row) * cols + col
    # 4-bit: packed bytes [rows, ceil(cols / 2)], scales [rows, ceil(cols / 128)]
    pcols = (cols + 1) // 2
    k = tl.arange(0, 64)[None, None, :]
    pair = tl.max_contiguous(per_block(row) * pcols + per_block(bc) * 128 + hh * 64 + k, [1, 1, 2])
    pmask = per_block(ok) & (per_block(bc) * 256 + hh * 128 + 2 * k < cols)
    nb128 = (cols + 127) // 128
    s4 = row[None, :] * nb128 + 2 * bc[None, :] + half[:, None]
    s4mask = ok[None, :] & (2 * bc[None, :] + half[:, None] < nb128)
    s8 = tl.where(ok, j, -1)
    return elem, mask, pair, pmask, s8, s4, s4mask


@triton.jit
def block_skip(g, mask, pmask, s8, s4mask, FLAGS, t, CHECK_FINITE: tl.constexpr, FIRST: tl.constexpr):
    """Per-block NaN/inf verdict of a [2, NBLK, 128] gradient tile and the store masks it implies:
    (row_ok [NBLK], element mask, packed-byte mask, int8 scale offsets (-1: skip), int4 scale mask).

    A 256-element block with a non-finite gradient value (or |g| >= 2**64) is not written;
    on a first step its state is still written (as zeros, the state it would have been created
    with), so only the parameter store is masked then. ``FLAGS[t]`` is raised for the count."""
    if CHECK_FINITE:
        # 2**64 = gradients.GRAD_OVERFLOW (its square overflows fp32), compared as bits of |g| (inf and
        # NaN lie above it), so the per-block test is an integer maximum
        gmax = tl.max(tl.max(g.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=0)
        out = skip_masks(gmax < 0x5F800000, mask, pmask, s8, s4mask, FLAGS, t, FIRST)
    else:
        out = tl.full(s8.shape, 1, tl.int1), mask, pmask, s8, s4mask
    return out


@triton.jit
def skip_masks(row_ok, mask, pmask, s8, s4mask, FLAGS, t, FIRST: tl.constexpr):
    """``block_skip``'s outputs for a given per-block verdict ``row_ok`` [NBLK]; raises ``FLAGS[t]``."""
    bad = (row_ok == 0).to(tl.int32)
    # every writer stores the same 1: a plain store (an atomic would fence the whole program)
    tl.store(FLAGS + t + tl.zeros_like(bad), bad, mask=bad != 0)
    if FIRST:
        out = row_ok, mask, pmask, s8, s4mask
    else:
        out = (row_ok, mask & per_block(row_ok), pmask & per_block(row_ok), tl.where(row_ok, s8, -1),
               s4mask & row_ok[None, :])
    return out
