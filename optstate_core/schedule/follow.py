"""State follows parameters that changed dtype or device after wrapping, or the step is refused.

Frameworks cast and move models after the optimizer exists (``model.double()``, precision
plugins, ``model.to("cuda")``); ``nn.Module`` swaps ``param.data`` in place, so the optimizer
still holds the same parameter objects, now with state of the old dtype or device. Before a step
(and before anything else changes) each such state is re-stored for the parameter as it is now, in
its own codec: a device-resident payload moves to the parameter's device, a host-tier payload stays
on the host, and only payload parts whose dtype depends on the state's dtype (the ``fp32`` codec's
data) are cast, like ``torch.optim.Optimizer.load_state_dict`` casts raw state. Integer codes and
scales are kept as they are, so following loses nothing. A parameter moved to the ``meta`` device
(no values) is refused with a ``ValueError`` naming it, before any state is touched.

A change is detected on the parameter itself: each planned step remembers every stepped
parameter's dtype and device (:func:`remember_params`), and the next planned step compares
(:func:`follow_params`). Both run only when the engine's cached plan misses; its signature holds
every parameter's dtype and device, so a cast or a move always misses it. The stored state's own dtype is no guide: the fused path keeps fp32 state
for bf16/fp16 parameters on purpose.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

from ..state.codecs import EncodedTensor
from ..state.dtensor import is_dtensor
from ..state.store import is_scalar_state
from ..step.work import describe_param

log = logging.getLogger("optstate")


def _forms(engine) -> Dict[torch.Tensor, Tuple[torch.dtype, torch.device]]:
    """Parameter -> (dtype, device) at its last step; keyed by the tensor like ``optimizer.state``,
    so it survives deepcopy and pickle along with the parameters."""
    return engine.param_forms


def remember_params(engine) -> None:
    """Record the dtype and device of every parameter that has state and no record yet."""
    forms = _forms(engine)
    for p in engine.state:
        if isinstance(p, torch.Tensor) and p not in forms and not is_dtensor(p):
            forms[p] = (p.dtype, p.device)


def changed_params(engine) -> List[tuple]:
    """``(param, info, (old dtype, old device))`` for every parameter with state whose dtype or
    device changed since its last step; descriptions are built only when something changed."""
    changed = {id(p): form for p, form in _forms(engine).items()
               if (p.dtype, p.device) != form and p in engine.state}
    if not changed:
        return []
    return [(p, info, changed[id(p)]) for p, info in engine.param_infos() if id(p) in changed]


def _refuse_if_impossible(changed) -> None:
    for p, info, (dtype, device) in changed:
        now = f"{p.dtype} on {p.device}"
        if p.device.type == "meta":
            raise ValueError(f"{describe_param(info)} moved to the meta device after wrapping (was {dtype} on "
                             f"{device}); its optimizer state cannot follow a parameter without values. Move the "
                             "model back before stepping, or build the optimizer after moving it")
        if p.dtype.is_floating_point != dtype.is_floating_point or p.dtype.is_complex != dtype.is_complex:
            raise ValueError(f"{describe_param(info)} changed from {dtype} on {device} to {now} after wrapping; "
                             "its optimizer state cannot follow that dtype")


def _moved(value, p: torch.Tensor, pin: bool):
    if isinstance(value, EncodedTensor):  # codes and scales as they are; a state of the new dtype
        layout = value.codec.payload_layout(*value.slab, p.dtype)
        where = torch.device("cpu") if value.host_tier else p.device
        payload = {k: t.to(device=where, dtype=layout[k][1]) for k, t in value.payload.items()}
        if value.host_tier and pin:  # host-tier state of a parameter now on CUDA streams from pinned memory
            payload = {k: t if t.is_pinned() else t.pin_memory() for k, t in payload.items()}
        return EncodedTensor(value.codec, payload, value.shape, p.dtype, value.host_tier)
    return value.to(device=p.device, dtype=p.dtype)


def follow_params(engine) -> None:
    """Re-store the state of parameters that changed dtype or device since their last step (all
    checked first: a refused step changes nothing)."""
    changed = changed_params(engine)
    if not changed:
        return
    _refuse_if_impossible(changed)
    engine.sync_transfers()
    for p, info, (dtype, device) in changed:
        st = engine.state[p]
        pin = engine.ctx.pins(p.device)
        for key, value in list(st.items()):
            if not is_scalar_state(value):
                st[key] = _moved(value, p, pin)
        _forms(engine)[p] = (p.dtype, p.device)
        log.info("optstate: %s changed from %s on %s to %s on %s after wrapping; its state follows",
                 describe_param(info), dtype, device, p.dtype, p.device)
    engine.invalidate_plan()
