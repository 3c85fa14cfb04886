"""The host buffers of the phase switch (``offload()``/``reload()``), kept and reused across cycles.

A park copies every device state into host memory in the form it has (:mod:`.park`). The first
park allocates those buffers (pinned when the parameters are on CUDA: torch's pinning runs at
1.5-5 GB/s, several seconds for an 8B model's state); each buffer is then kept, by (parameter
index, state key), while the state is woken, and the next park copies into the same buffer. So
the pinned memory held stays what the first park took, and later parks only copy.

``opt.prepare_park()`` pins them ahead, on a thread (:meth:`ParkBuffers.prepare`): at once when
the state exists, else at the end of the first step (the state's codecs, shapes and dtypes are
known then), so the first park is as fast as the later ones. It is not done for every optimizer
at wrap(): the buffers hold as much host memory as the state holds GPU memory (16 GiB for an 8B
model at ``8bit``), page-locked, for users who may never park; RL users ask for it
(``optstate_rl.AdamW`` does). A buffer that no longer fits its state (another codec or shape after
a load) is replaced at the next park.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from ..state.codecs import EncodedTensor
from ..state.pinned import DEFAULT_SLAB_BYTES, PinnedArena
from ..state.store import allocate_many, state_nbytes
from ..step.work import Work
from .conform import same_codec_moves

log = logging.getLogger("optstate")

Slot = Tuple[int, str]  # (parameter index, state key)


def _fits(buffer: Optional[EncodedTensor], codec, shape, dtype: torch.dtype) -> bool:
    return buffer is not None and buffer.codec == codec and tuple(buffer.shape) == tuple(shape) and \
        buffer.dtype == dtype


class ParkBuffers:
    """Host buffers of parked state by slot; those a thread pins ahead; the arena they come from."""

    def __init__(self, slab_bytes: int = DEFAULT_SLAB_BYTES):
        # the park's own arena (``tuning.pinned_slab_bytes``): pinning ahead never meets the step's requests
        self.arena = PinnedArena(slab_bytes)
        self.slots: Dict[Slot, EncodedTensor] = {}
        self.after_first_step = False  # prepare() asked before any state existed
        self._thread: Optional[threading.Thread] = None
        self._made: Dict[Slot, EncodedTensor] = {}  # the thread's, merged into slots by join()
        self._error: Optional[BaseException] = None
        self.prepare_seconds: Optional[float] = None  # how long the last preparation pinned (its thread)

    # -- pinning ahead -------------------------------------------------------------------------
    def _wanted(self, engine) -> List[tuple]:
        """``(slot, codec, shape, dtype, device, pin)`` of each device state a park would copy to a
        buffer it does not have yet."""
        out = []
        saved, engine.placement.force_tier = engine.placement.force_tier, "host"  # as a park sees it
        try:
            for p, info in engine.param_infos():
                st = engine.state.get(p)
                if not st:
                    continue
                w = Work(p, info, st)
                pin = engine.ctx.pins(w.param.device)
                for key, value, codec, host, shape in same_codec_moves(engine, w):
                    if host and not _fits(self.slots.get((info.index, key)), codec, shape, value.dtype):
                        out.append(((info.index, key), codec, shape, value.dtype, w.param.device, pin))
        finally:
            engine.placement.force_tier = saved
        return out

    def prepare(self, engine, wait: bool = False) -> None:
        """Allocate (pin) the buffers the next park needs on a thread; before any state exists, at
        the end of the first step. ``wait``: return once they are there."""
        self.join()
        if not any(engine.state.get(p) for p, _ in engine.param_infos()):
            self.after_first_step = True
            return
        self.after_first_step = False
        wanted = self._wanted(engine)
        if wanted:
            devices = {device for *_, device, _ in wanted if device.type == "cuda"}
            self._thread = threading.Thread(target=self._pin, args=(wanted, devices.pop() if len(devices) == 1 else None),
                                            name="optstate-park-ahead", daemon=True)
            self._thread.start()
            log.debug("optstate: pinning %d park buffers ahead", len(wanted))
        if wait:
            self.join()

    def after_step(self, engine) -> None:
        """The end of a step: preparation asked before the first one starts now."""
        if self.after_first_step:
            self.prepare(engine)

    def _pin(self, wanted, device) -> None:
        t0 = time.perf_counter()
        try:
            if device is not None:
                torch.cuda.set_device(device)
            groups: Dict[tuple, list] = {}
            for slot, codec, shape, dtype, dev, pin in wanted:
                groups.setdefault((codec, dtype, dev, pin), []).append((slot, shape))
            made: Dict[Slot, EncodedTensor] = {}
            for (codec, dtype, dev, pin), items in groups.items():
                buffers = allocate_many(codec, [shape for _, shape in items], dtype, dev, True, pin, self.arena)
                made.update(zip([slot for slot, _ in items], buffers))
            self._made = made
        except BaseException as exc:  # noqa: BLE001 - the park allocates what is missing itself
            self._error = exc
        self.prepare_seconds = time.perf_counter() - t0

    def join(self) -> None:
        """Wait for the thread; take what it pinned."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._error is not None:
            log.warning("optstate: pinning the park buffers ahead failed (%s); the park pins them", self._error)
            self._error = None
        self.slots.update(self._made)
        self._made = {}

    # -- the park ------------------------------------------------------------------------------
    def destinations(self, slots: List[Slot], codec, shapes, dtype: torch.dtype, device: torch.device,
                     pin: bool) -> list:
        """Host storage for these states of one codec and dtype: the kept buffers that fit them,
        new ones (kept from now on) for the rest."""
        self.join()
        out = [b if _fits(b, codec, shape, dtype) else None for b, shape in zip(map(self.slots.get, slots), shapes)]
        missing = [i for i, b in enumerate(out) if b is None]
        if missing:
            made = allocate_many(codec, [shapes[i] for i in missing], dtype, device, True, pin, self.arena)
            for i, buffer in zip(missing, made):
                out[i] = self.slots[slots[i]] = buffer
        return out

    def report(self) -> dict:
        """``bytes``: the kept buffers' payload bytes; ``pinned_bytes``: what their arena pinned;
        ``prepare_seconds``: how long the last pinning ahead took on its thread (None: none ran)."""
        buffers = list(self.slots.values()) + list(self._made.values())
        return {"bytes": sum(map(state_nbytes, buffers)), "pinned_bytes": self.arena.bytes_allocated,
                "prepare_seconds": self.prepare_seconds}

    def close(self) -> None:
        """Drop every buffer (after the thread, if one runs)."""
        self.join()
        self.slots.clear()
        self.after_first_step = False
        self.arena.close()

    def __getstate__(self):
        """Copies and pickles keep no buffer (their state is its own) and no thread."""
        self.join()
        return {**self.__dict__, "slots": {}, "_made": {}, "_thread": None, "_error": None,
                "arena": PinnedArena(self.arena.slab_bytes, self.arena.pin)}
