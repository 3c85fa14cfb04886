"""Master-weight correction codecs: the integer residual that bf16 parameters drop, stored exactly.

The decoded value of a ``master_correction`` state is an integer ``d`` in ``[-2**15, 2**15)``
held in a float tensor (see :mod:`optstate_core.state.master_weights` for how ``d`` and the bf16
parameter make the fp32 master). ``corr16`` stores ``d`` exactly as int16 (the exact fp32
master); ``corr8`` stores ``d / 256`` rounded to int8 (a master with a 16-bit significand).
"""
from __future__ import annotations

import torch

from .base import Codec


class _CorrectionCodec(Codec):
    """Integer residuals ``d`` in units of ``2**(16 - bits)``, one integer per element."""

    bits = 16
    storage = torch.int16

    def payload_layout(self, rows, cols, dtype=torch.float32):
        return {"data": ((rows, cols), self.storage, 1)}

    def encode_into(self, x, out, rounding=None):
        lo, hi = -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1
        units = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0) / (1 << (16 - self.bits))
        out["data"].copy_(units.round().clamp_(lo, hi))

    def decode_into(self, payload, out):
        return out.copy_(payload["data"].float() * (1 << (16 - self.bits)))


class Correction16Codec(_CorrectionCodec):
    """int16 residual: bf16 parameter + correction is the fp32 master, bit for bit."""

    name = "corr16"
    bits = 16
    storage = torch.int16


class Correction8Codec(_CorrectionCodec):
    """int8 residual: bf16 parameter + correction is the master rounded to a 16-bit significand."""

    name = "corr8"
    bits = 8
    storage = torch.int8
