"""The registry of fused optimizers: which entry (one file each beside this one) steps an inner optimizer."""
from __future__ import annotations

from typing import Optional

from . import adam, lion, schedule_free, sgd
from .base import FusedOptimizer

#: every fused optimizer, asked in this order (a new one: its module's ENTRY here)
ENTRIES = (adam.ENTRY, sgd.ENTRY, lion.ENTRY, schedule_free.ENTRY)


def entry_for(inner) -> Optional[FusedOptimizer]:
    """The entry whose kernel steps ``inner``, or None (the reference path: :func:`no_kernel` says why)."""
    return next((entry for entry in ENTRIES if entry.matches(inner)), None)


def no_kernel(inner) -> str:
    """The logged reason an optimizer without an entry takes the reference path."""
    return f"{type(inner).__name__} has no fused kernel (Adam, AdamW, SGD and lion-pytorch's Lion do)"
