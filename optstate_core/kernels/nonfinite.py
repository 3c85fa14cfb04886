"""Multi-tensor check: flag every tensor whose gradient holds a NaN, inf or |g| >= 2**64 (no host sync).

The reference twin is ``(grad.abs() < 2**64).all()`` per tensor (``gradients.split_nonfinite``).
"""
import triton
import triton.language as tl

from .adam import param_pointer, program_tile, tile_offsets


@triton.jit
def nonfinite_flags_kernel(G, FLAGS, COLS, NBR, NBLOCKS, PROG_START, N_TENSORS, TPOW2: tl.constexpr,
                           P_KIND: tl.constexpr,
                           NBLK: tl.constexpr, ALIGNED: tl.constexpr = False):
    pid = tl.program_id(0)
    t, b0 = program_tile(pid, PROG_START, N_TENSORS, NBLK, TPOW2)
    elem, mask, _, _, _, _, _, _ = tile_offsets(t, b0, COLS, NBR, NBLOCKS, NBLK, ALIGNED)
    g = tl.load(param_pointer(tl.load(G + t), P_KIND) + elem, mask=mask, other=0.0).to(tl.float32)
    # 2**64 = gradients.GRAD_OVERFLOW (its square overflows fp32); NaN compares false: counted too
    bad = tl.max(tl.where(tl.abs(g) < 18446744073709551616.0, 0, 1))
    if bad != 0:
        tl.atomic_max(FLAGS + t, 1)
