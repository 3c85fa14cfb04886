"""The step schedule: when a training step's bytes move and its updates run, in three phases.

1. **Backward** (post-accumulate-grad hooks, on the micro-batch that ends an accumulation
   window): as a parameter's gradient becomes final, its offloaded state starts uploading, in
   gradient-arrival order, into the prefetch area (memory backward has just freed, within a
   byte budget: :mod:`~optstate_core.schedule.prefetch`), or the parameter is updated and its gradient
   freed at once (``release_gradients``, see :mod:`~optstate_core.schedule.release`); then the
   host state of the batches expected next uploads into slabs ahead of their update
   (:meth:`StepSchedule.stage`), and at the end of a step the next step's first batches, behind
   the next forward.
2. **step()**: resident buckets, then the prefetched parameters of streamed buckets, update at
   once, each write-back queued right after its update; the rest streams through the staging
   ring chunk by chunk (upload, fused update, write-back).
3. **Behind the next forward**: write-backs run on their own stream; the step returns without
   waiting, and the next window's uploads wait for them on the device (events only).

This room owns the copy streams, the staging ring, the events and the hooks; the prefetch
area's bookkeeping (budget, staged copies, counters) is :class:`~optstate_core.schedule.prefetch.PrefetchArea`. The engine asks it
to run a step's buckets; the kernels and codecs know nothing of it. On the CPU the same code runs
with plain copies and no streams, so the CPU tests exercise the ordering logic too.
"""
from __future__ import annotations

import logging
import weakref
from typing import Dict, Optional

import torch

from . import prefetch as prefetch_area
from .prefetch import AUTO, PrefetchArea, Slab
from .stage_plan import param_bytes, ring_chunks, slab_plan, staged_launch
from .transfer import StagingRing, Streams

log = logging.getLogger("optstate")


class StepBoundary:
    """Whether the next backward ends in an optimizer step (set by integrations, or read from a
    bound callable such as Accelerate's ``sync_gradients``). Default: every backward steps."""

    def __init__(self):
        self.flag = True
        self.source = None
        self.marked = False  # set() was called: someone tells us where windows end

    def set(self, will_step: bool) -> None:
        self.flag = will_step
        self.marked = True

    @property
    def known(self) -> bool:
        """Whether window ends are reported (by set() or a bound source), not assumed."""
        return self.marked or self.source is not None

    @property
    def will_step(self) -> bool:
        return bool(self.source()) if self.source is not None else self.flag

    def __getstate__(self):
        return {"flag": self.flag, "source": None, "marked": self.marked}


class StepSchedule:
    """The timetable of one training step for the engine's fused buckets (see the module doc)."""

    def __init__(self, engine, prefetch_budget=AUTO, slab_bytes: int = prefetch_area.SLAB_BYTES):
        self.engine = engine
        self.area = PrefetchArea(prefetch_budget)
        self.slab_bytes = slab_bytes  # queued bytes that start a slab upload (tuning.prefetch_slab_bytes)
        self.boundary = StepBoundary()
        self._streams: Optional[Streams] = None
        self._ring: Optional[StagingRing] = None
        self.last_writeback = None  # event of the last queued write-back
        self.step_writeback = None  # the previous step's last write-back: this step's uploads wait on it
        self._h2d_after = None  # the write-back event the upload stream already waits on
        self._where: Dict[int, tuple] = {}
        self._hooks = []
        self._hooked = set()  # ids of parameters with a hook
        self.unmarked_accumulation = False  # a window of several backwards that nobody marked was seen
        self.release = None  # ClipAndRelease (release.py) when gradients are released in backward
        self._written: Dict[int, tuple] = {}  # id(streamed bucket) -> (step count, event) of its last write-back
        self.staged_ahead = False  # release staged the next step's first batch: zero_grad keeps it

    # -- phase 1: backward ------------------------------------------------------------------------
    def register_hooks(self, params) -> None:
        """Post-accumulate-grad hooks that call :meth:`gradient_ready` (the schedule is held weakly)."""
        ref = weakref.ref(self)

        def hook(param):
            schedule = ref()
            if schedule is not None:
                schedule.gradient_ready(param)

        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._hooked.clear()

    @property
    def prefetched(self) -> dict:
        """id(param) -> its staged state (:class:`~optstate_core.schedule.prefetch.Staged`), this window."""
        return self.area.entries

    def gradient_ready(self, param) -> None:
        """Backward hook body: check the gradient for NaN/inf (:mod:`~optstate_core.step.backward_check`),
        prefetch offloaded state, or (on the step boundary) release the gradient: update the
        parameter now and free it (:mod:`~optstate_core.schedule.release`)."""
        self.engine.backward_check.observe(param)
        if self.area.enabled:
            self.prefetch(param)
        if self.release is not None and self.boundary.will_step:
            self.release(param)

    def prefetch(self, param) -> None:
        """Backward hook: admit this parameter's offloaded state to the prefetch area if the
        budget has room, queued for its bucket's next slab; upload the slab once it holds
        ``self.slab_bytes`` bytes or the bucket's last gradient has arrived."""
        located = self._where.get(id(param))
        if located is None or not self.boundary.will_step:
            return
        area, device = self.area, param.device
        if area.holds(id(param)):
            if not self.boundary.known:  # a second backward before the step, and no boundary marks
                self._stop_unmarked()
            return
        if self.unmarked_accumulation and not self.boundary.known:
            return
        area.observe_hook(device)
        bucket, i = located
        queue = area.arrive(bucket)
        nbytes = param_bytes(bucket, i)
        if area.admits(nbytes, device):
            area.enqueue(queue, i, id(param), nbytes)
        if queue.items and (queue.nbytes >= self.slab_bytes or queue.arrived >= len(bucket.keys)):
            self._upload_slab(queue, backward=True)

    def _upload_slab(self, queue, backward: bool) -> None:
        """Upload a bucket's queued parameters as one slab (after every queued write-back)."""
        bucket, items = queue.bucket, queue.items
        queue.items, queue.nbytes = [], 0
        self._upload(bucket, items, backward, after=None)

    def _upload(self, bucket, items, backward: bool, after) -> None:
        """Upload parameters ``items`` (``(index, key)``) of ``bucket`` as one slab: one allocation
        on the compute stream (the upload waits for it and for the write-back event ``after``, or
        every queued write-back when None, on the device), one copy call of merged ranges
        (:class:`~optstate_core.schedule.stage_plan.SlabPlan`, cached)."""
        plan = slab_plan(bucket, [i for i, _ in items])
        key_of = dict(items)
        device = bucket.params[0].device
        streams = self.streams(device)
        buffer = torch.empty(plan.layout.nbytes, dtype=torch.uint8, device=device)  # on the compute stream
        hosts, views, _ = plan.copies(buffer)
        streams.wait(streams.h2d, streams.event(None))  # the block may be memory backward kernels still use
        if after is None:
            self._uploads_after(streams, self.last_writeback)  # the host rows the last step is writing back
        else:
            streams.wait(streams.h2d, after)
        self.area.mark("upload_start", lambda: streams.event(streams.h2d))
        with streams.on(streams.h2d):
            torch._foreach_copy_(views, hosts, non_blocking=True)
        if streams.cuda:
            buffer.record_stream(streams.h2d)
        if not backward:
            self.engine.transfers.h2d_bytes += plan.moved
        self.area.staged(Slab(buffer, plan, streams.event(streams.h2d)), [key_of[i] for i in plan.indices], backward)

    def stage(self, buckets) -> bool:
        """Gradient release: upload the offloaded state of a released batch's kept ``buckets`` now,
        ahead of the batch (the previous step's order predicts it; see
        :meth:`~optstate_core.schedule.release.ClipAndRelease.flush`), so that its update finds the
        state on the device instead of streaming it through the ring while backward waits. Only
        buckets last run in the previous step are staged: each slab's upload waits for that run's
        write-back (events only), the last write of those host rows, and nothing updated since
        (one update per parameter per step). :meth:`run` consumes the copies. Returns whether
        anything was staged."""
        staged = False
        for b in buckets:
            written = self._written.get(id(b)) if b.plan.offload else None
            if written is None or written[0] != self.engine.step_count - 1:
                continue
            items = [(i, id(k)) for i, k in enumerate(b.keys) if id(k) not in self.area.entries]
            if items:
                self._upload(b, items, backward=True, after=written[1])
                staged = True
        return staged

    def index_offloaded(self, buckets) -> None:
        """Where each streamed parameter sits in the cached plan (for the prefetch hooks); the
        hooks are registered the first time offloaded state is planned."""
        self._where = {id(k): (b, i) for b in buckets if b.plan.offload for i, k in enumerate(b.keys)}
        if self._where and self.area.enabled:
            self.register_hooks(p for g in self.engine.inner.param_groups for p in g["params"])

    def _stop_unmarked(self) -> None:
        """Gradient accumulation without boundary marks: staged state would sit on the device
        through the window's later forwards, so backward-time uploads stop until marks come."""
        self.area.drop()
        self.unmarked_accumulation = True
        log.info("optstate: gradient accumulation without set_step_boundary(): offloaded state now uploads in "
                 "step() only; mark the last micro-batch of each window (integrations do) to upload it in backward")

    def drop_prefetch(self) -> None:
        """Discard staged copies (zero_grad without a step, checkpoints, state moves): the host
        state is the truth and stays unchanged."""
        self.staged_ahead = False
        if self.area.entries or self.area.queued:
            self.area.drop()

    def zero_grad(self) -> None:
        """``zero_grad()``: staged copies of a backward without a step are dropped; the first batch
        that gradient release staged at the end of the step (for the next backward) is kept."""
        if not self.staged_ahead:
            self.drop_prefetch()
        if self.release is not None:
            self.release.new_window()

    def end_step(self, metrics, transfers) -> None:
        """After a step: per-phase byte counts into the metrics; copies not consumed discarded."""
        device = next(iter(self._where.values()))[0].params[0].device if self._where else None
        if device is not None:
            self.area.observe_step(device)
        backward = self.area.end_step(transfers.h2d_bytes, transfers.d2h_bytes)
        metrics.h2d_bytes = transfers.h2d_bytes + backward
        metrics.d2h_bytes = transfers.d2h_bytes
        transfers.reset()  # the next step counts from here: gradient release moves bytes in backward
        self.step_writeback = self.last_writeback  # the next step's uploads wait for this step's write-backs

    # -- phase 2: step() --------------------------------------------------------------------------
    def run(self, buckets) -> None:
        """The step() phase: launch resident buckets at once; stream the others through the ring,
        consuming what the backward phase prefetched first; queue each chunk's write-back."""
        kernels = self.engine.kernels
        streamed = [b for b in buckets if b.plan.offload]
        for b in buckets:
            if not b.plan.offload:
                kernels.launch(b)
        if not streamed:
            return
        device = streamed[0].params[0].device
        ring, streams = self.ring(device), self.streams(device)
        for queue in list(self.area.queued.values()):  # admitted, but their slab never filled in backward
            if queue.items:
                self._upload_slab(queue, backward=False)
        # Uploads of this step wait for the previous step's write-backs (step_writeback, set by
        # end_step): within a step chunks are disjoint, so uploads and write-backs overlap (PCIe
        # duplex), also across the per-parameter runs of gradient release.
        work = []
        ready = {}  # id(slab) -> its copy's event, for the slabs holding this step's staged state
        for b in streamed:
            flags = kernels.new_flags(b)
            pre = []
            if self.area.entries:  # nothing staged (prefetch off): no per-parameter lookups
                for i in range(len(b.keys)):
                    entry = self._staged_entry(b, i)
                    if entry is not None:
                        pre.append(i)
                        ready[id(entry.slab)] = entry.slab.ready
            work.append((b, flags, pre))
        if ready:  # the updates wait for their own slabs' copies, not for later uploads already
            # queued on the stream (gradient release stages batches ahead)
            for event in ready.values():
                streams.wait(None, event)
            self.area.mark("upload_end", lambda: streams.event(streams.h2d))
        for b, flags, pre in work:
            if pre:
                self._launch_prefetched(b, flags, pre)
        for b, flags, pre in work:
            done = set(pre)
            rest = [i for i in range(len(b.params)) if i not in done] if done else list(range(len(b.params)))
            for chunk in ring_chunks(b, rest, ring.size // 2):
                self._stream_chunk(b, flags, chunk)
            self._written[id(b)] = (self.engine.step_count, self.last_writeback)
            kernels.advance_steps(b)
            kernels.count_skipped(flags)
            b.first = False
            self.engine.metrics.fused_params += len(b.params)
        ring.head = 0  # the same offsets every step: chunk plans and pointer tables stay cached

    def _launch_prefetched(self, bucket, flags, indices) -> None:
        """Update the parameters whose state backward staged (one launch, pointers = their slab's
        address + cached offsets), then queue their write-back (one copy call: a slab taken whole
        writes back its merged ranges, a partly taken one its parameters' own)."""
        device = bucket.params[0].device
        streams = self.streams(device)
        taken = [self.area.take(id(bucket.keys[i])) for i in indices]
        self.engine.kernels.launch(staged_launch(bucket, indices, taken), flags=flags, advance=False)
        slabs: Dict[int, list] = {}
        for entry in taken:
            slabs.setdefault(id(entry.slab), [entry.slab, []])[1].append(entry.piece)
        hosts, views, moved = [], [], 0
        for slab, pieces in slabs.values():
            h, v, n = slab.plan.copies(slab.buffer, None if len(pieces) == len(slab.plan.indices) else pieces)
            hosts += h
            views += v
            moved += n
        self._write_back(streams, hosts, views, moved)
        if streams.cuda:  # the slabs go back to the allocator once written back
            for slab, _ in slabs.values():
                slab.buffer.record_stream(streams.d2h)

    def _stream_chunk(self, bucket, flags, chunk) -> None:
        """One ring chunk (:class:`~optstate_core.schedule.stage_plan.ChunkPlan`): upload, update, write-back."""
        device = bucket.params[0].device
        ring, streams, transfers = self.ring(device), self.streams(device), self.engine.transfers
        start = ring.reserve(chunk.layout.nbytes, streams.h2d)
        chunk.place(bucket, ring.buffer, start)
        # a first step writes fresh moments without reading them, but reads the correction
        # (cast_model's remainder) of a master-weight parameter
        pairs, moved = chunk.uploads(bucket)
        if pairs:
            self._uploads_after(streams, self.step_writeback)
            with streams.on(streams.h2d):
                for host, staged in pairs:
                    staged.copy_(host, non_blocking=True)
            transfers.h2d_bytes += moved
        streams.wait(None, streams.event(streams.h2d))
        self.engine.kernels.launch(chunk.launch_bucket(bucket), flags=flags, advance=False)
        ring.release(start, self._write_back(streams, [h for h, _ in chunk.pairs], [s for _, s in chunk.pairs],
                                             chunk.moved))

    def _write_back(self, streams, hosts, staged, nbytes: int):
        """Queue the copies of updated ``staged`` state back to its ``hosts`` rows on the write-back
        stream, after the update (events only); returns the event that marks them done."""
        streams.wait(streams.d2h, streams.event(None))
        self.area.mark("writeback_start", lambda: streams.event(streams.d2h))
        if hosts:
            with streams.on(streams.d2h):
                torch._foreach_copy_(hosts, staged, non_blocking=True)
        self.engine.transfers.d2h_bytes += nbytes
        done = streams.event(streams.d2h)
        self.area.mark("writeback_end", lambda: done)
        self.last_writeback = done
        return done

    def _uploads_after(self, streams, event) -> None:
        """The upload stream waits for ``event`` (write-backs of host rows it will read), once per
        event: everything queued on that stream later is ordered after the wait."""
        if event is not None and self._h2d_after is not event:
            streams.wait(streams.h2d, event)
            self._h2d_after = event

    def _staged_entry(self, bucket, i):
        """The staged copy of parameter ``i`` of ``bucket``'s current state, else None (a copy of
        state objects since replaced is discarded)."""
        entry = self.area.entries.get(id(bucket.keys[i]))
        if entry is not None and not entry.matches(bucket.storages[i]):
            del self.area.entries[id(bucket.keys[i])]
            return None
        return entry

    # -- phase 3: behind the next forward; streams and the ring ---------------------------------------
    def streams(self, device) -> Streams:
        if self._streams is None or self._streams.device != device:
            self._streams = Streams(device)
            self._h2d_after = None  # a new upload stream has waited for nothing
        return self._streams

    def ring(self, device) -> StagingRing:
        if self._ring is None:
            self._ring = StagingRing(self.engine.placement.staging_size(device), device, self.streams(device))
        return self._ring

    def sync(self) -> None:
        """Wait for queued write-backs (before the host payloads are read, replaced or freed);
        staged copies are dropped (whoever syncs may change the host state)."""
        self.drop_prefetch()
        if self.last_writeback is not None:
            self.last_writeback.synchronize()
            self.last_writeback = self.step_writeback = None
        self._written.clear()  # every write-back is done, and whoever synced may change the host state

    def drop_device_buffers(self) -> None:
        """Wait for write-backs, then drop the staging ring and the staged copies (a park: their
        device memory returns to the allocator; both are made again when state next streams)."""
        self.sync()
        self._ring = None
        self.area.drop()

    def close(self) -> None:
        """Wait for write-backs, drop the staging ring and the streams, remove the hooks."""
        self.drop_device_buffers()
        self._streams = None
        self.remove_hooks()

    def __getstate__(self):
        """Copies and pickles keep the timetable, not streams, ring, events or hooks (re-made lazily)."""
        self.sync()
        state = dict(self.__dict__)
        state.update(_streams=None, _ring=None, last_writeback=None, step_writeback=None, _where={}, _hooks=[],
                     _hooked=set(), _h2d_after=None, _written={}, staged_ahead=False)
        return state
