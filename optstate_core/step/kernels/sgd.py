"""Fused SGD-with-momentum step on an encoded momentum buffer (torch.optim.SGD semantics).

The reference twin is the engine's tiled path (decode -> ``torch.optim.SGD`` -> encode).
"""
import triton
import triton.language as tl

from .codec_ops import load_state, store_state
from .common import (UNSPECIALIZED, block_skip, load_param_grad, load_step_mix, per_block, program_tile, scale_grad,
                     sr_indices, state_key, store_param, tile_offsets)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def sgd_kernel(P, G, GS, M, MS, FLAGS, SEEDS, STEP, BASE, COLS, NBR, NBLOCKS, PROG_START, N_TENSORS, TPOW2: tl.constexpr,
               lr_ptr, lr, momentum, dampening, weight_decay, m_levels, m_mids, m_lut,
               P_KIND: tl.constexpr, M_KIND: tl.constexpr, M_SR: tl.constexpr, M_LEVELS: tl.constexpr,
               M_INV_POW: tl.constexpr,
               NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, CHECK_FINITE: tl.constexpr,
               LR_TENSOR: tl.constexpr, NBLK: tl.constexpr, ALIGNED: tl.constexpr = False,
               IDX32: tl.constexpr = False, M_POW: tl.constexpr = 0):
    pid = tl.program_id(0)
    t, b0 = program_tile(pid, PROG_START, N_TENSORS, NBLK, TPOW2)
    elem, mask, pair, pmask, s8, s4, s4mask = tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK, ALIGNED)
    p_ptr, p, g = load_param_grad(P, G, t, elem, mask, P_KIND)
    g = scale_grad(g, GS, t, P_KIND)  # clipped here (1.0: nothing clips), as after a mul_ of the gradient
    g_in = g
    if LR_TENSOR:
        lr = tl.load(lr_ptr)
    if MAXIMIZE:
        g = -g
    g = g + weight_decay * p
    m_addr = tl.load(M + t)
    ms_addr = tl.load(MS + t)
    if FIRST:
        buf = g  # torch: torch.clone(grad) on the first step, no dampening
    else:
        buf = load_state(m_addr, ms_addr, elem, mask, pair, pmask, s8, s4, s4mask, m_lut, M_KIND, True, NBLK, M_POW)
        buf = buf * momentum + (1.0 - dampening) * g
    if NESTEROV:
        g = g + momentum * buf
    else:
        g = buf
    p = p - lr * g
    row_ok, p_mask, pmask_w, s8_w, s4mask_w = block_skip(g_in, mask, pmask, s8, s4mask, FLAGS, t, CHECK_FINITE, FIRST)
    if CHECK_FINITE and FIRST:  # a skipped block starts from a zero buffer
        buf = tl.where(per_block(row_ok), buf, 0.0)
    sr_idx = sr_indices(elem, BASE, t, M_SR, IDX32)
    store_state(buf, m_addr, ms_addr, elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w,
                state_key(SEEDS, 4 * t, load_step_mix(STEP)), sr_idx, m_levels, m_mids, M_KIND, True, M_SR, M_LEVELS, NBLK,
                M_INV_POW, M_POW)
    if CHECK_FINITE:
        p_mask = mask & per_block(row_ok)
    store_param(p, p_ptr, elem, elem, p_mask, 0, P_KIND, False)
