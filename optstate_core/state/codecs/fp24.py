"""``fp24``: a float state as bf16 plus an 8-bit residual (3 bytes, a 16-bit significand).

The master-weight scheme applied to a state of its own (schedule-free's iterate ``z``): ``hi`` is
the value rounded to nearest bf16 and ``lo`` the rounded integer residual of its fp32 bit pattern
in units of 256 (:func:`optstate_core.state.master_weights.split` and ``join``; the ``corr8``
rounding). Bound, for finite ``|x| <= 3.3961e38``: ``|decode(x) - x| <= 255`` fp32 ulps of ``x``,
below ``2**-15 |x|`` for normal ``x``. NaN/inf stay NaN/inf. No stochastic rounding: an iterate
is not an average of small increments, and re-encoding a decoded value returns it exactly.
"""
from __future__ import annotations

import torch

from .base import Codec
from .kinds import StateKind

CORR_UNIT = 256  # the residual's unit: 8 of the 16 dropped bits are kept


class Float24Codec(Codec):
    """bf16 ``hi`` + int8 residual ``lo`` per element."""

    name = "fp24"
    kernel_form = StateKind.FP24  # schedule-free's iterate only

    def payload_layout(self, rows, cols, dtype=torch.float32):
        return {"hi": ((rows, cols), torch.bfloat16, 1), "lo": ((rows, cols), torch.int8, 1)}

    def encode_into(self, x, out, rounding=None):
        from ..master_weights import split

        hi, d = split(x)
        out["hi"].copy_(hi)
        out["lo"].copy_((d / CORR_UNIT).round_().clamp_(-128, 127))

    def decode_into(self, payload, out):
        from ..master_weights import join

        return out.copy_(join(payload["hi"], payload["lo"].float() * CORR_UNIT).view(out.shape))
