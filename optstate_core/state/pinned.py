"""Pinned host memory for offloaded state: one allocation per request, or views of shared slabs.

By default each request gets a pinned allocation of its own. Sharing is off because on CUDA it
breaks offloaded training: with states carved from shared 256 MiB slabs, the fused-path resume
test of the ``offload`` preset hangs (tests/gpu/test_resume_fused.py) and the 4-GPU DCP resume of
Llama-3-8B shapes with ``bf16w-4bit-lean-offload`` + release differs, while both are bit-exact with
one allocation per state (BENCHMARKS.md section 28). The cause is not found yet.

The price: torch's pinned allocator rounds every request up to a power of two, so a rank holds up
to twice its offloaded state in host memory (Llama-3-70B shapes on 4 GPUs: 65 GiB resident for
34 GiB of state; 38.5 GiB with shared slabs). ``OPTSTATE_PINNED_SLAB_BYTES=268435456`` turns
sharing on, for diagnosis only: a :class:`PinnedArena` then asks for slabs of exactly that size and
hands out aligned views of them (a larger request gets an allocation of its own).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Tuple

import torch

log = logging.getLogger("optstate.pinned")

SLAB_BYTES = 0  # one allocation per request (see above); 2**28 shares 256 MiB slabs
ALIGN_BYTES = 16  # every view starts 16-byte aligned: the kernels use 128-bit accesses
_TOTALS = {"bytes": 0, "seconds": 0.0}  # every arena of this process: bytes asked for, seconds spent asking
FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_HINTED = []  # the slow-pinning hint is logged once per process


def _hint_if_slow() -> None:
    """Once: where pinning runs under 3 GB/s over 4 GiB, name the allocator setting that speeds it up."""
    nbytes, seconds = _TOTALS["bytes"], _TOTALS["seconds"]
    if _HINTED or nbytes < 4 * 2**30 or nbytes / max(seconds, 1e-9) >= 3e9:
        return
    if "host_register" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", ""):
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

    def __init__(self, slab_bytes: int = None, pin: bool = True):
        # OPTSTATE_PINNED_SLAB_BYTES > 0: requests share slabs of that size (diagnosis only, see above)
        self.slab_bytes = int(slab_bytes if slab_bytes is not None else os.environ.get("OPTSTATE_PINNED_SLAB_BYTES",
                                                                                     SLAB_BYTES))
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
