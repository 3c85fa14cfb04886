"""Fused Adam/AdamW step on encoded state: decode -> exact torch update -> encode, one pass.

One launch covers many tensors (pointer tables, see ``launch.py``); each program updates
``ITERS`` x ``NBLK`` blocks of 256 elements of one tensor, ``NBLK`` at a time in a loop (the
per-program work, table reads and bias corrections, is shared by ``ITERS`` tiles). The update follows ``torch.optim.Adam``'s
single-tensor arithmetic (maximize, L2 or decoupled weight decay, lerp for the first moment,
amsgrad) with bias corrections computed from the per-parameter ``step`` tensor on the device
(``bias_corrections_kernel``, one program per tensor, just before; it also advances the step),
so no host synchronisation or host-side step value is needed (the step is CUDA-graph friendly).
With ``TORCH_FUSED`` (fp32 state of a ``fused=True`` optimizer) it follows torch's fused CUDA
kernel instead, bit for bit (``torch_fused_moments``; bias corrections from the launch).
The reference twin is the engine's tiled path (decode -> ``torch.optim.Adam`` -> encode);
``tests/kernels`` compares the two on random inputs.
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import interpreting
from .codec_ops import INT8, bf16_grid, int8_block_max_bits, load_state, mix32, round_to_bf16, store_state

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
def one_minus_pow(step, ln_beta):
    """1 - beta**step without cancellation: -expm1(step * ln(beta)), by a series when small."""
    x = step * ln_beta
    series = -x * (1.0 + x * (0.5 + x * (0.16666666666666666 + x * (0.041666666666666664 + x * 0.008333333333333333))))
    return tl.where(x > -0.05, series, 1.0 - tl.exp(x))


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


@triton.jit
def overflow_to_inf(v, g):
    """``v`` with +inf where |g| >= 2**64 (NaN stays NaN): a block's verdict then rides on the
    int8 second moment's own block maximum (inf and NaN bits lie above every finite value)."""
    return tl.where((g.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= 0x5F800000, float("inf"), v)


@triton.jit
def torch_fused_moments(m, v, g, beta1, beta2):
    """The moments as torch's fused CUDA Adam/AdamW kernel updates fp32 state (``adam_math`` in
    ATen's fused_adam_utils.cuh: betas as float32, ``beta * s + (1 - beta) * x`` in two fused
    multiply-adds), so the result is bit-identical to ``torch.optim.AdamW(fused=True)``; checked
    on the GPU against torch itself (tests/gpu/test_torch_fused_exact.py)."""
    gg = g * g
    m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
    v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
    return m, v


@triton.jit(do_not_specialize=UNSPECIALIZED)
def adam_kernel(P, G, GS, M, MS, V, VS, VM, VMS, CORR, FLAGS, SEEDS, STEP, BASE,
                COLS, NBR, NBLOCKS, PROG_START, N_TENSORS, TPOW2: tl.constexpr,
                lr_ptr, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay,
                m_levels, m_mids, m_lut, v_levels, v_mids, v_lut,
                P_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
                M_SR: tl.constexpr, V_SR: tl.constexpr, P_SR: tl.constexpr,
                M_LEVELS: tl.constexpr, V_LEVELS: tl.constexpr, M_INV_POW: tl.constexpr, V_INV_POW: tl.constexpr,
                AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                FIRST: tl.constexpr, CHECK_FINITE: tl.constexpr, LR_TENSOR: tl.constexpr,
                NBLK: tl.constexpr, ALIGNED: tl.constexpr = False, FAST_MATH: tl.constexpr = False,
                IDX32: tl.constexpr = False, M_POW: tl.constexpr = 0, V_POW: tl.constexpr = 0,
                ITERS: tl.constexpr = 1, C=0, MASTER: tl.constexpr = 0, TORCH_FUSED: tl.constexpr = False):
    pid = tl.program_id(0)
    t, b_first = program_tile(pid, PROG_START, N_TENSORS, NBLK * ITERS, TPOW2)
    # per program (one tensor): pointers, bias corrections, rounding keys
    p_ptr = param_pointer(tl.load(P + t), P_KIND)
    g_ptr = param_pointer(tl.load(G + t), P_KIND)
    if LR_TENSOR:
        lr = tl.load(lr_ptr)
    if TORCH_FUSED:  # CORR: [2, N_TENSORS] beta1**step, beta2**step from torch's own pow (see the launch)
        step_size = tl.math.div_rn(lr, 1.0 - tl.load(CORR + t))
        bc2_sqrt = tl.sqrt_rn(1.0 - tl.load(CORR + N_TENSORS + t))
        inv_bc2_sqrt = bc2_sqrt  # unused
    else:
        step_size = tl.load(CORR + 3 * t)  # bias corrections of this tensor (bias_corrections_kernel)
        inv_bc2_sqrt = tl.load(CORR + 3 * t + 1)
        bc2_sqrt = tl.load(CORR + 3 * t + 2)
    m_addr = tl.load(M + t)
    ms_addr = tl.load(MS + t)
    v_addr = tl.load(V + t)
    vs_addr = tl.load(VS + t)
    vm_addr = tl.load(VM + t)
    vms_addr = tl.load(VMS + t)
    step_mix = load_step_mix(STEP)
    m_key = state_key(SEEDS, 4 * t, step_mix)
    v_key = state_key(SEEDS, 4 * t + 1, step_mix)
    vm_key = state_key(SEEDS, 4 * t + 2, step_mix)
    p_key = state_key(SEEDS, 4 * t + 3, step_mix)
    # ITERS consecutive [2, NBLK, 128] tiles of that tensor (a loop: registers stay those of one tile)
    for it in range(ITERS):
        elem, mask, pair, pmask, s8, s4, s4mask = tile_offsets(t, b_first + it * NBLK, COLS, NBR, NBLOCKS, NBLK,
                                                               ALIGNED)
        p = tl.load(p_ptr + elem, mask=mask, other=0.0).to(tl.float32)
        g_in = tl.load(g_ptr + elem, mask=mask, other=0.0).to(tl.float32)
        g_in = scale_grad(g_in, GS, t, P_KIND)  # clipped here; the NaN/inf checks see it clipped, as after a mul_
        if MASTER != 0:  # master weights (bf16 parameter + correction C); off: the code below is unchanged
            p = load_master(p, C, t, elem, mask, MASTER)
        g = g_in
        if MAXIMIZE:
            g = -g
        if TORCH_FUSED:  # torch's fused CUDA Adam(W) arithmetic, fp32 throughout (see torch_fused_moments);
            if weight_decay != 0.0:  # decoupled here: fused.py keeps Adam's L2 decay off this path
                p = tl.fma(-(lr * weight_decay), p, p)
        elif DECOUPLED:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        if FIRST:
            m = tl.zeros(p.shape, dtype=tl.float32)
            v = tl.zeros(p.shape, dtype=tl.float32)
        else:
            m = load_state(m_addr, ms_addr, elem, mask, pair, pmask, s8, s4, s4mask, m_lut, M_KIND, True, NBLK, M_POW)
            v = load_state(v_addr, vs_addr, elem, mask, pair, pmask, s8, s4, s4mask, v_lut, V_KIND, False, NBLK,
                           V_POW)
        if TORCH_FUSED:
            m, v = torch_fused_moments(m, v, g, beta1, beta2)
        else:
            m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights < 0.5
            v = v * beta2 + (one_minus_beta2 * g) * g
        # the NaN/inf verdict of a block, folded into the int8 second moment's block maximum (one
        # block reduction fewer, g_in dies here): decoupled decay (|g| = |g_in|), not a first step
        FOLD: tl.constexpr = CHECK_FINITE and DECOUPLED and not FIRST and not AMSGRAD and V_KIND == INT8
        if FOLD:
            v = overflow_to_inf(v, g_in)
        if AMSGRAD:
            if FIRST:
                vmax = v
            else:
                vmax = load_state(vm_addr, vms_addr, elem, mask, pair, pmask, s8, s4, s4mask, v_lut, V_KIND, False,
                                  NBLK, V_POW)
                vmax = tl.maximum(vmax, v)
            vv = vmax
        else:
            vmax = v
            vv = v
        if TORCH_FUSED:  # correctly rounded, in torch's fused kernel's order (fp32 eps)
            p = p - tl.math.div_rn(step_size * m, tl.math.div_rn(tl.sqrt_rn(vv), bc2_sqrt) + eps)
        elif FAST_MATH:  # hardware square root and reciprocal square root (a few ulp), few instructions:
            r = tl.math.rsqrt(tl.sqrt(vv) * inv_bc2_sqrt + eps)  # 1 / denominator = r * r, no range fix-ups
            p = p - (step_size * m) * (r * r)
        else:  # correctly rounded, as torch
            p = p - step_size * tl.math.div_rn(m, tl.math.div_rn(tl.sqrt_rn(vv), bc2_sqrt) + eps)

        # per-block NaN/inf skip, decided after every load is issued: a block whose gradient is
        # not finite writes nothing (first step: its state is written as the initial zeros)
        if FOLD:
            v_max = int8_block_max_bits(v, mask, True, ALIGNED)
            row_ok, p_mask, pmask_w, s8_w, s4mask_w = skip_masks(v_max < 0x7F800000, mask, pmask, s8, s4mask,
                                                                 FLAGS, t, FIRST)
        else:
            v_max = 0
            row_ok, p_mask, pmask_w, s8_w, s4mask_w = block_skip(g_in, mask, pmask, s8, s4mask, FLAGS, t,
                                                                 CHECK_FINITE, FIRST)
        if CHECK_FINITE and FIRST:  # a skipped block keeps the initial (zero) state
            m = tl.where(per_block(row_ok), m, 0.0)
            v = tl.where(per_block(row_ok), v, 0.0)
            if AMSGRAD:
                vmax = tl.where(per_block(row_ok), vmax, 0.0)
        sr_idx = sr_indices(elem, BASE, t, M_SR or V_SR or P_SR, IDX32)
        # the states of a stored block are finite when its gradient is (|g| < 2**64 keeps g**2 finite)
        # and the parameter does not enter them (decoupled weight decay)
        store_state(m, m_addr, ms_addr, elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w, m_key, sr_idx, m_levels,
                    m_mids, M_KIND, True, M_SR, M_LEVELS, NBLK, M_INV_POW, M_POW, CHECK_FINITE and DECOUPLED, ALIGNED)
        store_state(v, v_addr, vs_addr, elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w, v_key, sr_idx, v_levels,
                    v_mids, V_KIND, False, V_SR, V_LEVELS, NBLK, V_INV_POW, V_POW, CHECK_FINITE and DECOUPLED, ALIGNED,
                    v_max, FOLD)
        if AMSGRAD:
            store_state(vmax, vm_addr, vms_addr, elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w, vm_key, sr_idx,
                        v_levels, v_mids, V_KIND, False, V_SR, V_LEVELS, NBLK, V_INV_POW, V_POW,
                        CHECK_FINITE and DECOUPLED, ALIGNED)
        if CHECK_FINITE:
            p_mask = mask & per_block(row_ok)
        if MASTER != 0:
            store_master(p, p_ptr, C, t, elem, p_mask, MASTER)
        else:
            store_param(p, p_ptr, elem, sr_idx, p_mask, p_key, P_KIND, P_SR)


@triton.jit
def bias_corrections_kernel(STEPS, CORR, lr_ptr, lr, ln_beta1, ln_beta2, LR_TENSOR: tl.constexpr,
                            ADVANCE: tl.constexpr = False, STEP_ONLY: tl.constexpr = False):
    """Per tensor of a launch (one program each), from its step count on the device (no host
    synchronisation): ``CORR[3 t .. 3 t + 2]`` = the step size ``lr / (1 - beta1**step)``,
    ``1 / sqrt(1 - beta2**step)`` and ``sqrt(1 - beta2**step)`` of the coming step, read by
    ``adam_kernel`` (once per tensor here instead of in every one of its programs). STEP_ONLY:
    ``CORR[t]`` = the coming step itself (torch's own pow takes it from there, TORCH_FUSED).
    ADVANCE: ``state['step'] += 1`` as well (the update kernel never reads it; blocks skipped for a
    non-finite gradient do not hold the step back: the tensor as a whole took it)."""
    t = tl.program_id(0)
    ptr = tl.load(STEPS + t).to(tl.pointer_type(tl.float32))
    step = tl.load(ptr) + 1.0
    if ADVANCE:
        tl.store(ptr, step)
    if STEP_ONLY:
        tl.store(CORR + t, step)
    else:
        if LR_TENSOR:
            lr = tl.load(lr_ptr)
        bc1 = one_minus_pow(step, ln_beta1)
        bc2_sqrt = tl.sqrt_rn(one_minus_pow(step, ln_beta2))
        tl.store(CORR + 3 * t, tl.math.div_rn(lr, bc1))
        tl.store(CORR + 3 * t + 1, 1.0 / bc2_sqrt)
        tl.store(CORR + 3 * t + 2, bc2_sqrt)


@triton.jit
def advance_steps_kernel(STEPS):
    """state['step'] += 1 for every tensor of the launch, after all its streamed pieces (blocks
    skipped for a non-finite gradient do not hold the step back: the tensor as a whole took it)."""
    t = tl.program_id(0)
    ptr = tl.load(STEPS + t).to(tl.pointer_type(tl.float32))
    tl.store(ptr, tl.load(ptr) + 1.0)
