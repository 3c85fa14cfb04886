"""Pinned host memory for offloaded state: views of shared slabs, one dtype per slab.

torch's pinned allocator rounds every request up to a power of two, so one allocation per state
holds up to twice the offloaded state in host memory (Llama-3-70B shapes on 4 GPUs: 65 GiB per rank
for 34 GiB of state; 38.5 GiB with shared slabs, docs/benchmarks-journal.md section 28). A :class:`PinnedArena`
therefore hands out 16-byte aligned views of slabs: per dtype (``torch.save`` refuses a storage
viewed as two dtypes), each new slab a power of two at least as large as what that dtype was handed
so far, from :data:`MIN_SLAB_BYTES` up to :data:`SLAB_BYTES` (a larger request gets an allocation of
its own), each request in the oldest slab with room for it (first fit). A small model wastes
little; a large one pins in a few hundred large slabs, and states allocated together lie side by
side, so their copies merge. Llama-3-8B shapes, ``bf16w-4bit-lean-offload``: 15.42 GiB of
requests take 15.50 GiB of slabs, 17.02 GiB as allocations of their own
(``tools/pinned_footprint.py``, docs/benchmarks-journal.md section 33).

**Sharing is on by default** (slabs up to :data:`SLAB_BYTES`; ``tuning.pinned_slab_bytes=0``, or
``OPTSTATE_PINNED_SLAB_BYTES=0``: every request an allocation of its own). It was off from section 34
to 38 of docs/benchmarks-journal.md: the 8B FSDP2 +
DCP resume with offloaded state differed between runs in 4 of 8 runs with shared slabs and 1 of 5
without. That was attention's backward, whose dQ is summed in an order that varies (sections 36 and
37, docs/limitations.md): under deterministic algorithms, two 8B resumes and five repeated runs on
2 GPUs with shared slabs were bit for bit equal (section 38).

Requests can be pinned ahead: :class:`PinAhead` pins a list of predicted sizes on a thread, and the
arena serves requests of those sizes from it (``schedule/pin_ahead.py`` predicts the first step's
requests; :meth:`PinnedArena.allocations` turns them into the arena's allocations).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger("optstate.pinned")

SLAB_BYTES = 2**28  # the largest shared slab to ask for (a power of two: torch's pinned allocator rounds up to one)
DEFAULT_SLAB_BYTES = SLAB_BYTES  # shared slabs unless tuning.pinned_slab_bytes=0 (see the module doc)
MIN_SLAB_BYTES = 2**20  # the first slab of a dtype (unless SLAB_BYTES is smaller)
MIN_ROOM_BYTES = 64  # a slab with less room left is full: later requests no longer look at it
ALIGN_BYTES = 16  # every view starts 16-byte aligned: the kernels use 128-bit accesses
# every arena of this process: bytes pinned, seconds the asking threads spent pinning or waiting for
# pinned memory, seconds spent in pinning calls on any thread (the pin-ahead thread's included)
_TOTALS = {"bytes": 0, "seconds": 0.0, "pinning_seconds": 0.0}
FAST_PINNING = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_HINTED = []  # the slow-pinning hint is logged once per process


def _hint_if_slow() -> None:
    """Once: where pinning runs under 3 GB/s over 4 GiB, name the allocator setting that speeds it up."""
    nbytes, seconds = _TOTALS["bytes"], _TOTALS["pinning_seconds"]
    if _HINTED or nbytes < 4 * 2**30 or nbytes / max(seconds, 1e-9) >= 3e9:
        return
    if "host_register" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", ""):
        return
    _HINTED.append(True)
    log.info("pinned %.1f GiB of offloaded state at %.1f GB/s; setting PYTORCH_CUDA_ALLOC_CONF=%s before "
             "torch starts makes this several times faster (docs/large-models.md)", nbytes / 2**30,
             nbytes / seconds / 1e9, FAST_PINNING)


def pinning_totals() -> Tuple[int, float]:
    """(bytes, seconds): what every arena of this process has pinned so far, and the seconds the
    threads that asked for it spent pinning or waiting (pinned ahead and ready: none)."""
    return _TOTALS["bytes"], _TOTALS["seconds"]


def padded_bytes(numel: int, dtype: torch.dtype) -> int:
    """The bytes an arena allocates for ``numel`` elements of ``dtype``: 16-byte padded, at least 16."""
    nbytes = max(int(numel) * dtype.itemsize, 1)
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _pin(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of (pinned) host memory, its seconds added to the process's pinning time."""
    t0 = time.perf_counter()
    out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    _TOTALS["pinning_seconds"] += time.perf_counter() - t0
    return out


class PinAhead:
    """Allocations of predicted byte sizes, pinned in order on a background thread.

    :meth:`take` hands over one of the asked size: ready, or the one being pinned now (it waits
    for it), or None when none is left to pin (one planned but not started is struck off: the
    caller pins it itself, beside the thread). :meth:`close` stops the thread and drops what was
    not taken. torch's pinning calls release the GIL, so the thread runs beside the caller's work.
    """

    def __init__(self, sizes: Sequence[int], pin: bool = True, device: Optional[torch.device] = None):
        self.pin = pin
        self.device = device  # a CUDA device: the thread's current one (no context made on another)
        self._pending = collections.deque(int(n) for n in sizes)
        self.planned = len(self._pending)
        self._ready: Dict[int, List[torch.Tensor]] = {}
        self._busy: Optional[int] = None  # the size being pinned now
        self._cv = threading.Condition()
        self._closed = False
        self.pinned_bytes = 0  # pinned by the thread so far
        self.taken = 0  # allocations handed over
        self.error: Optional[BaseException] = None  # the thread's failure (the caller pins for itself)
        self._thread = threading.Thread(target=self._run, name="optstate-pin-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                if self._closed or not self._pending:
                    self._busy = None
                    self._cv.notify_all()
                    return
                n = self._busy = self._pending.popleft()
            try:
                out = _pin(n, self.pin)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller, which pins for itself
                with self._cv:
                    self.error, self._busy = exc, None
                    self._pending.clear()
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = None
                if not self._closed:
                    self._ready.setdefault(n, []).append(out)
                    self.pinned_bytes += n
                self._cv.notify_all()

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """One allocation of ``nbytes`` pinned ahead, or None (the caller pins it itself)."""
        with self._cv:
            while True:
                ready = self._ready.get(nbytes)
                if ready:
                    self.taken += 1
                    return ready.pop()
                if self._busy != nbytes:
                    break
                self._cv.wait()
            try:
                self._pending.remove(nbytes)
            except ValueError:
                pass
            return None

    def close(self) -> int:
        """Stop pinning; drop what was not taken. Returns the bytes dropped."""
        with self._cv:
            self._closed = True
            self._pending.clear()
            dropped = sum(n * len(v) for n, v in self._ready.items())
            self._ready.clear()
        self._thread.join()
        return dropped

    def wait(self) -> None:
        """Until the thread has pinned everything planned (tests and benchmarks)."""
        self._thread.join()


class _Open:
    """A dtype's slab with room left: its bytes, those handed out, the slab (None in a replay)."""
    __slots__ = ("size", "used", "slab")

    def __init__(self, size: int, used: int, slab: Optional[torch.Tensor] = None):
        self.size, self.used, self.slab = size, used, slab


class _Fills:
    """Per dtype: its slabs with room left (oldest first) and the bytes handed out of all its slabs."""
    __slots__ = ("open", "given")

    def __init__(self, open_: Optional[List[_Open]] = None, given: int = 0):
        self.open, self.given = open_ if open_ is not None else [], given

    def replay(self) -> "_Fills":
        """A copy without the slabs, for :meth:`PinnedArena.allocations`."""
        return _Fills([_Open(o.size, o.used) for o in self.open], self.given)


class PinnedArena:
    """Hands out views of pinned slabs, one dtype per slab (``pin=False``: ordinary host memory, for
    tests); ``slab_bytes``: the largest slab (0: an allocation per request; default
    :data:`DEFAULT_SLAB_BYTES`; a wrapped optimizer's: ``tuning.pinned_slab_bytes``).

    A request goes to the oldest slab of its dtype with room for it (first fit: a large request
    that skips a slab's end leaves that room to later, smaller ones), else to a new slab."""

    def __init__(self, slab_bytes: int = DEFAULT_SLAB_BYTES, pin: bool = True):
        self.slab_bytes = int(slab_bytes)
        self.pin = pin
        self._fills: Dict[torch.dtype, _Fills] = {}
        self.slabs_allocated = 0  # slabs asked for so far (oversized requests included)
        self.bytes_allocated = 0  # their bytes
        self.ahead: Optional[PinAhead] = None  # allocations pinned ahead of the first step

    def _place(self, fills: Dict[torch.dtype, _Fills], padded: int, dtype: torch.dtype) -> Tuple[Optional[_Open], int, int]:
        """Where a request of ``padded`` bytes of ``dtype`` goes: (its slab, its offset there, the
        bytes of a new allocation it needs or 0); ``fills`` updated. The one rule of both
        :meth:`take` and :meth:`allocations`. An oversized request: (None, 0, its bytes)."""
        if padded > self.slab_bytes:  # an allocation of its own, of its exact size
            return None, 0, padded
        fill = fills.setdefault(dtype, _Fills())
        given, fill.given = fill.given, fill.given + padded
        for i, slab in enumerate(fill.open):
            if slab.used + padded <= slab.size:
                offset, slab.used = slab.used, slab.used + padded
                if slab.size - slab.used < MIN_ROOM_BYTES:  # full: no longer searched
                    del fill.open[i]
                return slab, offset, 0
        size = min(self.slab_bytes, max(MIN_SLAB_BYTES, 1 << (max(given, padded) - 1).bit_length()))
        slab = _Open(size, padded)
        if size - padded >= MIN_ROOM_BYTES:
            fill.open.append(slab)
        return slab, 0, size

    def allocations(self, requests: Sequence[Tuple[int, torch.dtype]]) -> List[int]:
        """The byte sizes of the allocations that requests of (padded bytes, dtype), in this order,
        would make from the arena's present state (nothing is allocated)."""
        fills = {dtype: fill.replay() for dtype, fill in self._fills.items()}
        return [n for n in (self._place(fills, padded, dtype)[2] for padded, dtype in requests) if n]

    def _bytes(self, nbytes: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.ahead.take(nbytes) if self.ahead is not None else None
        if out is None:
            out = _pin(nbytes, self.pin)
        _TOTALS["bytes"] += nbytes
        _TOTALS["seconds"] += time.perf_counter() - t0
        if self.pin:
            _hint_if_slow()
        return out

    def pin_ahead(self, sizes: Sequence[int], device: Optional[torch.device] = None) -> Optional[PinAhead]:
        """Start pinning allocations of these byte sizes (see :class:`PinAhead`; ``device``: the
        CUDA device they are for); allocations of those sizes are then served from them."""
        self.end_ahead()
        if sizes:
            self.ahead = PinAhead(sizes, self.pin, device)
        return self.ahead

    def end_ahead(self) -> None:
        """Stop pinning ahead and drop what was not asked for (logged)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        dropped = ahead.close()
        if ahead.error is not None:
            log.warning("optstate: pinning offloaded state ahead failed (%s); it was pinned when asked for", ahead.error)
        if dropped and self.pin and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # torch's allocator would keep the unused blocks cached
        log.debug("pinned ahead: %d allocations used, %.2f GiB unused dropped", ahead.taken, dropped / 2**30)

    def take(self, numel: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``dtype`` (``numel`` elements) in pinned memory."""
        nbytes = max(int(numel) * dtype.itemsize, 1)
        slab, offset, new = self._place(self._fills, padded_bytes(numel, dtype), dtype)
        if new:
            self.slabs_allocated += 1
            self.bytes_allocated += new
            memory = self._bytes(new)
            if slab is None:  # an allocation of its own
                return memory[:nbytes].view(dtype)[:numel].view(shape)
            slab.slab = memory
        return slab.slab[offset:offset + nbytes].view(dtype)[:numel].view(shape)

    def __getstate__(self):
        """Copies and pickles neither pin ahead (the thread and its allocations stay with the original)
        nor fill the original's slabs: their next requests start slabs of their own."""
        return {**self.__dict__, "ahead": None, "_fills": {}}

    def close(self) -> None:
        """Forget the slabs with room left (views alive keep their slabs) and what was pinned ahead."""
        self._fills.clear()
        self.end_ahead()
