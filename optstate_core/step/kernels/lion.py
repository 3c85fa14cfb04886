"""Fused Lion step on an encoded momentum (lion-pytorch's ``Lion`` semantics).

The reference twin is the engine's tiled path (decode -> ``lion_pytorch.Lion`` -> encode):
``p *= 1 - lr*wd``; ``p -= lr * sign(beta1*m + (1-beta1)*g)``; ``m = beta2*m + (1-beta2)*g``.
The products with ``1 - beta`` are fused multiply-adds, as torch's ``add(other, alpha=...)`` is.
"""
import triton
import triton.language as tl

from .codec_ops import load_state, store_state
from .common import (UNSPECIALIZED, block_skip, load_param_grad, load_step_mix, per_block, program_tile, scale_grad,
                     sr_indices, state_key, store_param, tile_offsets)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def lion_kernel(P, G, GS, M, MS, FLAGS, SEEDS, STEP, BASE, COLS, NBR, NBLOCKS, PROG_START, N_TENSORS,
                TPOW2: tl.constexpr, decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, m_levels, m_mids, m_lut,
                P_KIND: tl.constexpr, M_KIND: tl.constexpr, M_SR: tl.constexpr, M_LEVELS: tl.constexpr,
                M_INV_POW: tl.constexpr, FIRST: tl.constexpr, CHECK_FINITE: tl.constexpr, NBLK: tl.constexpr,
                ALIGNED: tl.constexpr = False, IDX32: tl.constexpr = False, M_POW: tl.constexpr = 0):
    pid = tl.program_id(0)
    t, b0 = program_tile(pid, PROG_START, N_TENSORS, NBLK, TPOW2)
    elem, mask, pair, pmask, s8, s4, s4mask = tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK, ALIGNED)
    p_ptr, p, g = load_param_grad(P, G, t, elem, mask, P_KIND)
    g = scale_grad(g, GS, t, P_KIND)  # clipped here (1.0: nothing clips), as after a mul_ of the gradient
    m_addr = tl.load(M + t)
    ms_addr = tl.load(MS + t)
    if FIRST:
        m = tl.zeros_like(g)  # lion-pytorch: zeros_like(p) on the first step
    else:
        m = load_state(m_addr, ms_addr, elem, mask, pair, pmask, s8, s4, s4mask, m_lut, M_KIND, True, NBLK, M_POW)
    p = p * decay
    u = tl.fma(g, one_minus_beta1, m * beta1)
    s = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))
    p = p - lr * s
    m = tl.fma(g, one_minus_beta2, m * beta2)
    row_ok, p_mask, pmask_w, s8_w, s4mask_w = block_skip(g, mask, pmask, s8, s4mask, FLAGS, t, CHECK_FINITE, FIRST)
    if CHECK_FINITE and FIRST:  # a skipped block starts from a zero momentum
        m = tl.where(per_block(row_ok), m, 0.0)
    sr_idx = sr_indices(elem, BASE, t, M_SR, IDX32)
    store_state(m, m_addr, ms_addr, elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w,
                state_key(SEEDS, 4 * t, load_step_mix(STEP)), sr_idx, m_levels, m_mids, M_KIND, True, M_SR, M_LEVELS,
                NBLK, M_INV_POW, M_POW)
    if CHECK_FINITE:
        p_mask = mask & per_block(row_ok)
    store_param(p, p_ptr, elem, elem, p_mask, 0, P_KIND, False)
