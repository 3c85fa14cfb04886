"""Pinned host memory for offloaded state, carved from slabs of one size.

torch's pinned (page-locked) allocator rounds every request up to a power of two and keeps what is
freed for reuse. Offloaded state is allocated per release batch and per state key, requests of
odd sizes (75 MiB of 4-bit moments, 150 MiB of correction), so rounding alone nearly doubled the
host memory a rank held (Llama-3-70B shapes on 4 GPUs: 65 GiB resident for 34 GiB of state).
A :class:`PinnedArena` asks only for slabs of exactly ``SLAB_BYTES`` (a power of two: nothing
rounded) and hands out aligned views of them; a request larger than a slab gets an allocation of
its own. A slab goes back to torch's allocator (and is reused whole) when no view of it is alive.
Each optimizer has its own arena, so a ``torch.save`` of one optimizer's state never carries
another's bytes.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Tuple

import torch

log = logging.getLogger("optstate.pinned")

SLAB_BYTES = 2**28  # 256 MiB
ALIGN_BYTES = 16  # every view starts 16-byte aligned: the kernels use 128-bit accesses
_TOTALS = {"bytes": 0, "seconds": 0.0}  # every arena of this process: bytes asked for, seconds spent asking
FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_HINTED = []  # the slow-pinning hint is logged once per process


def _hint_if_slow() -> None:
    """Once: where pinning runs under 3 GB/s over 4 GiB, name the allocator setting that speeds it up."""
    nbytes, seconds = _TOTALS["bytes"], _TOTALS["seconds"]
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if _HINTED or nbytes < 4 * 2**30 or nbytes / max(seconds, 1e-9) >= 3e9 or "host_register" in conf:
        return
    _HINTED.append(True)
    log.info("pinned %.1f GiB of offloaded state at %.1f GB/s; setting PYTORCH_CUDA_ALLOC_CONF=%s before "
             "torch starts makes this several times faster (docs/large-models.md)", nbytes / 2**30,
             nbytes / seconds / 1e9, FAST_PINNING)


def pinning_totals() -> Tuple[int, float]:
    """(bytes, seconds): what every arena of this process has asked of torch's pinned allocator so far."""
    return _TOTALS["bytes"], _TOTALS["seconds"]


class PinnedArena:
    """Hands out views of pinned slabs of ``slab_bytes`` (``pin=False``: ordinary host memory, for tests)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES, pin: bool = True):
        self.slab_bytes = int(slab_bytes)
        self.pin = pin
        self._slab = None  # the slab being filled
        self._used = 0
        self.slabs_allocated = 0  # slabs asked for so far (oversized requests included)

    def _bytes(self, nbytes: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        _TOTALS["bytes"] += nbytes
        _TOTALS["seconds"] += time.perf_counter() - t0
        if self.pin:
            _hint_if_slow()
        return out

    def take(self, numel: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``dtype`` (``numel`` elements) in pinned memory."""
        nbytes = max(int(numel) * dtype.itemsize, 1)
        padded = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        if padded > self.slab_bytes:  # a slab of its own, of its exact size
            self.slabs_allocated += 1
            return self._bytes(padded)[:nbytes].view(dtype)[:numel].view(shape)
        if self._slab is None or self._used + padded > self.slab_bytes:
            self._slab, self._used = self._bytes(self.slab_bytes), 0
            self.slabs_allocated += 1
        view = self._slab[self._used:self._used + nbytes]
        self._used += padded
        return view.view(dtype)[:numel].view(shape)

    def close(self) -> None:
        """Forget the slab being filled (views alive keep their slabs)."""
        self._slab, self._used = None, 0
