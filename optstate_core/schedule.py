"""The step schedule: when a training step's bytes move and its updates run, in three phases.

1. **Backward** (post-accumulate-grad hooks, on the micro-batch that ends an accumulation
   window): as a parameter's gradient becomes final, its offloaded state starts uploading into
   the staging ring (``prefetch_during_backward``), or the parameter is updated and its
   gradient freed at once (``release_gradients``, see :mod:`~optstate_core.release`).
2. **step()**: resident buckets update at once; streamed buckets go through the ring chunk by
   chunk (upload, fused update, write-back), prefetched ones first.
3. **Behind the next forward**: write-backs run on their own stream; the step returns without
   waiting, and the next step's uploads wait for them on the device (events only).

This room owns the copy streams, the staging ring, the events and the hooks. The engine asks it
to run a step's buckets; the kernels and codecs know nothing of it. On the CPU the same code runs
with plain copies and no streams, so the CPU tests exercise the ordering logic too.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional

from .codecs import EncodedTensor
from .transfer import StagingRing, Streams, coalesce_copies


class StepBoundary:
    """Whether the next backward ends in an optimizer step (set by integrations, or read from a
    bound callable such as Accelerate's ``sync_gradients``). Default: every backward steps."""

    def __init__(self):
        self.flag = True
        self.source = None

    def set(self, will_step: bool) -> None:
        self.flag = will_step

    @property
    def will_step(self) -> bool:
        return bool(self.source()) if self.source is not None else self.flag

    def __getstate__(self):
        return {"flag": self.flag, "source": None}


class StepSchedule:
    """The timetable of one training step for the engine's fused buckets (see the module doc)."""

    def __init__(self, engine):
        self.engine = engine
        self.boundary = StepBoundary()
        self._streams: Optional[Streams] = None
        self._ring: Optional[StagingRing] = None
        self.last_writeback = None  # event of the last queued write-back
        self.step_writeback = None  # the previous step's last write-back: this step's uploads wait on it
        self.prefetched: Dict[int, tuple] = {}  # id(param) -> (ring offset, staged state, upload event)
        self.prefetched_bytes = 0
        self._where: Dict[int, tuple] = {}
        self._hooks = []
        self.release = None  # GradientRelease (release.py) when gradients are released in backward

    # -- phase 1: backward ------------------------------------------------------------------------
    def register_hooks(self, params) -> None:
        """Post-accumulate-grad hooks that call :meth:`gradient_ready` (the schedule is held weakly)."""
        ref = weakref.ref(self)

        def hook(param):
            schedule = ref()
            if schedule is not None:
                schedule.gradient_ready(param)

        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def gradient_ready(self, param) -> None:
        """Backward hook body: prefetch offloaded state, or (on the step boundary) release the
        gradient: update the parameter now and free it (:mod:`~optstate_core.release`)."""
        if self.engine.prefetch_during_backward:
            self.prefetch(param)
        if self.release is not None and self.boundary.will_step:
            self.release(param)

    def prefetch(self, param) -> None:
        """Backward hook: start uploading this parameter's offloaded state (within half the ring)."""
        located = self._where.get(id(param))
        if located is None or id(param) in self.prefetched or not self.boundary.will_step:
            return
        bucket, i = located
        piece = (i, 0, bucket.rows[i])
        nbytes = bucket.piece_bytes(piece)
        device = param.device
        ring, streams = self.ring(device), self.streams(device)
        if self.prefetched_bytes + nbytes > ring.size // 2:
            return
        start = ring.reserve(nbytes, streams.h2d)
        staged = self._stage(bucket, [piece], start)
        streams.wait(streams.h2d, self.last_writeback)  # during backward: the last step's write-backs
        self.engine.transfers.h2d_bytes += self._transfer(bucket, [piece], staged, True, streams)
        self.prefetched[id(param)] = (start, staged[0], streams.event(streams.h2d))
        self.prefetched_bytes += nbytes

    def index_offloaded(self, buckets) -> None:
        """Where each streamed parameter sits in the cached plan (for the prefetch hooks)."""
        self._where = {id(k): (b, i) for b in buckets if b.plan["offload"] for i, k in enumerate(b.keys)}

    # -- phase 2: step() --------------------------------------------------------------------------
    def run(self, buckets) -> None:
        """The step() phase: launch resident buckets at once; stream the others through the ring,
        consuming what the backward phase prefetched first; queue each chunk's write-back."""
        kernels = self.engine.kernels
        streamed = [b for b in buckets if b.plan["offload"]]
        for b in buckets:
            if not b.plan["offload"]:
                kernels.launch(b)
        if not streamed:
            return
        ring = self.ring(streamed[0].params[0].device)
        # Uploads of this step must not read host rows the previous step is still writing back;
        # within a step chunks are disjoint, so uploads and write-backs overlap (PCIe duplex).
        self.step_writeback = self.last_writeback
        work = []
        for b in streamed:
            flags = kernels.new_flags(b)
            pre = [(i, 0, b.rows[i]) for i, k in enumerate(b.keys) if id(k) in self.prefetched]
            work.append((b, flags, pre))
        for b, flags, pre in work:
            if pre:
                self._stream_chunk(b, flags, pre, prefetched=True)
        for b, flags, pre in work:
            done = {i for i, _, _ in pre}
            rest = [i for i in range(len(b.params)) if i not in done]
            for chunk in b.chunks(rest, ring.size // 2):
                self._stream_chunk(b, flags, chunk, prefetched=False)
            kernels.advance_steps(b)
            kernels.count_skipped(flags)
            b.first = False
            self.engine.metrics.fused_params += len(b.params)
        self.prefetched_bytes = 0
        ring.head = 0  # the same offsets every step: pointer tables stay cached

    def _stream_chunk(self, bucket, flags, pieces, prefetched: bool) -> None:
        device = bucket.params[0].device
        ring, streams, transfers = self.ring(device), self.streams(device), self.engine.transfers
        if prefetched:
            regions, staged = [], []
            for i, _, _ in pieces:
                start, values, ev_up = self.prefetched.pop(id(bucket.keys[i]))
                streams.wait(None, ev_up)
                regions.append(start)
                staged.append(values)
        else:
            start = ring.reserve(sum(bucket.piece_bytes(pc) for pc in pieces), streams.h2d)
            regions, staged = [start], self._stage(bucket, pieces, start)
            if not bucket.first:
                streams.wait(streams.h2d, self.step_writeback)
                transfers.h2d_bytes += self._transfer(bucket, pieces, staged, True, streams)
            streams.wait(None, streams.event(streams.h2d))
        self.engine.kernels.launch(bucket.sub(pieces, staged), flags=flags, advance=False)
        streams.wait(streams.d2h, streams.event(None))
        transfers.d2h_bytes += self._transfer(bucket, pieces, staged, False, streams)
        done = streams.event(streams.d2h)
        for start in regions:
            ring.release(start, done)
        self.last_writeback = done

    # -- phase 3: behind the next forward; streams and the ring ---------------------------------------
    def streams(self, device) -> Streams:
        if self._streams is None or self._streams.device != device:
            self._streams = Streams(device)
        return self._streams

    def ring(self, device) -> StagingRing:
        if self._ring is None:
            self._ring = StagingRing(self.engine.placement.staging_size(device), device, self.streams(device))
        return self._ring

    def sync(self) -> None:
        """Wait for queued write-backs (before the host payloads are read, replaced or freed)."""
        if self.last_writeback is not None:
            self.last_writeback.synchronize()
            self.last_writeback = self.step_writeback = None

    def close(self) -> None:
        """Wait for write-backs, drop the staging ring and the streams, remove the hooks."""
        self.sync()
        self._ring = None
        self._streams = None
        self.prefetched.clear()
        self.remove_hooks()

    def _stage(self, bucket, pieces, start):
        """Device views (in the ring, from ``start``) for the state rows of ``pieces``, laid out
        per (state, payload) in piece order with 16-byte padding, like the host arena, so that
        adjacent host rows map to adjacent ring bytes and copy as one range."""
        staged = [[dict() for _ in bucket.storages[i]] for i, _, _ in pieces]
        off = start
        for k, enc0 in enumerate(bucket.storages[pieces[0][0]]):
            for name in enc0.payload:
                for (i, r0, r1), views in zip(pieces, staged):
                    rows = bucket.storages[i][k].payload[name][r0:r1]
                    n = rows.numel() * rows.element_size()
                    views[k][name] = self._ring.view(off, n, rows.dtype, rows.shape)
                    off += -(-n // 16) * 16
        return [[EncodedTensor(enc.codec, views[k], (r1 - r0, bucket.cols[i]), enc.dtype)
                 for k, enc in enumerate(bucket.storages[i])] for (i, r0, r1), views in zip(pieces, staged)]

    def _transfer(self, bucket, pieces, staged, upload: bool, streams) -> int:
        """Copy the state rows of ``pieces`` between host memory and their staged views, one copy
        per run of adjacent rows (the host arena and the ring share one layout)."""
        pairs = []  # (host tensor, ring tensor) per piece, state and payload, in ring order
        for k, enc0 in enumerate(bucket.storages[pieces[0][0]]):
            for name in enc0.payload:
                for (i, r0, r1), values in zip(pieces, staged):
                    pairs.append((bucket.storages[i][k].payload[name][r0:r1], values[k].payload[name]))
        moved = 0
        with streams.on(streams.h2d if upload else streams.d2h):
            for host, ring in coalesce_copies(pairs):
                (ring.copy_(host, non_blocking=True) if upload else host.copy_(ring, non_blocking=True))
                moved += host.numel()
        return moved

    def __getstate__(self):
        """Copies and pickles keep the timetable, not streams, ring, events or hooks (re-made lazily)."""
        self.sync()
        state = dict(self.__dict__)
        state.update(_streams=None, _ring=None, last_writeback=None, step_writeback=None, prefetched={},
                     prefetched_bytes=0, _where={}, _hooks=[])
        return state
