"""Fused schedule-free AdamW step (schedulefree's ``AdamWScheduleFree`` in train mode) on an encoded
second moment and an fp32, bf16 or fp24 iterate ``z``.

The reference twin is the engine's whole-step path (decode -> ``AdamWScheduleFree.step`` ->
encode). Per element, with the group's scalars computed on the host as the optimizer computes them
(``ckp1``, the warmed-up ``lr``, ``bias_correction2``)::

    v = beta2 * v + (1 - beta2) * g * g;   d = g / (sqrt(v / bc2) + eps) + decay * y
    y = lerp(y, z, ckp1) + lr * (beta1 * (1 - ckp1) - 1) * d;   z = z - lr * d

First step: ``z = y``, ``v = 0`` (the optimizer's own initialisation).
"""
import triton
import triton.language as tl

from ...state.codecs.kinds import StateKind
from .codec_ops import load_state, store_state
from .common import (UNSPECIALIZED, block_skip, load_master, load_param_grad, load_step_mix, per_block, program_tile,
                     scale_grad, sr_indices, state_key, store_master, store_param, tile_offsets)

FP24 = tl.constexpr(int(StateKind.FP24))  # the iterate as bf16 + int8 residual (state/codecs/fp24.py)


@triton.jit
def load_iterate(Z, ZS, t, elem, mask, pair, pmask, s8, s4, s4mask, Z_KIND: tl.constexpr, NBLK: tl.constexpr):
    """The iterate tile as float32: fp32/bf16 through the codec ops, fp24 as bf16 ``hi`` joined
    with its residual ``lo`` (the master-weight join)."""
    z_addr = tl.load(Z + t)
    if Z_KIND == FP24:
        hi = tl.load(z_addr.to(tl.pointer_type(tl.bfloat16)) + elem, mask=mask, other=0.0).to(tl.float32)
        z = load_master(hi, ZS, t, elem, mask, 8)
    else:
        z = load_state(z_addr, tl.load(ZS + t), elem, mask, pair, pmask, s8, s4, s4mask, Z, Z_KIND, True, NBLK)
    return z


@triton.jit(do_not_specialize=UNSPECIALIZED)
def schedule_free_adamw_kernel(P, G, GS, Z, ZS, V, VS, FLAGS, SEEDS, STEP, BASE, COLS, NBR, NBLOCKS, PROG_START,
                               N_TENSORS, TPOW2: tl.constexpr, lr, ckp1, y_coef, bias_correction2, eps, beta2,
                               one_minus_beta2, decay, v_levels, v_mids, v_lut,
                               P_KIND: tl.constexpr, Z_KIND: tl.constexpr, V_KIND: tl.constexpr, V_SR: tl.constexpr,
                               V_LEVELS: tl.constexpr, V_INV_POW: tl.constexpr, DECAY: tl.constexpr,
                               SMALL_WEIGHT: tl.constexpr, FIRST: tl.constexpr, CHECK_FINITE: tl.constexpr,
                               NBLK: tl.constexpr, ALIGNED: tl.constexpr = False, IDX32: tl.constexpr = False,
                               V_POW: tl.constexpr = 0):
    pid = tl.program_id(0)
    t, b0 = program_tile(pid, PROG_START, N_TENSORS, NBLK, TPOW2)
    elem, mask, pair, pmask, s8, s4, s4mask = tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK, ALIGNED)
    p_ptr, y, g = load_param_grad(P, G, t, elem, mask, P_KIND)
    y0 = y
    g = scale_grad(g, GS, t, P_KIND)
    v_addr = tl.load(V + t)
    vs_addr = tl.load(VS + t)
    if FIRST:
        z = y  # torch.clone(p)
        v = tl.zeros_like(g)
    else:
        z = load_iterate(Z, ZS, t, elem, mask, pair, pmask, s8, s4, s4mask, Z_KIND, NBLK)
        v = load_state(v_addr, vs_addr, elem, mask, pair, pmask, s8, s4, s4mask, v_lut, V_KIND, False, NBLK, V_POW)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # mul_(beta2), then addcmul_(g, g, value=1 - beta2)
    d = tl.div_rn(g, tl.sqrt_rn(tl.div_rn(v, bias_correction2)) + eps)  # IEEE division and root, as torch
    if DECAY:
        d = tl.fma(y, decay, d)
    if SMALL_WEIGHT:  # torch's lerp: the formula by the weight's size
        y = tl.fma(ckp1, z - y, y)
    else:
        y = z - (z - y) * (1.0 - ckp1)
    y = tl.fma(d, y_coef, y)
    z = tl.fma(d, -lr, z)
    row_ok, p_mask, pmask_w, s8_w, s4mask_w = block_skip(g, mask, pmask, s8, s4mask, FLAGS, t, CHECK_FINITE, FIRST)
    if CHECK_FINITE and FIRST:  # a skipped block starts from its creation values: z = p, v = 0
        ok = per_block(row_ok)
        v = tl.where(ok, v, 0.0)
        z = tl.where(ok, z, y0)
    sr_idx = sr_indices(elem, BASE, t, V_SR, IDX32)
    store_state(v, v_addr, vs_addr, elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w,
                state_key(SEEDS, 4 * t + 1, load_step_mix(STEP)), sr_idx, v_levels, v_mids, V_KIND, False, V_SR,
                V_LEVELS, NBLK, V_INV_POW, V_POW)
    z_addr = tl.load(Z + t)
    if Z_KIND == FP24:
        store_master(z, z_addr.to(tl.pointer_type(tl.bfloat16)), ZS, t, elem, p_mask, 8)
    else:
        store_state(z, z_addr, tl.load(ZS + t), elem, p_mask, pair, pmask_w, s8_w, s4, s4mask_w,
                    state_key(SEEDS, 4 * t, load_step_mix(STEP)), sr_idx, v_levels, v_mids, Z_KIND, True, False,
                    V_LEVELS, NBLK)
    if CHECK_FINITE:
        p_mask = mask & per_block(row_ok)
    store_param(y, p_ptr, elem, elem, p_mask, 0, P_KIND, False)
