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
"""
from __future__ import annotations

import logging
from typing import List, Tuple

import torch

from .codecs import EncodedTensor
from .dtensor import is_dtensor
from .store import is_scalar_state
from .work import describe_param

log = logging.getLogger("optstate")


def _stored_form(value) -> Tuple[torch.dtype, torch.device, bool]:
    if isinstance(value, EncodedTensor):
        return value.dtype, value.device, value.host_tier
    return value.dtype, value.device, False


def changed_params(engine) -> List[tuple]:
    """``(param, info, (old dtype, old device))`` for every parameter whose stored state no longer
    matches its dtype or device (host-tier state only has to match the dtype). One pass over the
    state per step; parameter descriptions are built only when something changed."""
    changed = {}
    for p, st in engine.state.items():
        if is_dtensor(p):
            continue
        for value in st.values():
            if is_scalar_state(value):
                continue
            dtype, device, host = _stored_form(value)
            if p.is_meta or dtype != p.dtype or (not host and device != p.device):
                changed[id(p)] = (dtype, device)
            break
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
    if isinstance(value, EncodedTensor):
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
        pin = engine.pin_memory if engine.pin_memory is not None else p.device.type == "cuda"
        for key, value in list(st.items()):
            if not is_scalar_state(value):
                st[key] = _moved(value, p, pin)
        log.info("optstate: %s changed from %s on %s to %s on %s after wrapping; its state follows",
                 describe_param(info), dtype, device, p.dtype, p.device)
    engine.invalidate_plan()
