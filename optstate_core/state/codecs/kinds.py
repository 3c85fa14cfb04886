"""The state kinds of the fused kernels: the one enum a codec's kernel form and a kernel's KIND constants come from."""
from __future__ import annotations

from enum import IntEnum


class StateKind(IntEnum):
    """How a fused kernel reads and writes one state (``Codec.kernel_form``; the kernels' ``*_KIND``)."""

    FP32 = 0
    BF16 = 1
    INT8 = 2  # blocks of 256, the default minifloat map
    INT4 = 3  # blocks of 128
    FP24 = 4  # bf16 + int8 residual: schedule-free's iterate only
