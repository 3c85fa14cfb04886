"""The prefetch area: device memory that offloaded state uploads into during backward, and its budget.

On the micro-batch that ends an accumulation window, each parameter's post-accumulate-grad hook
may stage that parameter's encoded state on the device (:meth:`StepSchedule.prefetch
<optstate_core.schedule.timetable.StepSchedule.prefetch>`). Parameters are queued per bucket and uploaded
in **slabs**: when a bucket's queued state reaches ``tuning.prefetch_slab_bytes`` (or its last
parameter's gradient has arrived), one allocation from the caching allocator, made on the compute stream
during backward (so it reuses memory that backward has just freed), receives them in a few long
copies (:class:`~optstate_core.schedule.stage_plan.SlabPlan`). A slab is handed back after the step's
write-back of it has been queued (``record_stream`` on the write-back stream, then the reference
is dropped), so the next forward can use that memory again.

The **budget** bounds the bytes staged at once:

* an int (bytes, or a string such as ``"2GB"``): at most that many;
* ``0``: no backward-time uploads (everything streams through the staging ring in ``step()``);
* ``"auto"`` (the optimizer's default is off, ``prefetch_budget=None``): on CUDA, measured on
  the first boundary backward that runs with
  offloaded state: :data:`AUTO_FRACTION` of the memory backward frees, i.e. the allocated bytes
  at its first gradient hook (activations still alive, about the forward peak) minus those at the
  end of ``step()`` (gradients alive, activations gone). Staged state then takes memory the activations have left, so
  the peak stays at the forward's. Until that measurement only the ring is used. On the CPU
  (no device memory to protect) ``"auto"`` stages everything, so the CPU tests run this path.

A staged copy is a byte-exact copy of the host state, valid until that state changes; the
schedule consumes it in ``step()`` or discards it (end of a step that did not use it,
``zero_grad``, checkpoints, ``offload()``/``reload()``, loading state: every host-state reader
or writer syncs first).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch

from ..state.units import parse_bytes

AUTO = "auto"
AUTO_FRACTION = 0.9  # of the memory the first measured backward freed
PHASES = ("backward", "step", "behind_forward")


# bytes of queued state that start a slab upload: large enough that a step makes few allocations
# and copy calls (a 0.95B model's int8 state: ~30 slabs), small enough that uploads start early
# (the default of ``tuning.prefetch_slab_bytes``, ``OPTSTATE_SLAB_MB``)
SLAB_BYTES = 64 << 20


def check_prefetch_budget(value, arg: str = "prefetch_budget") -> Union[int, str]:
    """``"auto"``, ``0`` (off) or a positive byte count (int or string such as ``"512MB"``)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    try:
        return parse_bytes(value, arg)
    except ValueError:
        raise ValueError(f"{arg} must be 'auto', 0 (off) or a byte count such as 536870912 or '512MB', "
                         f"got {value!r}") from None


class Slab:
    """One upload of several parameters' state: its device allocation, its
    :class:`~optstate_core.schedule.stage_plan.SlabPlan` (layout and merged copy ranges) and the
    event that marks its copy done (None on the CPU)."""

    __slots__ = ("buffer", "plan", "ready")

    def __init__(self, buffer, plan, ready=None):
        self.buffer, self.plan, self.ready = buffer, plan, ready


class Staged:
    """One parameter's staged state: its slab, its piece position there, and the host payloads
    it copies (to check they are still the parameter's state)."""

    __slots__ = ("slab", "piece", "sources")

    def __init__(self, slab: Slab, piece: int, sources):
        self.slab, self.piece, self.sources = slab, piece, sources

    def matches(self, storages) -> bool:
        return len(storages) == len(self.sources) and all(a is b for a, b in zip(storages, self.sources))


class Queued:
    """A bucket's parameters admitted to the area whose upload has not started: (index, key)
    pairs and their bytes; and how many of the bucket's parameters reached their hook."""

    __slots__ = ("bucket", "items", "nbytes", "arrived")

    def __init__(self, bucket):
        self.bucket, self.items, self.nbytes, self.arrived = bucket, [], 0, 0


class PrefetchArea:
    """The staged copies of one window, the budget, and the per-phase byte and time counters."""

    def __init__(self, budget: Union[int, str] = AUTO):
        self.budget = budget
        self.entries: Dict[int, Staged] = {}  # id(param) -> staged state
        self.queued: Dict[int, Queued] = {}  # id(bucket) -> parameters waiting for their slab
        self.queued_keys = set()  # id(param) of every queued parameter
        self.used = 0  # bytes staged or queued now
        self.measured: Optional[int] = None  # "auto" on CUDA: the derived byte budget
        self._probe: Optional[int] = None  # allocated bytes at this backward's first hook
        self.window_bytes = 0  # bytes uploaded by hooks since the last step
        self.last = {"used_bytes": 0, "bytes": dict.fromkeys(PHASES, 0)}
        self._events = {}  # (first upload start, last upload end, first write-back start, last write-back end)
        self._last_events = {}

    @property
    def enabled(self) -> bool:
        return self.budget != 0

    def limit(self, device) -> Optional[int]:
        """Bytes that may be staged at once now (None: no limit)."""
        if self.budget != AUTO:
            return self.budget
        if device.type != "cuda":
            return None
        return self.measured or 0

    def observe_hook(self, device) -> None:
        """First hook of a boundary backward under ``"auto"`` on CUDA: note the allocated bytes."""
        if self.budget == AUTO and self.measured is None and self._probe is None and device.type == "cuda":
            self._probe = torch.cuda.memory_allocated(device)

    def observe_step(self, device) -> None:
        """``step()`` after a probed backward: derive the auto budget from the memory backward freed."""
        if self._probe is not None and device.type == "cuda":
            freed = self._probe - torch.cuda.memory_allocated(device)
            self.measured = max(0, int(freed * AUTO_FRACTION))
        self._probe = None

    def admits(self, nbytes: int, device) -> bool:
        limit = self.limit(device)
        return limit is None or self.used + nbytes <= limit

    def arrive(self, bucket) -> Queued:
        """A parameter of ``bucket`` reached its hook: its bucket's queue (created on first use)."""
        queue = self.queued.get(id(bucket))
        if queue is None:
            queue = self.queued[id(bucket)] = Queued(bucket)
        queue.arrived += 1
        return queue

    def enqueue(self, queue: Queued, i: int, key: int, nbytes: int) -> None:
        """Admit parameter ``i`` (``key`` = id of the parameter) for the bucket's next slab."""
        queue.items.append((i, key))
        queue.nbytes += nbytes
        self.queued_keys.add(key)
        self.used += nbytes

    def holds(self, key: int) -> bool:
        """Whether this parameter is staged or queued in this window."""
        return key in self.entries or key in self.queued_keys

    def staged(self, slab: Slab, keys: List[int], backward: bool) -> None:
        """A slab's upload was queued: its parameters (``keys``, in the plan's index order) are
        staged; its bytes count for the backward phase unless uploaded from ``step()``."""
        for j, key in enumerate(keys):
            self.entries[key] = Staged(slab, j, slab.plan.layout.sources[j])
            self.queued_keys.discard(key)
        if backward:
            self.window_bytes += slab.plan.moved

    def take(self, key: int) -> Staged:
        return self.entries.pop(key)

    def mark(self, which: str, make_event) -> None:
        """Timing events (CUDA only): the first start and the latest end of each phase's copies
        (``make_event()`` records one; called only when needed)."""
        if which.endswith("start") and which in self._events:
            return
        event = make_event()
        if event is not None:
            self._events[which] = event

    def drop(self) -> None:
        """Discard every staged copy and queue (the host state is unchanged; the memory returns
        to the allocator once the uploads into it have finished, see ``record_stream``)."""
        self.entries.clear()
        self.queued.clear()
        self.queued_keys.clear()
        self.used = 0
        self.window_bytes = 0
        self._probe = None
        self._events = {}

    def end_step(self, step_h2d: int, d2h: int) -> int:
        """Close a step's window: record its counters, discard what it did not consume; returns
        the bytes uploaded during backward."""
        backward = self.window_bytes
        self.last = {"used_bytes": self.used, "bytes": {"backward": backward, "step": step_h2d,
                                                        "behind_forward": d2h}}
        self._last_events = self._events
        self.drop()
        return backward

    def __getstate__(self):
        """Copies and pickles keep the budget and its measurement, not staged copies or events."""
        state = dict(self.__dict__)
        state.update(entries={}, queued={}, queued_keys=set(), used=0, _probe=None, window_bytes=0, _events={},
                     _last_events={})
        return state

    def report(self) -> dict:
        """For ``memory_report()["prefetch"]``: budget, bytes staged in the last step, bytes moved
        per phase, and (CUDA) the copy time spans that ran beside compute."""
        budget = self.budget if self.budget != AUTO else (self.measured if self.measured is not None else "auto")
        out = {"enabled": self.enabled, "budget": self.budget, "budget_bytes": budget,
               "used_bytes_last_step": self.last["used_bytes"], "bytes_by_phase": dict(self.last["bytes"]),
               "backward_upload_ms": None, "writeback_ms": None}
        ev = self._last_events
        for name, (a, b) in (("backward_upload_ms", ("upload_start", "upload_end")),
                             ("writeback_ms", ("writeback_start", "writeback_end"))):
            if a in ev and b in ev:
                ev[b].synchronize()
                out[name] = ev[a].elapsed_time(ev[b])
        out["hidden_ms"] = None if out["backward_upload_ms"] is None else \
            out["backward_upload_ms"] + (out["writeback_ms"] or 0.0)
        return out
