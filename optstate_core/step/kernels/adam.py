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

from .codec_ops import INT8, int8_block_max_bits, load_state, store_state
from .common import (UNSPECIALIZED, block_skip, load_master, load_step_mix, param_pointer, per_block, program_tile,
                     scale_grad, skip_masks, sr_indices, state_key, store_master, store_param, tile_offsets)


@triton.jit
def one_minus_pow(step, ln_beta):
    """1 - beta**step without cancellation: -expm1(step * ln(beta)), by a series when small."""
    x = step * ln_beta
    series = -x * (1.0 + x * (0.5 + x * (0.16666666666666666 + x * (0.041666666666666664 + x * 0.008333333333333333))))
    return tl.where(x > -0.05, series, 1.0 - tl.exp(x))


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
