"""Pin the first step's offloaded state ahead: its sizes predicted at wrap(), pinned on a thread.

An offloaded preset pins all its host-tier state in the first step (12.7 GiB for Llama-3-8B under
a 24 GB cap: 2.3-3.9 s of that step, docs/benchmarks-journal.md section 30). The sizes are known before it:
each parameter's plan on the fused path (its codecs, and which of its states live on the host
under the GPU budget) gives the pinned arena's requests. So wrap() starts a thread that pins them
in the order backward asks for them (the parameters in reverse), and the first step takes them as
they come (:class:`~optstate_core.state.pinned.PinAhead`); whatever it did not ask for is dropped
when it ends. ``tuning.pin_ahead=False`` (``OPTSTATE_PIN_AHEAD=0``) turns this off.
"""
from __future__ import annotations

import logging
import math
from typing import List

from ..state.dtensor import is_dtensor
from ..state.pinned import padded_bytes
from ..state.store import payload_layout_of
from ..step.fused import first_step_states
from ..step.work import Work

log = logging.getLogger("optstate")

def first_step_requests(engine) -> List[int]:
    """The byte sizes of the allocations the first step will make in the engine's pinned arena (its
    requests, parameters in reverse order as backward asks: one allocation each, or the arena's
    slabs when shared). Empty once any state exists, under a GPU budget given as a fraction (it is
    resolved against the free memory of the first step), or for DTensors."""
    placement = engine.placement
    if engine.step_count or len(engine.state) or isinstance(placement.gpu_budget, float):
        return []
    infos = list(engine.param_infos())
    if any(is_dtensor(p) for p, _ in infos):
        return []
    release = engine.clip_release.release
    works = []
    for p, info in infos:
        w = Work(p, info, {})
        w.grad = w.param  # a stand-in of the gradient's dtype, shape and layout: read, never written
        works.append(w)
    saved = placement.resident
    try:
        if placement.gpu_budget is not None and saved is None:  # as the first step assigns it
            placement.assign_residency(works if release else [w for w in works if w.key.requires_grad],
                                       engine.step_count)
        with engine.fused.quiet():
            plans = [(w, engine.fused.plan(w)) for w in works if w.key.requires_grad]
    finally:
        placement.resident = saved
    requests = []
    for w, plan in reversed(plans):
        if plan is None or not plan.first or not engine.ctx.pins(w.param.device):
            continue
        for _, codec, dtype, on_host in first_step_states(plan, w.param.dtype):
            if on_host:
                requests += [(padded_bytes(math.prod(shape), pdtype), pdtype)
                             for shape, pdtype, _ in payload_layout_of(codec, w.param.shape, dtype).values()]
    return engine.pinned.allocations(requests)


def start(engine) -> None:
    """At wrap(): pin the first step's requests on a thread, when there are any (and ``tuning.pin_ahead``)."""
    if not engine.options.tuning.pin_ahead:
        return
    sizes = first_step_requests(engine)
    if sizes:
        devices = {p.device for p, _ in engine.param_infos() if p.device.type == "cuda"}
        engine.pinned.pin_ahead(sizes, devices.pop() if len(devices) == 1 else None)
        log.debug("pinning %d allocations (%.2f GiB) of offloaded state ahead of the first step", len(sizes),
                  sum(sizes) / 2**30)

