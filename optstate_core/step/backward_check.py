"""The NaN/inf check of CUDA gradients, taken during backward on a side stream.

The step of uncompressed parameters (:mod:`~optstate_core.step.passthrough_skip`) needs to know whether
any gradient holds a NaN/inf (or a value >= ``GRAD_OVERFLOW``); reading every gradient once
more inside the step costs 4 of fused AdamW's 28 bytes per fp32 parameter. Instead, as soon as
backward has accumulated a gradient (the schedule's post-accumulate-grad hook), it is queued;
every ``FLUSH_BYTES`` of queued gradients (and once every watched one arrived) their largest
magnitudes are taken in one call on a side stream, beside the backward kernels still running;
the step then only waits for those results.

A result describes the gradient as the hook saw it, so the step uses it only while the gradient
is provably the same: the same tensor object, the same storage and the same version counter
(every in-place change bumps it: clipping, unscaling, ``zero_()``, an accumulating backward).
Everything else (a gradient no hook saw, one replaced or changed since) is checked in the step as
before. Not covered: writes through ``grad.data``, which torch does not count; documented in
README. Not used while torch.distributed runs several processes (DDP averages gradients in
place after the hook), on CPU (no stream to overlap with), nor in CUDA-graph capture (a replayed
step must check the gradients of its replay).
"""
from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Dict, List, Set, Tuple

import torch


_GRAD = attrgetter("grad")

#: gradients wait in a queue until this many bytes (or every watched gradient) arrived, then one
#: call takes their maxima: a hook then costs a list append, not a launch and a stream wait
FLUSH_BYTES = 128 * 2**20


class _Seen:
    """What the check saw of one gradient; its largest magnitude is ``maxima[index]``, the float32
    result of the call that took it with others."""

    __slots__ = ("grad", "version", "data_ptr", "maxima", "index")

    def __init__(self, grad: torch.Tensor, maxima: torch.Tensor, index: int):
        self.grad = weakref.ref(grad)
        self.version = grad._version
        self.data_ptr = grad.data_ptr()
        self.maxima, self.index = maxima, index

    def describes(self, grad: torch.Tensor) -> bool:
        return self.grad() is grad and grad._version == self.version and grad.data_ptr() == self.data_ptr


def _several_processes() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class BackwardCheck:
    """Largest gradient magnitudes taken in backward, per parameter; see the module doc."""

    def __init__(self):
        self._watched: Set[int] = set()  # ids of the parameters the current plan's passthrough call skips
        self._seen: Dict[int, _Seen] = {}
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}
        self._queued: Dict[tuple, list] = {}  # (device, dtype) -> [(param id, grad)] not yet taken
        self._queued_bytes = 0
        # (event, gradients) of each side-stream read not known to be done: a gradient freed
        # meanwhile (zero_grad) would be reused by the current stream, so it is held until its
        # read is done or the current stream waits for the side stream (not record_stream: it
        # leaves cross-stream events on the allocator's blocks)
        self._reading: List[tuple] = []
        self._arrived = 0  # gradients since every watched one last arrived
        self.used = 0  # gradients of the last step whose check came from backward

    @property
    def active(self) -> bool:
        return bool(self._watched)

    def watch(self, params) -> None:
        """Check these parameters' gradients in backward from now on (and no others)."""
        self._watched = {id(p) for p in params}

    def observe(self, param: torch.Tensor) -> None:
        """Hook body: queue ``param.grad``; take the queue's maxima once it is large enough or
        every watched gradient has arrived."""
        g = param.grad
        if id(param) not in self._watched or g is None or not g.is_cuda or g.layout != torch.strided \
                or not g.numel() or torch.cuda.is_current_stream_capturing():
            return
        self._queued.setdefault((g.device, g.dtype), []).append((id(param), g))
        self._queued_bytes += g.numel() * g.element_size()
        self._arrived += 1
        if self._arrived >= len(self._watched):
            self._arrived = 0
            self._take_queued()
        elif self._queued_bytes >= FLUSH_BYTES:
            self._take_queued()

    def _take_queued(self) -> None:
        """The queued gradients' maxima, on each device's side stream once the gradients are
        complete on the current stream; the versions are those of now, in stream order."""
        for (device, _), items in self._queued.items():
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            grads = [g for _, g in items]
            with torch.cuda.stream(side):
                maxima = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
            done = torch.cuda.Event()
            done.record(side)
            self._reading = [(e, gs) for e, gs in self._reading if not e.query()] + [(done, grads)]
            for i, (key, g) in enumerate(items):
                self._seen[key] = _Seen(g, maxima, i)
        self._queued.clear()
        self._queued_bytes = 0

    def split(self, params: List[torch.Tensor]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """``(1-D float32 tensors of the maxima taken in backward that still describe these
        parameters' gradients, gradients to check now)``; the current stream waits for the side
        streams. A call's maxima are used whole when all of them still hold (the usual case)."""
        if not self._watched and not self._reading:  # the default (check_in_backward=False): no per-parameter work
            self.used = 0
            return [], [g for g in map(_GRAD, params) if g is not None and g.numel()]
        capturing = bool(self._watched) and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self._queued and not capturing:
            self._take_queued()
        self._arrived = 0
        unknown = []
        valid: Dict[int, tuple] = {}  # id(maxima) -> (maxima, indices still valid)
        # a captured step is replayed after later backwards: it must check its gradients itself
        seen = self._seen if self._watched and not capturing and not _several_processes() else {}
        for p in params:
            g = p.grad
            if g is None or not g.numel():
                continue
            entry = seen.get(id(p))
            if entry is not None and entry.describes(g):
                valid.setdefault(id(entry.maxima), (entry.maxima, []))[1].append(entry.index)
            else:
                unknown.append(g)
        known = []
        for maxima, indices in valid.values():
            if len(indices) == maxima.numel():
                known.append(maxima)
            else:  # some gradients of that call changed since: views of the others (no index upload)
                known.append(torch.stack([maxima[i] for i in indices]))
        if (known or self._reading) and not capturing:  # (known is empty while capturing)
            for device, side in self._streams.items():
                torch.cuda.current_stream(device).wait_stream(side)
            self._reading = []
        self.used = sum(len(indices) for _, indices in valid.values())
        return known, unknown

    def __getstate__(self):
        """Copies and pickles keep nothing: no streams, no weak references; inactive until the
        copy's engine plans a step that uses it."""
        return {"_watched": set(), "_seen": {}, "_streams": {}, "_queued": {}, "_queued_bytes": 0, "_reading": [],
                "_arrived": 0, "used": 0}
